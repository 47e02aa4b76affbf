"""Llama-family decoder (Llama 1/2/3, Mistral, Qwen2, Qwen3, SmolLM2; with `model.moe`, Mixtral and
Qwen3-MoE), used functionally:

    logits, kv = Transformer(cfg).apply({"params": params}, tokens, positions, kv, md)
    logits, kv = Transformer(cfg).apply(..., lora=LoRABatch(weights, adapter_ids))  # multi-LoRA

Per-layer params are stacked on a leading `layers` axis and run with `nn.scan`, so compile
time does not grow with depth. The cache (`kv`) rides in the scan carry and each layer writes
its slice in place.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgen.cache.contiguous import StepMetadata
from jaxgen.model.config import ModelConfig
from jaxgen.model.decoder import DecoderLayer
from jaxgen.model.layers import Linear, RMSNorm, _init, constrain
from jaxgen.model.lora import LoRABatch
from jaxgen.quant.matmul import matmul


def layer_segments(cfg: ModelConfig) -> tuple[tuple[str, int, bool], ...]:
    """(param key, number of layers, sparse) of each scan, in order. A dense model is one scan
    "layers"; a MoE model whose first layers keep a dense MLP (DeepSeek's
    first_k_dense_replace, Qwen3-MoE's mlp_only_layers) runs those as a second scan,
    "dense_layers", before "layers": two scans whatever the depth, and the layer index in the
    carry runs on across them, so the cache sees layers 0..L-1."""
    if cfg.moe is None:
        return (("layers", cfg.num_layers, False),)
    dense = cfg.moe.first_dense_layers
    sparse = ("layers", cfg.num_layers - dense, True)
    return ((("dense_layers", dense, False),) if dense else ()) + (sparse,)


def scanned_layers(num_layers: int, lora: bool = False):
    """DecoderLayer scanned over a stacked leading `layers` axis of its params (and of the
    cache, through the layer index in the carry). With `lora`, the layers take a third argument,
    a `LoRABatch`, whose weights are stacked on `layers` too and whose token ids all share.
    Construct the result with (cfg, attn_impl, sparse); sparse layers run the config's MoE."""
    in_axes = (nn.broadcast, nn.broadcast)
    if lora:
        in_axes += (LoRABatch(weights=0, adapter_ids=nn.broadcast),)
    return nn.scan(
        DecoderLayer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=in_axes,
        length=num_layers,
    )


class Transformer(nn.Module):
    cfg: ModelConfig
    attn_impl: str | None = None

    @nn.compact
    def __call__(
        self,
        tokens,
        positions=None,
        kv=None,
        md=None,
        logits_index=None,
        lora=None,
        return_hidden: bool | tuple[int, ...] = False,
    ):
        """Runs the decoder.

        Args:
          tokens: i32[B, T].
          positions: i32[B, T] absolute positions (default: the cache's next positions, or
            0..T-1 without a cache).
          kv: a cache pytree with ``attend``/``advance`` (e.g. `cache.KVCache`) or None.
          md: per-step metadata for the cache (default: all T tokens valid, fresh).
          logits_index: optional i32[B, R]: compute logits only at these token indices.
          lora: optional `model.lora.LoRABatch`: adapters stacked on `layers` and the adapter
            of each token (adapter_ids i32[B, T]); None runs the base model alone.
          return_hidden: True: also return every token's last hidden state after the final norm
            ([B, T, D], what a multi-token-prediction drafter reads: `model.mtp`). A tuple of
            layer indices i in [0, L]: also return the residual stream entering layer i (the
            output of the first i layers, before any norm; i = L is the last layer's output) at
            each, stacked [len, B, T, D] in the order given (EAGLE-3's fused target states,
            `model.eagle`).
        Returns:
          (logits f32[B, T or R, V], kv advanced by the step's new tokens), then the hidden
          states with return_hidden.
        """
        cfg = self.cfg
        batch, num_tokens = tokens.shape
        if md is None:
            md = StepMetadata(num_new=jnp.full((batch,), num_tokens, jnp.int32), fresh=kv is None)
        if positions is None:
            positions = (
                kv.positions(num_tokens)
                if kv is not None
                else jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), tokens.shape)
            )
        embedding = self.param("embed", _init, (cfg.vocab_size, cfg.hidden_size))
        x = constrain(jnp.take(embedding, tokens, axis=0), "batch", "seq", "embed")
        if lora is not None and lora.adapter_ids.shape != tokens.shape:
            raise ValueError(f"{lora.adapter_ids.shape=} must be {tokens.shape=}")
        if lora is not None and cfg.moe is not None:
            raise ValueError("LoRA adapters are not supported on Mixture-of-Experts models")
        layer_args = (positions, md) if lora is None else (positions, md, lora)
        collect = _collected_layers(return_hidden, cfg.num_layers)
        states = [x[None]] if collect else None  # the residual stream after 0, 1, ... layers
        carry = (x, kv, jnp.int32(0))
        first = 0
        for key, count, sparse in layer_segments(cfg):
            if self.has_variable("params", f"{key}_0"):  # per-layer params: see unroll_layers
                for i in range(count):
                    # The layer index is a Python int here: the cache sees a static layer (no
                    # dynamic slice; decode attention reads it in place, see cached_attention).
                    carry = (carry[0], carry[1], first + i)
                    layer_lora = () if lora is None else (_layer_lora(lora, first + i),)
                    carry, _ = DecoderLayer(cfg, self.attn_impl, sparse, name=f"{key}_{i}")(
                        carry, positions, md, *layer_lora
                    )
                    if collect:
                        states.append(carry[0][None])
                carry = (carry[0], carry[1], jnp.int32(first + count))
            else:
                carry, ys = scanned_layers(count, lora is not None)(
                    cfg, self.attn_impl, sparse, collect=bool(collect), name=key
                )(carry, *layer_args)
                if collect:
                    states.append(ys)
            first += count
        x, kv, _ = carry
        x = hidden = RMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
        if cfg.tie_word_embeddings:
            logits = matmul(x, embedding.T)
        else:
            logits = Linear(cfg.vocab_size, name="lm_head")(x)
        if kv is not None:
            kv = kv.advance(md)
        logits = constrain(logits.astype(jnp.float32), "batch", "seq", "vocab")
        if collect:
            return logits, kv, jnp.concatenate(states, axis=0)[jnp.asarray(collect)]
        return (logits, kv, hidden) if return_hidden else (logits, kv)


def _collected_layers(return_hidden, num_layers: int) -> tuple[int, ...] | None:
    """The layer indices `return_hidden` asks for, checked; None for a bool."""
    if isinstance(return_hidden, bool):
        return None
    indices = tuple(int(i) for i in return_hidden)
    if not indices or any(not 0 <= i <= num_layers for i in indices):
        raise ValueError(
            f"return_hidden layer indices must be in [0, {num_layers}] (the residual stream "
            f"entering layer i; {num_layers} = after the last layer), got {return_hidden!r}"
        )
    return indices


def _layer_lora(lora: LoRABatch, index: int) -> LoRABatch:
    return lora.replace(weights=jax.tree.map(lambda w: w[index], lora.weights))


def unroll_layers(params, cfg: ModelConfig):
    """The params with each stacked layer segment ("layers" [L, ...]) split into per-layer
    entries "layers_0" ... "layers_{L-1}"; `Transformer` then runs the layers one after another
    instead of scanning them.

    Why: in a scan, each layer's weights are a dynamic slice of the stacked arrays, and XLA:GPU
    (and XLA:CPU) materialises that slice as a copy before the matmul: every decode step then
    reads the weights twice and writes them once (measured on an H200, 8B shape, B=1 x 1k:
    unrolling took the step's device time from 14.0 to 8.2 ms; docs/gpu_decode.md). Per-layer
    arrays are read in place. Call it outside jit (the split is a one-time copy; the stacked
    arrays can be dropped after), on params already quantized or sharded as they will run."""
    if any(f"{key}_0" in params for key, _, _ in layer_segments(cfg)):
        return params
    out = {k: v for k, v in params.items() if k not in {s[0] for s in layer_segments(cfg)}}
    for key, count, _ in layer_segments(cfg):
        stacked = params[key]
        for i in range(count):
            out[f"{key}_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return out


def init_params(cfg: ModelConfig, rng: jax.Array, dtype=jnp.float32):
    """Random parameters (normal(0.02) weights, unit norms) as a plain nested dict."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    params = jax.jit(Transformer(cfg).init)(rng, tokens)["params"]
    return jax.tree.map(lambda p: p.astype(dtype), params)


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"))
def _forward(params, tokens, positions, lora, *, cfg, attn_impl=None):
    logits, _ = Transformer(cfg, attn_impl).apply({"params": params}, tokens, positions, lora=lora)
    return logits


def forward(
    cfg: ModelConfig, params, tokens, positions=None, *, attn_impl=None, lora=None
) -> jax.Array:
    """Full-sequence scoring without a cache: logits f32[B, T, V] for tokens i32[B, T].

    `lora`: optional `model.lora.LoRABatch` (adapter_ids i32[B, T], -1 = no adapter)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if lora is not None:
        lora.check(tokens.shape)
        lora = lora.replace(adapter_ids=jnp.asarray(lora.adapter_ids, jnp.int32))
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return _forward(params, tokens, positions, lora, cfg=cfg, attn_impl=attn_impl)


# Logical axes of each linear's kernel [in, out] (see sharding.rules for what they map to).
_KERNEL_AXES = {
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    # Multi-head Latent Attention: the low-rank bottlenecks stay whole, heads split after them.
    "q_a_proj": ("embed", None),
    "q_b_proj": (None, "heads"),
    "kv_a_proj_with_mqa": ("embed", None),
    "kv_b_proj": (None, "heads"),
}


def param_logical_axes(params):
    """A tree like `params` whose leaves are tuples of logical axis names (one per dim).

    q/k/v and gate/up are column-parallel (output split), o_proj and down_proj row-parallel
    (input split), the embedding and LM head vocab-parallel (Megatron-LM). Quantized kernels
    (QArray) split their values like the kernel and keep per-group scales whole on the input.
    """

    def axes(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if keys[0] == "mtp":  # DeepSeek-V3's MTP module (model.mtp): one stacked layer
            if keys[1] != "layer":
                return ("embed",) if keys[1] != "eh_proj" else (None, "embed")
            keys = ["layers", *keys[2:]]
        if keys[0] == "dense_layers":
            keys[0] = "layers"
        if keys[:2] == ["layers", "moe"]:
            return _moe_axes(keys[2:])
        if keys[0] == "embed":
            return ("vocab", "embed")
        if keys[0] == "final_norm":
            return ("embed",)
        if keys[0] == "lm_head":
            kin, kout = ("embed", "vocab")
        else:
            name = keys[2] if keys[1] in ("attn", "mlp") else keys[1]
            if name in ("attn_norm", "mlp_norm"):
                return ("layers", "embed")
            if name in ("q_norm", "k_norm"):
                return ("layers", "head_dim")
            if name in ("q_a_layernorm", "kv_a_layernorm"):
                return ("layers", None)
            kin, kout = _KERNEL_AXES[name]
            if keys[3] == "bias":
                return ("layers", kout)
        lead = () if keys[0] == "lm_head" else ("layers",)
        field = keys[-1] if len(keys) > (2 if keys[0] == "lm_head" else 4) else "kernel"
        if field in ("kernel", "values"):
            return (*lead, kin, kout)
        if field in ("scales", "zeros"):
            return (*lead, None, kout)
        return (*lead, None)  # scale_scales

    return jax.tree_util.tree_map_with_path(axes, params)


def _moe_axes(keys):
    """Logical axes of a stacked MoE block's leaf (`keys`: its path below "moe")."""
    if keys[0] == "router":
        return ("layers", "embed", None)
    if keys[0] == "e_score_correction_bias":
        return ("layers", None)
    if keys[0] == "experts":
        if keys[1] == "down_proj":
            return ("layers", "experts", "expert_mlp", "embed")
        return ("layers", "experts", "embed", "expert_mlp")
    # shared_experts/{gate,up,down}_proj/kernel
    kin, kout = _KERNEL_AXES[keys[1]]
    return ("layers", *(("shared_mlp" if a == "mlp" else a) for a in (kin, kout)))
