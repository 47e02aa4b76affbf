"""Paged attention for decode (PagedAttention, Kwon et al. 2023) with flash-decoding splits.

A sequence's keys and values live in fixed-size pages of a shared pool; its block table maps
logical page i to a physical page. Layouts:

  q             [B, N, H]            one new token per sequence (`paged_attention`), or
                [B, T, N, H]         T <= 16 new tokens, causal among them (`paged_attention_multi`)
  k/v_pages     [P, page_size, K, Hp]  the pool; Hp = `padded_head_dim(H)` (see kv_cache_shape),
                or [L, P, page_size, K, Hp] with `layer=` (no per-layer slice is materialised)
  k/v_scales    f32[P, page_size, K]   per token and head, when the pages are int8 / fp8
                (f32[L, P, page_size, K] with `layer=`)
  block_tables  i32[B, max_pages]      physical page of each logical page (entries past the
                                       sequence are ignored, whatever they hold)
  seq_lens      i32[B]               tokens in each sequence, the new ones included

Query t of row b sits at position seq_lens[b] - T + t and attends positions <= its own.
One program handles one (sequence, KV head, split): its rows are the T x G (query token, group
head) pairs of that KV head, so each page is loaded once per KV-head group. A long sequence is
split across programs; each writes a partial (o, m, l) and the splits are merged exactly
(flash-decoding). Accumulation is f32; the output has q's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxgen.pallas_kernels.flash_attention import (
    MASK_VALUE,
    flash_attention_reference,
    mma,
    online_softmax_step,
)

MAX_QUERY_TOKENS = 16


def padded_head_dim(head_dim: int) -> int:
    """Pages store head_dim padded to a power of two >= 16 (a Triton tile needs it)."""
    return max(16, pl.next_power_of_2(head_dim))


def contiguous_page_size(seq_len: int) -> int | None:
    """The page size (16 or 8) under which a contiguous cache of `seq_len` slots per row is a
    page pool (`dispatch.cached_attention`), or None if neither divides it."""
    for page in (16, 8):
        if seq_len % page == 0:
            return page
    return None


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    """Shape of one layer's K (or V) page pool: [num_pages, page_size, K, Hp]."""
    return (num_pages, page_size, num_kv_heads, padded_head_dim(head_dim))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    pages_per_block: int = 4  # pages loaded per inner-loop step
    num_splits: int | None = None  # programs per sequence (None: enough to fill the GPU)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.pages_per_block < 1 or self.pages_per_block & (self.pages_per_block - 1):
            raise ValueError(f"pages_per_block must be a power of two, got {self.pages_per_block}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


@dataclasses.dataclass(frozen=True)
class _Static:
    num_groups: int
    num_queries: int  # T
    sm_scale: float
    pages_per_block: int
    pages_per_split: int  # a multiple of pages_per_block
    quantized: bool
    sliding_window: int | None
    layered: bool  # pages carry a leading layer axis, indexed by layer_ref
    interpret: bool


def _kernel(layer_ref, seq_lens_ref, tables_ref, q_ref, k_ref, v_ref, *rest, st: _Static):
    # layer_ref: i32[8] (layer index in [0]); seq_lens_ref: i32[B_pad]
    # tables_ref: i32[max_pages_pad] (this sequence's table)
    # q_ref: [rows, Hp] rows = (query token, group head) pairs of one KV head
    # k_ref, v_ref: [P, page_size, Hp] the pool's pages for this KV head ([L, P, ...] if layered)
    # (k_scales_ref, v_scales_ref: f32[P, page_size] ([L, P, page_size]) when quantized)
    # o_ref: [rows, Hp] partial output of this split; m_ref, l_ref: f32[rows]
    if st.quantized:
        k_scales_ref, v_scales_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    b, split = pl.program_id(0), pl.program_id(2)
    page_size = k_ref.shape[-2]
    # A layered pool is indexed (layer, pages) in one load: no copy of the layer's pool.
    layer = (layer_ref[0],) if st.layered else ()
    rows = q_ref.shape[0]
    block = st.pages_per_block * page_size
    seq_len = seq_lens_ref[b]
    num_pages = pl.cdiv(seq_len, page_size)
    first_page = split * st.pages_per_split
    if st.sliding_window is not None:  # pages wholly outside every query's window are skipped
        oldest = jnp.maximum(seq_len - st.num_queries - st.sliding_window + 1, 0)
        first_page = jnp.maximum(first_page, oldest // page_size)
    last_page = jnp.minimum(split * st.pages_per_split + st.pages_per_split, num_pages)
    # Row r is query token r // G at position seq_len - T + r // G.
    q_pos = seq_len - st.num_queries + jnp.arange(rows, dtype=jnp.int32) // st.num_groups
    q = q_ref[...]

    def body(i, carry):
        m_i, l_i, acc = carry
        page0 = first_page + i * st.pages_per_block  # may be unaligned under a window
        logical = page0 + jnp.arange(st.pages_per_block, dtype=jnp.int32)
        # Table entries past the sequence may be garbage: never dereference them.
        pages = jnp.where(logical < num_pages, tables_ref[pl.ds(page0, st.pages_per_block)], 0)
        k = k_ref[(*layer, pages)].reshape(block, -1)
        v = v_ref[(*layer, pages)].reshape(block, -1)
        if st.quantized:
            k = k.astype(jnp.float32) * k_scales_ref[(*layer, pages)].reshape(block)[:, None]
            v = v.astype(jnp.float32) * v_scales_ref[(*layer, pages)].reshape(block)[:, None]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        kv_pos = page0 * page_size + jnp.arange(block, dtype=jnp.int32)
        # A window-shifted block may run into the next split's pages: those are not ours.
        valid = kv_pos < jnp.minimum(seq_len, last_page * page_size)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # unused slots may hold NaN
        s = mma(q, k, trans_b=True) * st.sm_scale
        mask = valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if st.sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - st.sliding_window
        return online_softmax_step(s, mask, v, m_i, l_i, acc)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    num_blocks = pl.cdiv(jnp.maximum(last_page - first_page, 0), st.pages_per_block)
    m_i, l_i, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = (acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]).astype(o_ref.dtype)
    m_ref[...] = m_i
    l_ref[...] = l_i


def _merge_splits(o, m, l_sum):
    """Exact merge of per-split softmax partials: o [S, ...rows, H], m/l_sum [S, ...rows]."""
    m_all = jnp.max(m, axis=0)
    w = l_sum * jnp.exp(m - m_all[None])  # each split's share of the total normaliser
    total = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=0)
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def check_scales(k_pages, k_scales, v_scales) -> bool:
    """Whether the pages are quantized (int8 / fp8); if so they need both scales."""
    quantized = k_pages.dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
    if quantized and (k_scales is None or v_scales is None):
        raise ValueError(f"{k_pages.dtype} pages need k_scales and v_scales")
    return quantized


def _check(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales, layer):
    pool_ndim = 4 if layer is None else 5
    if q.ndim != 4 or k_pages.ndim != pool_ndim:
        raise ValueError(
            f"expected q [B,T,N,H] and pages [{'' if layer is None else 'L,'}P,page,K,Hp]: "
            f"{q.shape=} {k_pages.shape=}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} vs {v_pages.shape=}")
    batch, num_q, heads, head_dim = q.shape
    page_size, kv_heads, hp = k_pages.shape[-3:]
    if heads % kv_heads:
        raise ValueError(f"query heads must be a multiple of kv heads: {q.shape=} {k_pages.shape=}")
    if hp != padded_head_dim(head_dim):
        raise ValueError(
            f"pages must store head_dim {head_dim} padded to {padded_head_dim(head_dim)} "
            f"(use kv_cache_shape): {q.shape=} {k_pages.shape=}"
        )
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"{block_tables.shape=} and {seq_lens.shape=} must have B={batch} rows")
    if num_q > MAX_QUERY_TOKENS:
        raise ValueError(f"at most {MAX_QUERY_TOKENS} query tokens per sequence, got {num_q}")
    quantized = check_scales(k_pages, k_scales, v_scales)
    if k_scales is not None and k_scales.shape != k_pages.shape[:-1]:
        raise ValueError(f"{k_scales.shape=} must be {k_pages.shape[:-1]} (pages, slots, K)")
    return quantized


def paged_attention_multi(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """T <= 16 new query tokens per sequence (e.g. speculative verification), causal among
    them. q [B, T, N, H] -> [B, T, N, H]; see the module docstring for the other inputs."""
    quantized = _check(q, k_pages, v_pages, block_tables, seq_lens, k_scales, v_scales, layer)
    blocks = block_sizes or BlockSizes()
    batch, num_q, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, hp = k_pages.shape[-4:]
    groups = heads // kv_heads
    max_pages = block_tables.shape[1]
    ppb = min(blocks.pages_per_block, pl.next_power_of_2(max_pages))
    splits = blocks.num_splits or max(
        1, min(pl.cdiv(max_pages, ppb), pl.cdiv(256, batch * kv_heads))
    )
    pages_per_split = pl.cdiv(pl.cdiv(max_pages, splits), ppb) * ppb
    splits = pl.cdiv(max_pages, pages_per_split)
    st = _Static(
        groups,
        num_q,
        float(sm_scale if sm_scale is not None else head_dim**-0.5),
        ppb,
        pages_per_split,
        quantized,
        sliding_window,
        layer is not None,
        interpret,
    )
    rows = max(16, pl.next_power_of_2(num_q * groups))
    q_r = q.reshape(batch, num_q, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    q_r = q_r.reshape(batch, kv_heads, num_q * groups, head_dim)
    q_r = jnp.pad(q_r, ((0, 0), (0, 0), (0, rows - num_q * groups), (0, hp - head_dim)))
    table_len = pl.next_power_of_2(splits * pages_per_split + ppb)  # + a window-shifted block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, table_len - max_pages)))
    lens = jnp.pad(seq_lens.astype(jnp.int32), (0, max(8, pl.next_power_of_2(batch)) - batch))
    lead = k_pages.shape[:-4]  # (L,) when layered
    zeros = (0,) * len(lead)
    pool = pl.BlockSpec(
        (*lead, num_pages, page_size, None, hp), lambda b, h, s: (*zeros, 0, 0, h, 0)
    )
    layer_arr = jnp.zeros((8,), jnp.int32).at[0].set(0 if layer is None else layer)
    in_specs = [
        pl.BlockSpec((8,), lambda b, h, s: (0,)),
        pl.BlockSpec((lens.shape[0],), lambda b, h, s: (0,)),
        pl.BlockSpec((None, table_len), lambda b, h, s: (b, 0)),
        pl.BlockSpec((None, None, rows, hp), lambda b, h, s: (b, h, 0, 0)),
        pool,
        pool,
    ]
    args = [layer_arr, lens, tables, q_r, k_pages, v_pages]
    if quantized:
        scales = pl.BlockSpec(
            (*lead, num_pages, page_size, None), lambda b, h, s: (*zeros, 0, 0, h)
        )
        in_specs += [scales, scales]
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    o, m, l_sum = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(batch, kv_heads, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, rows, hp), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, batch, kv_heads, rows, hp), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="paged_attention",
    )(*args)
    out = _merge_splits(o, m, l_sum)[:, :, : num_q * groups, :head_dim]
    out = out.reshape(batch, kv_heads, num_q, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, num_q, heads, head_dim).astype(q.dtype)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention: one new token per sequence. q [B, N, H] -> [B, N, H].

    Args:
      q: [B, N, H]; k_pages, v_pages: [P, page_size, K, Hp] (int8/fp8 with k/v_scales
        f32[P, page_size, K]); block_tables: i32[B, max_pages]; seq_lens: i32[B] (the new
        token included).
    """
    if q.ndim != 3:
        raise ValueError(f"paged_attention takes q [B, N, H], got {q.shape}")
    return paged_attention_multi(
        q[:, None],
        k_pages,
        v_pages,
        block_tables,
        seq_lens,
        sm_scale=sm_scale,
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=sliding_window,
        layer=layer,
        block_sizes=block_sizes,
        interpret=interpret,
    )[:, 0]


def gather_pages(pages, block_tables, scales=None, head_dim=None, layer=None):
    """Dense [B, max_pages * page_size, K, H] K or V from the pool (dequantized if scales).

    With `layer`, pages (and scales) carry a leading layer axis and only the rows' pages of
    that layer are read."""
    page_size, k, hp = pages.shape[-3:]
    index = block_tables if layer is None else layer * pages.shape[-4] + block_tables
    # A flat [L * P] page axis and "clip": XLA:CPU copies whole contiguous pages ~1.7x faster
    # than through a (layer, page) index. Table entries past a row's end may be anything;
    # clipped, they still name a page, and attention masks those positions.
    dense = jnp.take(pages.reshape(-1, page_size, k, hp), index, axis=0, mode="clip")
    if scales is not None:
        flat_scales = scales.reshape(-1, page_size, k)
        dense = (
            dense.astype(jnp.float32) * jnp.take(flat_scales, index, axis=0, mode="clip")[..., None]
        )
    b, n = dense.shape[:2]
    dense = dense.reshape(b, n * page_size, k, hp)
    return dense if head_dim is None else dense[..., :head_dim]


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Gathers each sequence's pages into dense K/V and runs dense attention (f32 accumulate).

    q may be [B, N, H] (decode) or [B, T, N, H] (T new tokens, causal among them)."""
    single = q.ndim == 3
    q4 = q[:, None] if single else q
    head_dim = q4.shape[-1]
    k = gather_pages(k_pages, block_tables, k_scales, head_dim, layer).astype(q.dtype)
    v = gather_pages(v_pages, block_tables, v_scales, head_dim, layer).astype(q.dtype)
    out = flash_attention_reference(
        q4,
        k,
        v,
        causal=True,
        kv_lens=seq_lens,
        q_offsets=seq_lens - q4.shape[1],
        sm_scale=sm_scale,
        sliding_window=sliding_window,
    )
    return out[:, 0] if single else out
