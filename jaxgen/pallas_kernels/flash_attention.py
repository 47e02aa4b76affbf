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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite mask value: -inf - (-inf) = NaN in the online-softmax rescale, a large finite
# negative number underflows to exactly 0 after exp instead.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def mma(a, b, *, trans_a=False, trans_b=False, precision=None):
    """2-D matrix product inside a kernel, f32 accumulation (``a.T``/``b.T`` when asked).

    Written on ``lax.dot_general`` (``pl.dot`` was removed in JAX 0.11); the Triton lowering
    maps the transposed contractions onto ``tl.dot`` without materialising a transpose.
    """
    if precision is None and a.dtype == b.dtype == jnp.float32:
        precision = jax.lax.Precision.HIGHEST  # Triton would otherwise round f32 to TF32
    return jax.lax.dot_general(
        a,
        b,
        (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def online_softmax_step(s, mask, v, m_i, l_i, acc):
    """One key block of an online softmax (FlashAttention-2 Alg. 1, lines 8-10): scores s
    [rows, keys] masked by `mask`, values v [keys, H], into the running (max, sum, f32 acc)."""
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    acc = acc * alpha[:, None] + mma(p.astype(v.dtype), v)
    return m_new, alpha * l_i + jnp.sum(p, axis=1), acc


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


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. Rows of a query tile are (query, head-in-group) pairs, so one program
    holds block_m // G queries of all G heads that share a KV head and loads each K/V tile once
    for the whole group (GQA without repeating K/V)."""

    block_m: int = 64  # query rows (query x group head) per program
    block_k: int = 64  # keys per inner-loop step
    block_m_bwd: int = 32
    block_k_bwd: int = 32
    num_warps: int | None = None  # default: 4 for head_dim <= 64, else 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_m_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value}")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: a jit / custom_vjp non-diff argument)."""

    num_groups: int
    seq_q: int  # real T
    seq_k: int  # real S
    head_dim: int  # real H (unpadded)
    causal: bool
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    blocks: BlockSizes
    interpret: bool


def _q_positions(offset, row_start, block_m, num_groups):
    """Absolute position of each row of a query tile: row r holds query r // G."""
    rows = row_start + jnp.arange(block_m, dtype=jnp.int32)
    return offset + rows // num_groups


def _scores(q, k, st: _Static):
    """Scaled (and soft-capped) q.k^T in f32; also returns tanh for the cap's derivative."""
    s = mma(q, k, trans_b=True) * st.sm_scale
    if st.soft_cap is None:
        return s, None
    t = jnp.tanh(s / st.soft_cap)
    return st.soft_cap * t, t


def _mask(q_pos, kv_pos, kv_len, st: _Static):
    """bool[block_m, block_k] for query positions [block_m] and key positions [block_k]."""
    mask = kv_pos[None, :] < kv_len
    if st.causal:
        mask &= kv_pos[None, :] <= q_pos[:, None]
    if st.sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - st.sliding_window
    return mask


def _key_block_range(q_first, q_last, kv_len, block_k, st: _Static):
    """[first, last) key blocks that queries at positions q_first..q_last can attend."""
    hi = kv_len
    if st.causal:
        hi = jnp.minimum(hi, q_last + 1)
    lo = jnp.int32(0)
    if st.sliding_window is not None:
        lo = jnp.maximum(q_first - st.sliding_window + 1, 0)
    return lo // block_k, pl.cdiv(jnp.maximum(hi, 0), block_k)


def _fwd_kernel(kv_lens_ref, q_offsets_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static):
    # kv_lens_ref, q_offsets_ref: i32[B_pad] (whole arrays)
    # q_ref: [block_m, Hp] rows (query, group head) of one (batch, kv head)
    # k_ref, v_ref: [Sp, Hp] all keys/values of that (batch, kv head)
    # o_ref: [block_m, Hp]; lse_ref: f32[block_m] log-sum-exp per row (for the backward)
    b, m_blk = pl.program_id(0), pl.program_id(2)
    block_m, block_k = q_ref.shape[0], st.blocks.block_k
    kv_len = jnp.minimum(kv_lens_ref[b], st.seq_k)
    q_off, row0 = q_offsets_ref[b], m_blk * block_m
    q_pos = _q_positions(q_off, row0, block_m, st.num_groups)
    q = q_ref[...]
    first, last = _key_block_range(
        q_off + row0 // st.num_groups,
        q_off + (row0 + block_m - 1) // st.num_groups,
        kv_len,
        block_k,
        st,
    )

    def body(j, carry):
        m_i, l_i, acc = carry
        keys = pl.ds(j * block_k, block_k)
        kv_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        s, _ = _scores(q, k_ref[keys, :], st)
        mask = _mask(q_pos, kv_pos, kv_len, st)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # fully masked rows stay 0
        v = v_ref[keys, :]
        v = jnp.where((kv_pos < kv_len)[:, None], v, jnp.zeros_like(v))  # padding may be NaN
        acc = acc * alpha[:, None] + mma(p.astype(v.dtype), v)
        return m_new, alpha * l_i + jnp.sum(p, axis=1), acc

    init = (
        jnp.full((block_m,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    m_i, l_i, acc = jax.lax.fori_loop(first, last, body, init)
    empty = l_i == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l_i)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m_i + jnp.log(jnp.where(empty, 1.0, l_i)))


def _bwd_kv_kernel(
    kv_lens_ref,
    q_offsets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    st: _Static,
):
    # q_ref, do_ref: [Mp, Hp] all rows of one (batch, kv head); lse_ref, delta_ref: f32[Mp]
    # k_ref, v_ref, dk_ref, dv_ref: [block_k, Hp] one key tile
    b, n_blk = pl.program_id(0), pl.program_id(2)
    block_k, block_m = k_ref.shape[0], st.blocks.block_m_bwd
    kv_len = jnp.minimum(kv_lens_ref[b], st.seq_k)
    q_off = q_offsets_ref[b]
    kv_pos = n_blk * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k, v = k_ref[...], v_ref[...]
    valid = (kv_pos < kv_len)[:, None]
    k = jnp.where(valid, k, jnp.zeros_like(k))
    v = jnp.where(valid, v, jnp.zeros_like(v))
    num_rows = st.seq_q * st.num_groups
    # Rows whose queries can see this tile: causal needs q_pos >= first key; a window needs
    # q_pos < last key + window.
    row_lo = jnp.int32(0)
    if st.causal:
        row_lo = jnp.maximum((n_blk * block_k - q_off) * st.num_groups, 0)
    row_hi = jnp.int32(num_rows)
    if st.sliding_window is not None:
        last_q = (n_blk + 1) * block_k - 1 + st.sliding_window - 1 - q_off
        row_hi = jnp.clip((last_q + 1) * st.num_groups, 0, num_rows)

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(i * block_m, block_m)
        q, do = q_ref[rows, :], do_ref[rows, :]
        q_pos = _q_positions(q_off, i * block_m, block_m, st.num_groups)
        s, t = _scores(q, k, st)
        mask = _mask(q_pos, kv_pos, kv_len, st)
        p = jnp.where(mask, jnp.exp(s - lse_ref[rows][:, None]), 0.0)
        dv = dv + mma(p.astype(do.dtype), do, trans_a=True)
        dp = mma(do, v, trans_b=True)
        ds = p * (dp - delta_ref[rows][:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk = dk + mma(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(row_lo // block_m, pl.cdiv(row_hi, block_m), body, (zeros, zeros))
    dk_ref[...] = (dk * st.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_q_kernel(
    kv_lens_ref,
    q_offsets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    st: _Static,
):
    # q_ref, do_ref, dq_ref: [block_m, Hp]; lse_ref, delta_ref: f32[block_m]
    # k_ref, v_ref: [Sp, Hp] all keys/values of one (batch, kv head)
    b, m_blk = pl.program_id(0), pl.program_id(2)
    block_m, block_k = q_ref.shape[0], st.blocks.block_k_bwd
    kv_len = jnp.minimum(kv_lens_ref[b], st.seq_k)
    q_off, row0 = q_offsets_ref[b], m_blk * block_m
    q_pos = _q_positions(q_off, row0, block_m, st.num_groups)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    first, last = _key_block_range(
        q_off + row0 // st.num_groups,
        q_off + (row0 + block_m - 1) // st.num_groups,
        kv_len,
        block_k,
        st,
    )

    def body(j, dq):
        keys = pl.ds(j * block_k, block_k)
        kv_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        valid = (kv_pos < kv_len)[:, None]
        k, v = k_ref[keys, :], v_ref[keys, :]
        k = jnp.where(valid, k, jnp.zeros_like(k))
        v = jnp.where(valid, v, jnp.zeros_like(v))
        s, t = _scores(q, k, st)
        p = jnp.where(_mask(q_pos, kv_pos, kv_len, st), jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (mma(do, v, trans_b=True) - delta[:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        return dq + mma(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(first, last, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.sm_scale).astype(dq_ref.dtype)


def _compiler_params(st: _Static, head_dim_padded: int):
    warps = st.blocks.num_warps or (4 if head_dim_padded <= 64 else 8)
    return plgpu.CompilerParams(num_warps=warps, num_stages=st.blocks.num_stages)


def _forward_call(q, k, v, kv_lens, q_offsets, st: _Static):
    """q [B, K, Mp, Hp]; k, v [B, K, Sp, Hp] -> (out [B, K, Mp, Hp], lse f32[B, K, Mp])."""
    batch, num_kv, rows, hp = q.shape
    block_m = st.blocks.block_m
    scalars = pl.BlockSpec((kv_lens.shape[0],), lambda b, h, m: (0,))
    kv_spec = pl.BlockSpec((None, None, k.shape[2], hp), lambda b, h, m: (b, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        grid=(batch, num_kv, rows // block_m),
        in_specs=[
            scalars,
            scalars,
            pl.BlockSpec((None, None, block_m, hp), lambda b, h, m: (b, h, m, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_m, hp), lambda b, h, m: (b, h, m, 0)),
            pl.BlockSpec((None, None, block_m), lambda b, h, m: (b, h, m)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_kv, rows), jnp.float32),
        ],
        compiler_params=_compiler_params(st, hp),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(kv_lens, q_offsets, q, k, v)


def _backward_call(q, k, v, kv_lens, q_offsets, out, lse, d_out, st: _Static):
    batch, num_kv, rows, hp = q.shape
    keys = k.shape[2]
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # [B, K, Mp]
    bm, bk = st.blocks.block_m_bwd, st.blocks.block_k_bwd
    scalars = pl.BlockSpec((kv_lens.shape[0],), lambda b, h, i: (0,))
    all_rows = pl.BlockSpec((None, None, rows, hp), lambda b, h, i: (b, h, 0, 0))
    all_rows_vec = pl.BlockSpec((None, None, rows), lambda b, h, i: (b, h, 0))
    key_tile = pl.BlockSpec((None, None, bk, hp), lambda b, h, i: (b, h, i, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_bwd_kv_kernel, st=st),
        grid=(batch, num_kv, keys // bk),
        in_specs=[
            scalars,
            scalars,
            all_rows,
            key_tile,
            key_tile,
            all_rows,
            all_rows_vec,
            all_rows_vec,
        ],
        out_specs=[key_tile, key_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(st, hp),
        interpret=st.interpret,
        name="flash_attention_bwd_kv",
    )(kv_lens, q_offsets, q, k, v, d_out, lse, delta)
    row_tile = pl.BlockSpec((None, None, bm, hp), lambda b, h, i: (b, h, i, 0))
    row_tile_vec = pl.BlockSpec((None, None, bm), lambda b, h, i: (b, h, i))
    all_keys = pl.BlockSpec((None, None, keys, hp), lambda b, h, i: (b, h, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_bwd_q_kernel, st=st),
        grid=(batch, num_kv, rows // bm),
        in_specs=[
            scalars,
            scalars,
            row_tile,
            all_keys,
            all_keys,
            row_tile,
            row_tile_vec,
            row_tile_vec,
        ],
        out_specs=row_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(st, hp),
        interpret=st.interpret,
        name="flash_attention_bwd_q",
    )(kv_lens, q_offsets, q, k, v, d_out, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, kv_lens, q_offsets, st: _Static):
    return _forward_call(q, k, v, kv_lens, q_offsets, st)[0]


def _flash_fwd(q, k, v, kv_lens, q_offsets, st: _Static):
    out, lse = _forward_call(q, k, v, kv_lens, q_offsets, st)
    return out, (q, k, v, kv_lens, q_offsets, out, lse)


def _flash_bwd(st: _Static, residuals, d_out):
    q, k, v, kv_lens, q_offsets, out, lse = residuals
    dq, dk, dv = _backward_call(q, k, v, kv_lens, q_offsets, out, lse, d_out, st)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_to(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def flash_attention(
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
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """FlashAttention-2 forward (Pallas, Triton backend) with a recomputing backward.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H] with N a multiple of K; f32, bf16 or f16.
      kv_lens, q_offsets: i32[B] (see the module docstring); default S and 0.
      block_sizes: tile sizes (default `BlockSizes()`).
      interpret: run in Pallas interpret mode (CPU tests).
    Returns:
      [B, T, N, H] in q's dtype. Differentiable (dq, dk, dv) via `jax.custom_vjp`.
    """
    check_shapes(q, k, v, kv_lens, q_offsets)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (
        jnp.float32,
        jnp.bfloat16,
        jnp.float16,
    ):
        raise ValueError(
            f"q, k, v must share one of f32/bf16/f16: {q.dtype=} {k.dtype=} {v.dtype=}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    kv_lens, q_offsets, sm_scale = _defaults(q, k, kv_lens, q_offsets, sm_scale)
    blocks = block_sizes or BlockSizes()
    batch, seq_q, num_heads, head_dim = q.shape
    seq_k, num_kv = k.shape[1], k.shape[2]
    groups = num_heads // num_kv
    st = _Static(
        groups,
        seq_q,
        seq_k,
        head_dim,
        causal,
        float(sm_scale),
        sliding_window,
        logits_soft_cap,
        blocks,
        interpret,
    )
    hp = max(16, pl.next_power_of_2(head_dim))
    rows = seq_q * groups
    # Row r of a (batch, kv head) is query r // G of head (kv head * G + r % G).
    q_r = q.reshape(batch, seq_q, num_kv, groups, head_dim).transpose(0, 2, 1, 3, 4)
    q_r = q_r.reshape(batch, num_kv, rows, head_dim)
    q_r = _pad_to(_pad_to(q_r, 2, _round_up(rows, max(blocks.block_m, blocks.block_m_bwd))), 3, hp)
    kv_size = _round_up(seq_k, max(blocks.block_k, blocks.block_k_bwd))
    k_r = _pad_to(_pad_to(k.transpose(0, 2, 1, 3), 2, kv_size), 3, hp)
    v_r = _pad_to(_pad_to(v.transpose(0, 2, 1, 3), 2, kv_size), 3, hp)
    scalars = max(8, pl.next_power_of_2(batch))
    out = _flash(q_r, k_r, v_r, _pad_to(kv_lens, 0, scalars), _pad_to(q_offsets, 0, scalars), st)
    out = out[:, :, :rows, :head_dim].reshape(batch, num_kv, seq_q, groups, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, seq_q, num_heads, head_dim)


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
    """Dense attention with the kernel's semantics, accumulating in f32: the XLA path (CPU).

    Queries go in blocks of `Q_BLOCK`, each over the keys it can see: a causal block whose
    offsets are the default (0) stops at its last query's position. On a CPU a whole 512-query
    row's scores spill the caches: blocks of 128 ran a 512-token prefill's attention 2.4x
    faster here (2026-12-05; `reference_pairs` counts what is computed).

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H]; kv_lens, q_offsets: i32[B] or None.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    check_shapes(q, k, v, kv_lens, q_offsets)
    from_start = causal and q_offsets is None  # query t sits at position t
    kv_lens, q_offsets, sm_scale = _defaults(q, k, kv_lens, q_offsets, sm_scale)
    opts = dict(causal=causal, sm_scale=sm_scale, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap)  # fmt: skip
    num_q, num_k = q.shape[1], k.shape[1]
    if num_q <= Q_BLOCK:
        return _dense_attention(q, k, v, kv_lens, q_offsets, **opts)
    outs = []
    for start in range(0, num_q, Q_BLOCK):
        stop = min(start + Q_BLOCK, num_q)
        keys = min(num_k, stop) if from_start else num_k  # later keys: masked (causal)
        block = (q[:, start:stop], k[:, :keys], v[:, :keys])
        outs.append(_dense_attention(*block, jnp.minimum(kv_lens, keys), q_offsets + start, **opts))
    return jnp.concatenate(outs, axis=1)


# The reference's query block (`flash_attention_reference`).
Q_BLOCK = 128


def reference_pairs(num_q: int, num_k: int, from_start: bool) -> int:
    """(query, key) pairs `flash_attention_reference` computes per row and head for `num_q`
    queries over `num_k` keys; `from_start`: causal with the default offsets (a block stops at
    its last query). `benchmarks.disagg.planner.reference_pairs` is the same count."""
    if not from_start:
        return num_q * num_k
    return sum(
        (min(start + Q_BLOCK, num_q) - start) * min(num_k, start + Q_BLOCK)
        for start in range(0, num_q, Q_BLOCK)
    )


def _dense_attention(q, k, v, kv_lens, q_offsets, *, causal, sm_scale, sliding_window,
                     logits_soft_cap):  # fmt: skip
    """`flash_attention_reference` of one block of queries, everything given."""
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
