"""Building blocks shared by every decoder family: norms, rotary embeddings, linears, MLP and
attention (`model.decoder` puts them, or MLA's and MoE's, together into one decoder layer).
Axis letters follow the glossary in `model/__init__.py`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.model.config import ModelConfig, rope_inv_freq
from jaxgen.pallas_kernels import dispatch
from jaxgen.quant.formats import QArray
from jaxgen.quant.matmul import matmul

_init = nn.initializers.normal(stddev=0.02)


def constrain(x, *axes):
    """Names x's axes for sharding (`sharding.rules` maps names to mesh axes; a no-op with no
    mesh and rules in context)."""
    return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Same order as transformers: normalise in f32, cast, then scale in the input dtype.
        return scale.astype(x.dtype) * x32.astype(x.dtype)


def rotary(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> jax.Array:
    """Rotary embedding, rotate-half layout (GPT-NeoX / transformers).

    Args:
      x: [B, T, heads, H]; positions: i32[B, T]; inv_freq: f32[H/2]; attention_factor: yarn's
        factor on cos and sin (MLA models).
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _gpu_matvec_as_gemm(x, kernel):
    """x @ kernel; for a GPU program with one row (a B=1 decode step), computed on two (the
    second zero, dropped). XLA:GPU's dot strength reduction turns a matrix-vector product into a
    multiply and a reduction, and where sibling products share the row (k/v, gate/up) it fuses
    the multiplies into one kernel whose weight-sized products go through HBM before the
    reductions read them: every such weight is read, written and read again (the deviceless
    compile, `bench.gpu_compile`: each linear of the SmolLM2-135M shape, the 8B shape's k/v).
    Two rows keep it a GEMM that reads the weight once. Not for packed 4-bit weights (int4, nf4,
    mxfp4, nvfp4, ...): as a GEMM their codes are unpacked into a weight-sized byte buffer first
    (int4 at B=1: 3.6 -> 60 MiB of temporaries for 2 layers of the 8B shape), while the
    multiply + reduce reads them packed."""
    rows = x.size // x.shape[-1]
    if rows != 1 or dispatch.target_device()[0] != "gpu":
        return matmul(x, kernel)
    if isinstance(kernel, QArray) and kernel.fmt not in ("int8", "fp8"):
        return matmul(x, kernel)
    flat = x.reshape(1, x.shape[-1])
    y = matmul(jnp.concatenate([flat, jnp.zeros_like(flat)], axis=0), kernel)
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


class Linear(nn.Module):
    """y = x @ W (+ b) with W [in, out]; W may be a quantized `quant.QArray`. With `lora` (a
    `model.lora.LoRABatch`), each token's adapter term for this linear's name is added."""

    features: int
    use_bias: bool = False

    @nn.compact
    def __call__(self, x, lora=None):
        if self.is_initializing():
            kernel = self.param("kernel", _init, (x.shape[-1], self.features))
        else:  # a QArray does not have the float kernel's leaf shapes: skip flax's shape check
            kernel = self.get_variable("params", "kernel")
        y = _gpu_matvec_as_gemm(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,)).astype(y.dtype)
        delta = None if lora is None else lora.delta(self.name, x)
        return y if delta is None else y + delta


class MLP(nn.Module):
    """SwiGLU feed-forward of width `features` (default: the config's intermediate_size);
    `axis` names that width for sharding (a MoE block's shared experts have their own)."""

    cfg: ModelConfig
    features: int | None = None
    axis: str = "mlp"

    @nn.compact
    def __call__(self, x, lora=None):
        f, bias = self.features or self.cfg.intermediate_size, self.cfg.mlp_bias
        gate = Linear(f, bias, name="gate_proj")(x, lora)
        up = Linear(f, bias, name="up_proj")(x, lora)
        act = constrain(nn.silu(gate) * up, "batch", "seq", self.axis)
        return Linear(self.cfg.hidden_size, bias, name="down_proj")(act, lora)


class Attention(nn.Module):
    cfg: ModelConfig
    attn_impl: str | None = None

    @nn.compact
    def __call__(self, x, positions, kv, layer, md, lora=None):
        cfg = self.cfg
        b, t, _ = x.shape
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_btnh = Linear(n * h, cfg.qkv_bias, name="q_proj")(x, lora).reshape(b, t, n, h)
        k_btkh = Linear(k * h, cfg.qkv_bias, name="k_proj")(x, lora).reshape(b, t, k, h)
        v_btkh = Linear(k * h, cfg.qkv_bias, name="v_proj")(x, lora).reshape(b, t, k, h)
        if cfg.qk_norm:
            q_btnh = RMSNorm(cfg.rms_norm_eps, name="q_norm")(q_btnh)
            k_btkh = RMSNorm(cfg.rms_norm_eps, name="k_norm")(k_btkh)
        inv_freq = rope_inv_freq(cfg)
        q_btnh = constrain(rotary(q_btnh, positions, inv_freq), "batch", "seq", "heads", "head_dim")
        # Sequence parallelism gathers the keys/values of every sequence shard here
        # ("kv_seq" is never split): each query shard attends over the whole context.
        k_btkh = constrain(
            rotary(k_btkh, positions, inv_freq), "batch", "kv_seq", "kv_heads", "head_dim"
        )
        v_btkh = constrain(v_btkh, "batch", "kv_seq", "kv_heads", "head_dim")
        opts = dict(sm_scale=h**-0.5, sliding_window=cfg.sliding_window)
        if kv is None:
            out = dispatch.attention(
                q_btnh, k_btkh, v_btkh, kv_lens=md.num_new, impl=self.attn_impl, **opts
            )
        else:
            out, kv = kv.attend(layer, q_btnh, k_btkh, v_btkh, md, impl=self.attn_impl, **opts)
        out = constrain(out, "batch", "seq", "heads", "head_dim")
        out = Linear(cfg.hidden_size, cfg.o_bias, name="o_proj")(out.reshape(b, t, n * h), lora)
        return out, kv
