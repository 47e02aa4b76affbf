"""Paged Multi-head Latent Attention decode (DeepSeek-V2 §2.1; FlashMLA's cache layout): the
absorbed queries of T <= 16 new tokens per sequence attend over latent pages, all N heads of a
token in one program, so each page is read once per sequence (the MQA of the absorbed form).

Layouts:

  q             [B, T, N, C]           absorbed queries [q_nope W_UK | roped q_pe], C = R + Hr
  pages         [P, page_size, C]      the latent pool: per token the latent (R) then the shared
                or [L, P, page_size, C] rope key (Hr); with `layer=`, no per-layer slice is made
  block_tables  i32[B, max_pages]      physical page of each logical page (entries past the
                                       sequence are ignored, whatever they hold)
  seq_lens      i32[B]                 tokens in each sequence, the new ones included
  out           [B, T, N, R]           each head's softmax-weighted mixture of latents

The value of a cached token is its latent, the first R channels of the same entry, so the kernel
reads one array for both scores and values. Query t of row b sits at position seq_lens[b] - T + t
and attends positions <= its own. One program handles one (sequence, split): its rows are the
T x N (query token, head) pairs. Long sequences are split across programs whose partial
(o, m, l) are merged exactly (flash-decoding). Accumulation is f32; the output has q's dtype.
The kernel reads the latent and rope parts of the entries as two power-of-two wide loads, so R
and Hr must be powers of two (DeepSeek-V3: 512 and 64).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxgen.pallas_kernels import paged_attention as _paged
from jaxgen.pallas_kernels.flash_attention import (
    MASK_VALUE,
    flash_attention_reference,
    mma,
    online_softmax_step,
)
from jaxgen.pallas_kernels.paged_attention import MAX_QUERY_TOKENS, _merge_splits


@dataclasses.dataclass(frozen=True)
class BlockSizes(_paged.BlockSizes):
    """The paged kernel's tiling (and checks), with this kernel's defaults: fewer pages per
    step and more warps, as a latent entry (R + Hr) is far wider than a K/V head."""

    pages_per_block: int = 2
    num_warps: int = 8


@dataclasses.dataclass(frozen=True)
class _Static:
    num_heads: int  # N
    num_queries: int  # T
    latent_dim: int  # R
    sm_scale: float
    pages_per_block: int
    pages_per_split: int  # a multiple of pages_per_block
    layered: bool  # pages carry a leading layer axis, indexed by layer_ref


def _kernel(layer_ref, seq_lens_ref, tables_ref, q_lat_ref, q_pe_ref, pages_ref, *out, st):
    # layer_ref: i32[8] (layer index in [0]); seq_lens_ref: i32[B_pad]
    # tables_ref: i32[max_pages_pad] (this sequence's table)
    # q_lat_ref: [rows, R], q_pe_ref: [rows, Hr]; rows = (query token, head) pairs
    # pages_ref: [P, page_size, C] the whole pool ([L, P, page_size, C] if layered)
    # out: o_ref [rows, R] partial output of this split; m_ref, l_ref: f32[rows]
    o_ref, m_ref, l_ref = out
    b, split = pl.program_id(0), pl.program_id(1)
    page_size = pages_ref.shape[-2]
    r, hr = q_lat_ref.shape[-1], q_pe_ref.shape[-1]
    layer = (layer_ref[0],) if st.layered else ()
    rows = q_lat_ref.shape[0]
    block = st.pages_per_block * page_size
    seq_len = seq_lens_ref[b]
    num_pages = pl.cdiv(seq_len, page_size)
    first_page = split * st.pages_per_split
    last_page = jnp.minimum(first_page + st.pages_per_split, num_pages)
    # Row i is query token i // N at position seq_len - T + i // N.
    q_pos = seq_len - st.num_queries + jnp.arange(rows, dtype=jnp.int32) // st.num_heads
    q_lat, q_pe = q_lat_ref[...], q_pe_ref[...]

    def body(i, carry):
        m_i, l_i, acc = carry
        page0 = first_page + i * st.pages_per_block
        logical = page0 + jnp.arange(st.pages_per_block, dtype=jnp.int32)
        # Table entries past the sequence may be garbage: never dereference them.
        pages = jnp.where(logical < num_pages, tables_ref[pl.ds(page0, st.pages_per_block)], 0)
        latent = pages_ref[(*layer, pages, slice(None), pl.ds(0, r))].reshape(block, r)
        rope = pages_ref[(*layer, pages, slice(None), pl.ds(st.latent_dim, hr))].reshape(block, hr)
        latent, rope = latent.astype(q_lat.dtype), rope.astype(q_pe.dtype)
        kv_pos = page0 * page_size + jnp.arange(block, dtype=jnp.int32)
        valid = kv_pos < jnp.minimum(seq_len, last_page * page_size)
        value = jnp.where(valid[:, None], latent, jnp.zeros_like(latent))  # unused slots: NaN?
        s = (mma(q_lat, latent, trans_b=True) + mma(q_pe, rope, trans_b=True)) * st.sm_scale
        mask = valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        # Finite mask value: a fully masked row would otherwise compute -inf - -inf = NaN.
        return online_softmax_step(s, mask, value, m_i, l_i, acc)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, r), jnp.float32),
    )
    num_blocks = pl.cdiv(jnp.maximum(last_page - first_page, 0), st.pages_per_block)
    m_i, l_i, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = (acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]).astype(o_ref.dtype)
    m_ref[...] = m_i
    l_ref[...] = l_i


def _check(q, pages, block_tables, seq_lens, latent_dim, layer):
    pool_ndim = 3 if layer is None else 4
    if q.ndim != 4 or pages.ndim != pool_ndim:
        raise ValueError(
            f"expected q [B,T,N,C] and pages [{'' if layer is None else 'L,'}P,page,C]: "
            f"{q.shape=} {pages.shape=}"
        )
    batch, num_q, _, width = q.shape
    if pages.shape[-1] != width or not 0 < latent_dim < width:
        raise ValueError(
            f"q and pages must share the entry width C = R + Hr with 0 < R < C: "
            f"{q.shape=} {pages.shape=} {latent_dim=}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"{block_tables.shape=} and {seq_lens.shape=} must have B={batch} rows")
    if num_q > MAX_QUERY_TOKENS:
        raise ValueError(f"at most {MAX_QUERY_TOKENS} query tokens per sequence, got {num_q}")


def paged_mla_attention(
    q: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    latent_dim: int,
    sm_scale: float,
    layer: jax.Array | int | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed MLA attention of T <= 16 new tokens per sequence over latent pages.
    q [B, T, N, R + Hr] -> [B, T, N, R]; see the module docstring for the other inputs."""
    _check(q, pages, block_tables, seq_lens, latent_dim, layer)
    batch, num_q, heads, width = q.shape
    r, hr = latent_dim, width - latent_dim
    if r & (r - 1) or hr & (hr - 1):
        raise ValueError(f"the Pallas MLA kernel needs power-of-two R and Hr, got {r=} {hr=}")
    blocks = block_sizes or BlockSizes()
    max_pages = block_tables.shape[1]
    ppb = min(blocks.pages_per_block, pl.next_power_of_2(max_pages))
    splits = blocks.num_splits or max(1, min(pl.cdiv(max_pages, ppb), pl.cdiv(132, batch)))
    pages_per_split = pl.cdiv(pl.cdiv(max_pages, splits), ppb) * ppb
    splits = pl.cdiv(max_pages, pages_per_split)
    st = _Static(heads, num_q, r, float(sm_scale), ppb, pages_per_split, layer is not None)
    rows = max(16, pl.next_power_of_2(num_q * heads))
    q_rows = jnp.pad(
        q.reshape(batch, num_q * heads, width), ((0, 0), (0, rows - num_q * heads), (0, 0))
    )
    q_lat, q_pe = q_rows[..., :r], q_rows[..., r:]
    table_len = pl.next_power_of_2(splits * pages_per_split)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, table_len - max_pages)))
    lens = jnp.pad(seq_lens.astype(jnp.int32), (0, max(8, pl.next_power_of_2(batch)) - batch))
    layer_arr = jnp.zeros((8,), jnp.int32).at[0].set(0 if layer is None else layer)
    zeros = (0,) * pages.ndim
    o, m, l_sum = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(batch, splits),
        in_specs=[
            pl.BlockSpec((8,), lambda b, s: (0,)),
            pl.BlockSpec((lens.shape[0],), lambda b, s: (0,)),
            pl.BlockSpec((None, table_len), lambda b, s: (b, 0)),
            pl.BlockSpec((None, rows, r), lambda b, s: (b, 0, 0)),
            pl.BlockSpec((None, rows, hr), lambda b, s: (b, 0, 0)),
            pl.BlockSpec(pages.shape, lambda b, s: zeros),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, r), lambda b, s: (s, b, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda b, s: (s, b, 0)),
            pl.BlockSpec((None, None, rows), lambda b, s: (s, b, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, batch, rows, r), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="paged_mla_attention",
    )(layer_arr, lens, tables, q_lat, q_pe, pages)
    out = _merge_splits(o, m, l_sum)[:, : num_q * heads]
    return out.reshape(batch, num_q, heads, r).astype(q.dtype)


def gather_latent_pages(pages, block_tables, layer=None):
    """Dense [B, max_pages * page_size, C] entries of each row's pages (of layer `layer`)."""
    page_size, width = pages.shape[-2:]
    index = block_tables if layer is None else layer * pages.shape[-3] + block_tables
    # Table entries past a row's end may be anything; clipped, they still name a page, and
    # attention masks those positions.
    dense = jnp.take(pages.reshape(-1, page_size, width), index, axis=0, mode="clip")
    return dense.reshape(dense.shape[0], -1, width)


def paged_mla_attention_reference(
    q: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    latent_dim: int,
    sm_scale: float,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Gathers each row's latent pages and runs dense MQA over them (f32 accumulate); any
    number of query tokens T (the last T positions of each row, causal)."""
    entries = gather_latent_pages(pages, block_tables, layer).astype(q.dtype)[:, :, None, :]
    out = flash_attention_reference(
        q,
        entries,
        entries,
        causal=True,
        kv_lens=seq_lens,
        q_offsets=seq_lens - q.shape[1],
        sm_scale=sm_scale,
    )
    return out[..., :latent_dim]
