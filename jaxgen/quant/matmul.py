"""The model's matmul helper: dispatches on the weight's type, so model code never changes
when a weight is quantized. Quantized weights are dequantized inside the matmul (group-wise
partial products in f32, then scaled); the full-precision weight is never kept between calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.quant.formats import QArray


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype."""
    if isinstance(w, QArray):
        return qmatmul(x, w)
    return jnp.matmul(x, w.astype(x.dtype))


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    if w.act_quant == "int8":
        return w8a8_matmul(x, w)
    if w.act_quant == "llm_int8":
        return llm_int8_matmul(x, w)
    return _grouped_matmul(x, w, w.code_values(x.dtype)).astype(x.dtype)


def _grouped_matmul(x, w: QArray, codes):
    """sum_g scale[g] * (x_g @ codes_g) - offset[g] * sum(x_g), f32 accumulation."""
    rows, out = codes.shape[-2:]
    groups = rows // w.group_size
    scales = w.float_scales()
    if rows != x.shape[-1]:  # a ragged last group: zero activations for the padded rows
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, rows - x.shape[-1])])
    xg = x.reshape(*x.shape[:-1], groups, w.group_size)
    cg = codes.reshape(groups, w.group_size, out)
    part = jnp.einsum("...Gg,Ggo->...Go", xg, cg, preferred_element_type=jnp.float32)
    y = jnp.sum(part * scales, axis=-2)
    offsets = w.float_offsets()
    if offsets is not None:
        y = y - jnp.einsum("...G,Go->...o", jnp.sum(xg.astype(jnp.float32), axis=-1), offsets)
    return y


def quantize_per_token(x):
    """Symmetric int8 per token (row): (values int8 [..., in], scales f32 [..., 1])."""
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 127.0
    q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)).astype(jnp.int8)
    return q, scale


def int8_matmul(xq, codes):
    """int8 x int8 -> int32 (exact integer accumulation)."""
    return jax.lax.dot_general(
        xq, codes, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )


def w8a8_matmul(x, w: QArray):
    """SmoothQuant W8A8: per-token int8 activations x per-channel int8 weights, int32 sums."""
    xq, sx = quantize_per_token(x)
    acc = int8_matmul(xq, w.codes())
    return (acc.astype(jnp.float32) * sx * w.float_scales()[0]).astype(x.dtype)


def llm_int8_matmul(x, w: QArray):
    """LLM.int8() (Dettmers et al. 2022): activations above the outlier threshold are
    multiplied in floating point (with the dequantized weight rows); the rest goes through
    per-token int8 x per-channel int8 with int32 accumulation; the two are summed.

    The decomposition is decided per token at run time (each token's own entries above the
    threshold), not per feature column of the batch: a token's result then does not depend on
    which other tokens share its batch (prefill of 1024 tokens and decode of one agree), and a
    token's int8 scale never includes its own outliers."""
    outlier = jnp.abs(x) > w.outlier_threshold  # [..., in]
    regular = jnp.where(outlier, 0, x)
    xq, sx = quantize_per_token(regular)
    acc = int8_matmul(xq, w.codes())
    y = acc.astype(jnp.float32) * sx * w.float_scales()[0]
    codes = w.codes().astype(jnp.float32)
    high = jnp.where(outlier, x, 0).astype(jnp.float32)
    y = y + (high @ codes) * w.float_scales()[0]
    return y.astype(x.dtype)
