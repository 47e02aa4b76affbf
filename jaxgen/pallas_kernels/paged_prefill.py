"""Prefill of a chunk over a paged cache: the cached prefix read from its pages in place, the
chunk's own keys and values from the batch. No gather of the context into a contiguous copy.

This is chunked prefill and a prefix-cache hit: row b has context_lens[b] tokens in its pages
(block table row b, the layouts of `pallas_kernels.paged_attention`) and T new tokens, of which
num_new[b] are real:

  q             [B, T, N, H]    query t of row b at position context_lens[b] + t
  k_new, v_new  [B, T, K, H]    the chunk's keys and values (exact, even over a quantized cache)
  k/v_pages     [P, page, K, Hp] (or [L, P, page, K, Hp] with `layer=`), int8 / fp8 with scales

Query t attends the prefix positions < context_lens[b] and chunk tokens j <= t, j < num_new[b]
(and, with a sliding window w, only positions > its own - w). Rows t >= num_new[b] get finite,
meaningless outputs (callers drop them). Accumulation is f32; the output has q's dtype.

One program takes block_m rows (query token, group head) of one (row, KV head): it first walks
the prefix's pages, `pages_per_block` at a time (pages wholly before every query's window are
skipped), then the chunk's key tiles up to its last query (causal tile skipping), in one online
softmax. Triton backend (Pallas); `interpret=True` runs it on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxgen.pallas_kernels.flash_attention import MASK_VALUE, flash_attention_reference, mma
from jaxgen.pallas_kernels.paged_attention import check_scales, gather_pages, padded_head_dim


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
    block_m: int = 64  # rows (query token x group head) per program
    block_k: int = 64  # chunk keys per step
    pages_per_block: int = 4  # prefix pages per step
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_k", "pages_per_block"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"PrefillBlocks.{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_k < 16:
            raise ValueError("PrefillBlocks.block_m and block_k must be >= 16")


@dataclasses.dataclass(frozen=True)
class _Static:
    num_groups: int
    sm_scale: float
    sliding_window: int | None
    quantized: bool
    layered: bool
    blocks: PrefillBlocks


def _online_softmax_step(q, k, v, mask, carry, sm_scale):
    m_i, l_i, acc = carry
    s = jnp.where(mask, mma(q, k, trans_b=True) * sm_scale, MASK_VALUE)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    acc = acc * alpha[:, None] + mma(p.astype(v.dtype), v)
    return m_new, alpha * l_i + jnp.sum(p, axis=1), acc


def _kernel(
    layer_ref,
    ctx_ref,
    new_ref,
    tables_ref,
    q_ref,
    kn_ref,
    vn_ref,
    kp_ref,
    vp_ref,
    *rest,
    st: _Static,
):
    # layer_ref: i32[8] ([0] the layer); ctx_ref, new_ref: i32[B_pad]; tables_ref: i32[pages_pad]
    # q_ref, o_ref: [block_m, Hp]; kn_ref, vn_ref: [Tk, Hp] the chunk of this (row, KV head)
    # kp_ref, vp_ref: [P, page, Hp] ([L, P, page, Hp]) the pool for this KV head
    if st.quantized:
        ks_ref, vs_ref, o_ref = rest
    else:
        (o_ref,) = rest
    b, m_blk = pl.program_id(0), pl.program_id(2)
    blocks = st.blocks
    block_m = q_ref.shape[0]
    page = kp_ref.shape[-2]
    layer = (layer_ref[0],) if st.layered else ()
    ctx, num_new = ctx_ref[b], new_ref[b]
    row0 = m_blk * block_m
    t = (row0 + jnp.arange(block_m, dtype=jnp.int32)) // st.num_groups  # chunk index per row
    q_pos = ctx + t
    q = q_ref[...]
    first_q = ctx + row0 // st.num_groups

    # The prefix, from its pages.
    block = blocks.pages_per_block * page
    num_pages = pl.cdiv(ctx, page)
    first_page = jnp.int32(0)
    if st.sliding_window is not None:
        first_page = jnp.maximum(first_q - st.sliding_window + 1, 0) // page

    def prefix_step(i, carry):
        page0 = first_page + i * blocks.pages_per_block
        logical = page0 + jnp.arange(blocks.pages_per_block, dtype=jnp.int32)
        # Table entries past the prefix may be garbage: never dereference them.
        pages = jnp.where(logical < num_pages, tables_ref[pl.ds(page0, blocks.pages_per_block)], 0)
        k = kp_ref[(*layer, pages)].reshape(block, -1)
        v = vp_ref[(*layer, pages)].reshape(block, -1)
        if st.quantized:
            k = k.astype(jnp.float32) * ks_ref[(*layer, pages)].reshape(block)[:, None]
            v = v.astype(jnp.float32) * vs_ref[(*layer, pages)].reshape(block)[:, None]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        kv_pos = page0 * page + jnp.arange(block, dtype=jnp.int32)
        valid = kv_pos < ctx
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # unused slots may hold NaN
        mask = valid[None, :] & jnp.ones((block_m, 1), jnp.bool_)
        if st.sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - st.sliding_window
        return _online_softmax_step(q, k, v, mask, carry, st.sm_scale)

    carry = (
        jnp.full((block_m,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    prefix_blocks = pl.cdiv(jnp.maximum(num_pages - first_page, 0), blocks.pages_per_block)
    carry = jax.lax.fori_loop(0, prefix_blocks, prefix_step, carry)

    # The chunk, from the batch: causal among its tokens.
    bk = blocks.block_k
    last_t = (row0 + block_m - 1) // st.num_groups
    chunk_hi = jnp.minimum(num_new, last_t + 1)
    chunk_lo = jnp.int32(0)
    if st.sliding_window is not None:
        chunk_lo = jnp.maximum(row0 // st.num_groups - st.sliding_window + 1, 0)

    def chunk_step(j, carry):
        keys = pl.ds(j * bk, bk)
        idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
        valid = idx < num_new
        k, v = kn_ref[keys, :], vn_ref[keys, :]
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        mask = valid[None, :] & (idx[None, :] <= t[:, None])
        if st.sliding_window is not None:
            mask &= idx[None, :] > t[:, None] - st.sliding_window
        return _online_softmax_step(q, k, v, mask, carry, st.sm_scale)

    _, l_i, acc = jax.lax.fori_loop(
        chunk_lo // bk, pl.cdiv(jnp.maximum(chunk_hi, 0), bk), chunk_step, carry
    )
    o_ref[...] = (acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]).astype(o_ref.dtype)


def _check(
    q,
    k_new,
    v_new,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    num_new,
    k_scales,
    v_scales,
    layer,
):
    if q.ndim != 4 or k_new.shape != v_new.shape or k_new.ndim != 4:
        raise ValueError(f"expected q [B,T,N,H], k_new/v_new [B,T,K,H]: {q.shape=} {k_new.shape=}")
    batch, num_q, heads, head_dim = q.shape
    if k_new.shape[:2] != (batch, num_q) or k_new.shape[3] != head_dim:
        raise ValueError(f"k_new must be [B, T, K, H] = [{batch}, {num_q}, K, {head_dim}]")
    pool_ndim = 4 if layer is None else 5
    if k_pages.ndim != pool_ndim or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"pages must be [{'' if layer is None else 'L,'}P,page,K,Hp]: "
            f"{k_pages.shape=} {v_pages.shape=}"
        )
    page, kv_heads, hp = k_pages.shape[-3:]
    if kv_heads != k_new.shape[2] or heads % kv_heads:
        raise ValueError(
            f"kv heads of the pages and the chunk must agree and divide the query "
            f"heads: {q.shape=} {k_new.shape=} {k_pages.shape=}"
        )
    if hp != padded_head_dim(head_dim):
        raise ValueError(
            f"pages must store head_dim {head_dim} padded to "
            f"{padded_head_dim(head_dim)}: {k_pages.shape=}"
        )
    if page & (page - 1):
        raise ValueError(f"page_size must be a power of two, got {page}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{block_tables.shape=} must have B={batch} rows")
    for name, arr in (("context_lens", context_lens), ("num_new", num_new)):
        if arr.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {arr.shape}")
    return check_scales(k_pages, k_scales, v_scales)


def paged_prefill_attention(
    q,
    k_new,
    v_new,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    num_new,
    *,
    sm_scale=None,
    k_scales=None,
    v_scales=None,
    sliding_window=None,
    layer=None,
    blocks: PrefillBlocks | None = None,
    interpret: bool = False,
) -> jax.Array:
    """See the module docstring. Returns [B, T, N, H] in q's dtype."""
    quantized = _check(
        q,
        k_new,
        v_new,
        k_pages,
        v_pages,
        block_tables,
        context_lens,
        num_new,
        k_scales,
        v_scales,
        layer,
    )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    blocks = blocks or PrefillBlocks()
    batch, num_q, heads, head_dim = q.shape
    num_pages, page, kv_heads, hp = k_pages.shape[-4:]
    groups = heads // kv_heads
    st = _Static(
        groups,
        float(sm_scale if sm_scale is not None else head_dim**-0.5),
        sliding_window,
        quantized,
        layer is not None,
        blocks,
    )
    rows = num_q * groups
    rows_p = -(-rows // blocks.block_m) * blocks.block_m
    q_r = q.reshape(batch, num_q, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    q_r = jnp.pad(
        q_r.reshape(batch, kv_heads, rows, head_dim),
        ((0, 0), (0, 0), (0, rows_p - rows), (0, hp - head_dim)),
    )
    keys_p = -(-num_q // blocks.block_k) * blocks.block_k

    def chunk(x):
        x = x.transpose(0, 2, 1, 3)
        return jnp.pad(x, ((0, 0), (0, 0), (0, keys_p - num_q), (0, hp - head_dim)))

    max_pages = block_tables.shape[1]
    table_len = pl.next_power_of_2(max_pages + blocks.pages_per_block)  # + a shifted block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, table_len - max_pages)))
    scalars = max(8, pl.next_power_of_2(batch))
    ctx = jnp.pad(context_lens.astype(jnp.int32), (0, scalars - batch))
    new = jnp.pad(num_new.astype(jnp.int32), (0, scalars - batch))
    layer_arr = jnp.zeros((8,), jnp.int32).at[0].set(0 if layer is None else layer)
    lead = k_pages.shape[:-4]
    zeros = (0,) * len(lead)
    pool = pl.BlockSpec((*lead, num_pages, page, None, hp), lambda b, h, m: (*zeros, 0, 0, h, 0))
    chunk_spec = pl.BlockSpec((None, None, keys_p, hp), lambda b, h, m: (b, h, 0, 0))
    in_specs = [
        pl.BlockSpec((8,), lambda b, h, m: (0,)),
        pl.BlockSpec((scalars,), lambda b, h, m: (0,)),
        pl.BlockSpec((scalars,), lambda b, h, m: (0,)),
        pl.BlockSpec((None, table_len), lambda b, h, m: (b, 0)),
        pl.BlockSpec((None, None, blocks.block_m, hp), lambda b, h, m: (b, h, m, 0)),
        chunk_spec,
        chunk_spec,
        pool,
        pool,
    ]
    args = [
        layer_arr,
        ctx,
        new,
        tables,
        q_r,
        chunk(k_new).astype(q.dtype),
        chunk(v_new).astype(q.dtype),
        k_pages,
        v_pages,
    ]
    if quantized:
        scales = pl.BlockSpec((*lead, num_pages, page, None), lambda b, h, m: (*zeros, 0, 0, h))
        in_specs += [scales, scales]
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    out = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(batch, kv_heads, rows_p // blocks.block_m),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, blocks.block_m, hp), lambda b, h, m: (b, h, m, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, rows_p, hp), q.dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="paged_prefill",
    )(*args)
    out = out[:, :, :rows, :head_dim].reshape(batch, kv_heads, num_q, groups, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_q, heads, head_dim)


def paged_prefill_reference(
    q,
    k_new,
    v_new,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    num_new,
    *,
    sm_scale=None,
    k_scales=None,
    v_scales=None,
    sliding_window=None,
    layer=None,
) -> jax.Array:
    """The same semantics the dense way: each row's pages gathered (dequantized), the chunk
    placed after the prefix, dense attention (f32 accumulate)."""
    _check(
        q,
        k_new,
        v_new,
        k_pages,
        v_pages,
        block_tables,
        context_lens,
        num_new,
        k_scales,
        v_scales,
        layer,
    )
    head_dim = q.shape[-1]
    num_q = q.shape[1]

    def dense(pages, scales, new):
        prefix = gather_pages(pages, block_tables, scales, head_dim, layer).astype(q.dtype)
        room = jnp.zeros((prefix.shape[0], num_q, *prefix.shape[2:]), q.dtype)
        prefix = jnp.concatenate([prefix, room], axis=1)  # the chunk always fits after ctx
        put = lambda p, n, c: jax.lax.dynamic_update_slice_in_dim(p, n, c, axis=0)
        return jax.vmap(put)(prefix, new.astype(q.dtype), context_lens.astype(jnp.int32))

    return flash_attention_reference(
        q,
        dense(k_pages, k_scales, k_new),
        dense(v_pages, v_scales, v_new),
        causal=True,
        kv_lens=context_lens + num_new,
        q_offsets=context_lens,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
    )
