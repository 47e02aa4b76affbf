"""FlashAttention for prefill: tiled online softmax over K/V blocks (FlashAttention-2).

Semantics (the kernel and `flash_attention_reference` agree on them):

  q  [B, T, N, H]   queries; row b's query i sits at absolute position q_offsets[b] + i
  k  [B, S, K, H]   keys at absolute positions 0..S-1; N is a multiple of K (GQA: query head
  v  [B, S, K, H]   n reads kv head n // (N // K))
  kv_lens  i32[B]   keys at positions >= kv_lens[b] are padding and never attended
  q_offsets i32[B]  (default 0)

Query i of row b attends to key j iff j < kv_lens[b], and (causal) j <= q_offsets[b] + i, and
(sliding window w) j > q_offsets[b] + i - w. A query with no key to attend produces zeros.
Scores are ``sm_scale * q.k``, optionally soft-capped ``cap * tanh(s / cap)`` (Gemma 2).
Accumulation is f32 whatever the input dtype; the output has q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite mask value: -inf - (-inf) = NaN in the online-softmax rescale, a large finite
# negative number underflows to exactly 0 after exp instead.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(
    num_queries: int,
    num_keys: int,
    *,
    kv_lens: jax.Array,
    q_offsets: jax.Array,
    causal: bool,
    sliding_window: int | None,
) -> jax.Array:
    """bool[B, T, S]: which key each query may attend (see the module docstring)."""
    q_pos = q_offsets[:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None, :]  # [B, T]
    kv_pos = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = kv_pos < kv_lens[:, None, None]
    if causal:
        mask &= kv_pos <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= kv_pos > q_pos[:, :, None] - sliding_window
    return mask


def _defaults(q, k, kv_lens, q_offsets, sm_scale):
    batch = q.shape[0]
    if kv_lens is None:
        kv_lens = jnp.full((batch,), k.shape[1], jnp.int32)
    if q_offsets is None:
        q_offsets = jnp.zeros((batch,), jnp.int32)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    return kv_lens.astype(jnp.int32), q_offsets.astype(jnp.int32), sm_scale


def check_shapes(q, k, v, kv_lens=None, q_offsets=None):
    """Raises ValueError for inconsistent attention inputs (user-facing contract)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"expected q [B,T,N,H], k/v [B,S,K,H]; got {q.shape=} {k.shape=} {v.shape=}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape: {k.shape=} vs {v.shape=}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"batch and head_dim of q and k must agree: {q.shape=} vs {k.shape=}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads must be a multiple of kv heads: {q.shape=} vs {k.shape=}")
    for name, arr in (("kv_lens", kv_lens), ("q_offsets", q_offsets)):
        if arr is not None and arr.shape != (q.shape[0],):
            raise ValueError(f"{name} must have shape (B,) = ({q.shape[0]},), got {arr.shape}")


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    kv_lens: jax.Array | None = None,
    q_offsets: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Dense attention with the kernel's semantics, accumulating in f32.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H]; kv_lens, q_offsets: i32[B] or None.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    check_shapes(q, k, v, kv_lens, q_offsets)
    kv_lens, q_offsets, sm_scale = _defaults(q, k, kv_lens, q_offsets, sm_scale)
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.reshape(batch, num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum(
        "BTKGH,BSKH->BKGTS",
        qg,
        k,
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )
    s = s * sm_scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    mask = attention_mask(
        num_q,
        k.shape[1],
        kv_lens=kv_lens,
        q_offsets=q_offsets,
        causal=causal,
        sliding_window=sliding_window,
    )[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    # Padded keys may hold garbage (even NaN); zero them so 0 * NaN cannot leak in.
    v_valid = jnp.arange(k.shape[1])[None, :, None, None] < kv_lens[:, None, None, None]
    v = jnp.where(v_valid, v, jnp.zeros_like(v))
    out = jnp.einsum(
        "BKGTS,BSKH->BTKGH",
        p,
        v.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return out.reshape(q.shape).astype(q.dtype)
