"""Pipeline parallelism (GPipe, Huang et al. 2019) over the mesh's `stage` axis.

The stacked `layers` axis of the params (and of the contiguous KV cache) is split into
`stage` equal parts, one per pipeline stage. The batch is cut into M microbatches; at time
t = 0 .. M + S - 2, stage s runs its layers on microbatch t - s (if it exists) and hands the
activations to stage s + 1 with a `ppermute`. Each stage writes its layers' cache rows for the
microbatch it processes. Idle slots are the bubble: (S - 1) / (M + S - 1) of the stage-time.
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


def _pipelined_layers(cfg, spec: PipelineSpec, layer_params, x, positions, kv, md, attn_impl):
    stages, micro = spec.stages, spec.microbatches
    batch = x.shape[0]
    mb = batch // micro
    layers = scanned_layers(cfg.num_layers // stages)(cfg, attn_impl)

    def stage_fn(layer_params, x, positions, kv, md):
        stage = jax.lax.axis_index("stage")
        xs = x.reshape(micro, mb, *x.shape[1:])
        pos = positions.reshape(micro, mb, *positions.shape[1:])
        num_new = md.num_new.reshape(micro, mb)
        perm = [(i, (i + 1) % stages) for i in range(stages)]

        def tick(t, carry):
            state, outs, kv = carry
            m = t - stage
            valid = (m >= 0) & (m < micro)
            mc = jnp.clip(m, 0, micro - 1)
            inp = jnp.where(stage == 0, xs[jnp.clip(t, 0, micro - 1)], state)
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
            keep = valid & (stage == stages - 1)
            outs = jax.lax.dynamic_update_index_in_dim(outs, jnp.where(keep, out, outs[mc]), mc, 0)
            return jax.lax.ppermute(out, "stage", perm), outs, kv

        init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs), kv)
        _, outs, kv = jax.lax.fori_loop(0, micro + stages - 1, tick, init)
        # The last stage holds the outputs; share them with every stage.
        outs = jax.lax.psum(jnp.where(stage == stages - 1, outs, 0), "stage")
        return outs.reshape(x.shape), kv

    layer_spec = jax.tree.map(lambda a: P("stage"), layer_params)
    kv_spec = None if kv is None else kv.replace(k=P("stage"), v=P("stage"), lengths=P())
    md_spec = jax.tree.map(lambda a: P(), md)
    fn = jax.shard_map(
        stage_fn,
        mesh=spec.mesh,
        in_specs=(layer_spec, P(), P(), kv_spec, md_spec),
        out_specs=(P(), kv_spec),
        axis_names={"stage"},
        check_vma=False,
    )
    return fn(layer_params, x, positions, kv, md)


def pipelined_apply(
    cfg, spec: PipelineSpec, params, tokens, positions, kv, md, logits_index=None, attn_impl=None
):
    """The decoder with its layers pipelined; same inputs and outputs as `Transformer.apply`."""
    check(cfg, spec, tokens.shape[0])
    embedding = params["embed"]
    x = jnp.take(embedding, tokens, axis=0)
    x, kv = _pipelined_layers(cfg, spec, params["layers"], x, positions, kv, md, attn_impl)
    x = RMSNorm(cfg.rms_norm_eps).apply({"params": params["final_norm"]}, x)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
    if cfg.tie_word_embeddings:
        logits = matmul(x, embedding.T)
    else:
        logits = Linear(cfg.vocab_size).apply({"params": params["lm_head"]}, x)
    if kv is not None:
        kv = kv.advance(md)
    return logits.astype(jnp.float32), kv
