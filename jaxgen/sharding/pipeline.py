"""Pipeline parallelism (GPipe, Huang et al. 2019) over the mesh's `stage` axis.

The stacked `layers` axis of the params (and of the KV cache) is split into `stage` equal
parts, one per pipeline stage. The work is cut into M microbatches; at time t = 0 .. M + S - 2,
stage s runs its layers on microbatch t - s (if it exists) and hands the activations to stage
s + 1 with a `ppermute`. Each stage writes its layers' cache entries for the microbatch it
processes. Idle slots are the bubble: (S - 1) / (M + S - 1) of the stage-time.

Two cache layouts ride through the same schedule: the contiguous cache's microbatches are
slices of its batch rows (`pipelined_apply`, the static-batch engine); the paged pool is shared
by every microbatch, which are whole packed steps of disjoint sequences writing their own pages
(`pipelined_ragged_layers`, the continuous-batching engine).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxgen.model.layers import Linear, RMSNorm
from jaxgen.model.llama import scanned_layers
from jaxgen.quant.matmul import matmul


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    mesh: Mesh
    microbatches: int

    @property
    def stages(self) -> int:
        return self.mesh.shape["stage"]

    @property
    def bubble_fraction(self) -> float:
        s, m = self.stages, self.microbatches
        return (s - 1) / (m + s - 1)


def check(cfg, spec: PipelineSpec, batch: int) -> None:
    if cfg.num_layers % spec.stages:
        raise ValueError(f"{cfg.num_layers} layers cannot be split into {spec.stages} stages")
    if batch % spec.microbatches:
        raise ValueError(f"batch {batch} is not a multiple of {spec.microbatches} microbatches")


def _gpipe(stages: int, stage_body, xs, kv):
    """The GPipe schedule inside a `shard_map` over "stage".

    `stage_body(inp, m, valid, kv) -> (out, kv)` runs this stage's layers on microbatch `m`
    (`valid` is False in the bubble, where the body must leave the cache as it is). `xs` holds
    the M microbatches' inputs on a leading axis; returns their outputs (on every stage) and
    the cache."""
    micro = xs.shape[0]
    stage = jax.lax.axis_index("stage")
    perm = [(i, (i + 1) % stages) for i in range(stages)]

    def tick(t, carry):
        state, outs, kv = carry
        m = t - stage
        valid = (m >= 0) & (m < micro)
        mc = jnp.clip(m, 0, micro - 1)
        inp = jnp.where(stage == 0, xs[jnp.clip(t, 0, micro - 1)], state)
        out, kv = stage_body(inp, mc, valid, kv)
        keep = valid & (stage == stages - 1)
        outs = jax.lax.dynamic_update_index_in_dim(outs, jnp.where(keep, out, outs[mc]), mc, 0)
        return jax.lax.ppermute(out, "stage", perm), outs, kv

    init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs), kv)
    _, outs, kv = jax.lax.fori_loop(0, micro + stages - 1, tick, init)
    # The last stage holds the outputs; share them with every stage.
    return jax.lax.psum(jnp.where(stage == stages - 1, outs, 0), "stage"), kv


def _stage_map(spec: PipelineSpec, fn, layer_params, kv, kv_spec, *args):
    """shard_map of `fn(layer_params, kv, *args)` over "stage" only (other axes stay automatic):
    layers and the cache split by stage, every other argument replicated."""
    layer_spec = jax.tree.map(lambda a: P("stage"), layer_params)
    arg_specs = tuple(jax.tree.map(lambda a: P(), a) for a in args)
    return jax.shard_map(
        fn,
        mesh=spec.mesh,
        in_specs=(layer_spec, kv_spec, *arg_specs),
        out_specs=(P(), kv_spec),
        axis_names={"stage"},
        check_vma=False,
    )(layer_params, kv, *args)


def _pipelined_layers(cfg, spec: PipelineSpec, layer_params, x, positions, kv, md, attn_impl):
    stages, micro = spec.stages, spec.microbatches
    batch = x.shape[0]
    mb = batch // micro
    layers = scanned_layers(cfg.num_layers // stages)(cfg, attn_impl, cfg.moe is not None)

    def stage_fn(layer_params, kv, x, positions, md):
        pos = positions.reshape(micro, mb, *positions.shape[1:])
        num_new = md.num_new.reshape(micro, mb)

        def body(inp, mc, valid, kv):
            md_m = md.replace(num_new=jnp.where(valid, num_new[mc], 0))
            kv_m = None
            if kv is not None:
                rows = mc * mb
                kv_m = kv.replace(
                    k=jax.lax.dynamic_slice_in_dim(kv.k, rows, mb, axis=1),
                    v=jax.lax.dynamic_slice_in_dim(kv.v, rows, mb, axis=1),
                    lengths=jax.lax.dynamic_slice_in_dim(kv.lengths, rows, mb),
                )
            (out, kv_new, _), _ = layers.apply(
                {"params": layer_params}, (inp, kv_m, jnp.int32(0)), pos[mc], md_m
            )
            if kv is not None:  # invalid ticks write back what they read (num_new = 0 anyway)
                kv = kv.replace(
                    k=jax.lax.dynamic_update_slice_in_dim(kv.k, kv_new.k, mc * mb, axis=1),
                    v=jax.lax.dynamic_update_slice_in_dim(kv.v, kv_new.v, mc * mb, axis=1),
                )
            return out, kv

        outs, kv = _gpipe(stages, body, x.reshape(micro, mb, *x.shape[1:]), kv)
        return outs.reshape(x.shape), kv

    kv_spec = None if kv is None else kv.replace(k=P("stage"), v=P("stage"), lengths=P())
    return _stage_map(spec, stage_fn, layer_params, kv, kv_spec, x, positions, md)


def pipelined_ragged_layers(
    cfg, spec: PipelineSpec, layer_params, xs, positions, kv, md, attn_impl
):
    """The decoder layers over M packed steps of the paged engine, pipelined over the stages.

    Args:
      xs: [M, 1, N, D] embedded tokens of each microbatch (one packed row each).
      positions: i32[M, N].
      kv: the `cache.PagedKVCache` pool, shared by the microbatches (their sequences, and so
        their pages, are disjoint; page copies are done before).
      md: `cache.paged.RaggedMetadata` whose arrays have a leading M axis (static fields, the
        packed layout, are the same for all).
    Returns:
      (hidden [M, 1, N, D] after the last layer, the pool).
    """
    layers = scanned_layers(cfg.num_layers // spec.stages)(cfg, attn_impl, cfg.moe is not None)

    def stage_fn(layer_params, kv, xs, positions, md):
        def body(inp, mc, valid, kv):
            md_m = jax.tree.map(lambda a: a[mc], md)
            # In the bubble nothing is written: every slot is padding.
            md_m = md_m.replace(slot_mapping=jnp.where(valid, md_m.slot_mapping, -1))
            (out, kv, _), _ = layers.apply(
                {"params": layer_params}, (inp, kv, jnp.int32(0)), positions[mc][None], md_m
            )
            return out, kv

        return _gpipe(spec.stages, body, xs, kv)

    stage = P("stage")
    kv_spec = kv.replace(
        k=stage,
        v=stage,
        k_scales=None if kv.k_scales is None else stage,
        v_scales=None if kv.v_scales is None else stage,
    )
    return _stage_map(spec, stage_fn, layer_params, kv, kv_spec, xs, positions, md)


def lm_head(cfg, params, x, logits_index=None):
    """Final norm and logits f32 of hidden states [B, T, D] (at `logits_index` [B, R] only)."""
    x = RMSNorm(cfg.rms_norm_eps).apply({"params": params["final_norm"]}, x)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
    if cfg.tie_word_embeddings:
        logits = matmul(x, params["embed"].T)
    else:
        logits = Linear(cfg.vocab_size).apply({"params": params["lm_head"]}, x)
    return logits.astype(jnp.float32)


def pipelined_apply(
    cfg, spec: PipelineSpec, params, tokens, positions, kv, md, logits_index=None, attn_impl=None
):
    """The decoder with its layers pipelined; same inputs and outputs as `Transformer.apply`."""
    check(cfg, spec, tokens.shape[0])
    x = jnp.take(params["embed"], tokens, axis=0)
    x, kv = _pipelined_layers(cfg, spec, params["layers"], x, positions, kv, md, attn_impl)
    logits = lm_head(cfg, params, x, logits_index)
    if kv is not None:
        kv = kv.advance(md)
    return logits, kv
