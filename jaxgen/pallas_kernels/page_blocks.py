"""Paged attention in XLA over a flat list of page blocks: the CPU path of the engine.

`paged_attention_reference` gathers every row's pages up to the block-table width, so a batch
of B rows reads B x the longest row's pages, and a table width rounded up to a power of two
reads up to twice that again. On a CPU that read is the step: at B = 32 and 1024-token tables
it cost 290 ms per step of SmolLM2-135M (30 layers), four times the matmuls.

Here the host lists only the blocks of pages each row uses (`PageBlocks`, built by
`page_blocks`): block i holds `BLOCK_PAGES` page ids of row `row[i]`, whose first token sits at
position `start[i]`. Attention runs over all blocks at once; each block's scores are reduced
into its row (a softmax split over blocks, merged exactly, as flash-decoding merges its
splits). Padding blocks carry row == B and are dropped.

Semantics are those of `paged_attention_reference`: q [B, T, N, H], query t of row b at
position seq_lens[b] - T + t, causal, optional sliding window, int8 / fp8 pages with scales.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.pallas_kernels.flash_attention import MASK_VALUE
from jaxgen.pallas_kernels.paged_attention import gather_pages

HIGHEST = jax.lax.Precision.HIGHEST
BLOCK_PAGES = 4  # pages per block (64 tokens at page size 16): measured fastest on XLA:CPU


class PageBlocks(NamedTuple):
    """The pages a batch's rows use, as a flat list of blocks (padding: row == batch size)."""

    pages: jax.Array  # i32[NB, BLOCK_PAGES] physical page ids (0 past a row's last page)
    row: jax.Array  # i32[NB] batch row of each block
    start: jax.Array  # i32[NB] position of each block's first token


def blocks_needed(seq_lens, page_size: int, block_pages: int = BLOCK_PAGES) -> int:
    """How many blocks rows of these lengths use."""
    per_block = page_size * block_pages
    return int(sum(-(-int(n) // per_block) for n in seq_lens))


def empty_blocks(num_blocks: int, batch: int, block_pages: int = BLOCK_PAGES) -> PageBlocks:
    """`num_blocks` padding blocks (host arrays, filled by `fill_blocks`)."""
    return PageBlocks(
        pages=np.zeros((num_blocks, block_pages), np.int32),
        row=np.full(num_blocks, batch, np.int32),
        start=np.zeros(num_blocks, np.int32),
    )


def fill_blocks(blocks: PageBlocks, tables, seq_lens, page_size: int) -> PageBlocks:
    """Writes rows' blocks into `blocks` in place (row b's table: `tables[b]`, a list of page
    ids covering its `seq_lens[b]` tokens). Raises ValueError if they do not fit."""
    block_pages = blocks.pages.shape[1]
    used = [-(-int(n) // page_size) for n in seq_lens]  # pages each row reads
    per_row = [-(-u // block_pages) for u in used]
    need = sum(per_row)
    if need > len(blocks.row):
        raise ValueError(f"{need} page blocks needed, {len(blocks.row)} allocated")
    if not need:
        return blocks
    flat: list[int] = []  # every row's pages, zero-padded to whole blocks, in one write
    for table, u, k in zip(tables, used, per_row, strict=True):
        flat.extend(table[:u])
        flat.extend([0] * (k * block_pages - u))
    blocks.pages[:need] = np.asarray(flat, np.int32).reshape(need, block_pages)
    counts = np.asarray(per_row)
    blocks.row[:need] = np.repeat(np.arange(len(per_row), dtype=np.int32), counts)
    first_block = np.repeat(np.cumsum(counts) - counts, counts)  # each row's first block
    blocks.start[:need] = (np.arange(need) - first_block) * (block_pages * page_size)
    return blocks


def page_blocks(tables, seq_lens, page_size: int, num_blocks: int | None = None) -> PageBlocks:
    """Host-side `PageBlocks` for rows with these tables and lengths (padded to `num_blocks`)."""
    need = blocks_needed(seq_lens, page_size)
    blocks = empty_blocks(need if num_blocks is None else num_blocks, len(seq_lens))
    return fill_blocks(blocks, tables, seq_lens, page_size)


def paged_attention_blocks(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    blocks: PageBlocks,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """q [B, T, N, H] over the pages listed in `blocks` -> [B, T, N, H] (f32 accumulation).

    Pools, scales, `layer` and `seq_lens` as in `pallas_kernels.paged_attention`."""
    batch, num_q, heads, head_dim = q.shape
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    kwargs = dict(
        sm_scale=sm_scale,
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=sliding_window,
        layer=layer,
    )
    if num_q == 1:
        return _decode_blocks(q, k_pages, v_pages, blocks, seq_lens, **kwargs)
    return _general_blocks(q, k_pages, v_pages, blocks, seq_lens, **kwargs)


def _gather_rows(pages, ids, scales, head_dim, layer):
    """[NB, BLOCK_PAGES * page_size, K, H] K or V of the blocks' pages (dequantized if scales).

    As `gather_pages`, but each page is copied as one contiguous row of the flat [L * P, page]
    pool: XLA:CPU's gather then copies whole pages, where a gather of [page_size, K, Hp]
    slices fused into its consumer copies element by element (measured: decode attention
    ~10% faster at B = 32)."""
    page_size, kv_heads, hp = pages.shape[-3:]
    index = ids if layer is None else layer * pages.shape[-4] + ids
    nb, block_pages = ids.shape
    flat = pages.reshape(-1, page_size * kv_heads * hp)
    dense = jnp.take(flat, index.reshape(-1), axis=0, mode="clip")
    dense = dense.reshape(nb, block_pages * page_size, kv_heads, hp)
    if scales is not None:
        flat_scales = scales.reshape(-1, page_size * kv_heads)
        scale = jnp.take(flat_scales, index.reshape(-1), axis=0, mode="clip")
        dense = dense.astype(jnp.float32) * scale.reshape(*dense.shape[:3], 1)
    return dense if hp == head_dim else dense[..., :head_dim]


def _decode_blocks(
    q, k_pages, v_pages, blocks, seq_lens, *, sm_scale, k_scales, v_scales, sliding_window, layer
):
    """One query per row (T == 1): the scores and the weighted sum of values are
    broadcast-multiplies reduced over the head dim / the keys, on K and V in the layout they
    are gathered in ([NB, S, K, H]). The dots of `_general_blocks` need K and V as
    [NB, K, S, H]: a transposing copy of both per layer, which on XLA:CPU cost more than the
    attention itself (measured 1.2-1.5x slower at B = 1..256, S = 64, 3 KV heads x 3)."""
    batch, _, heads, head_dim = q.shape
    kv_heads = k_pages.shape[-2]
    groups = heads // kv_heads
    f32 = jnp.float32
    k = _gather_rows(k_pages, blocks.pages, k_scales, head_dim, layer).astype(q.dtype)
    v = _gather_rows(v_pages, blocks.pages, v_scales, head_dim, layer).astype(q.dtype)
    real = blocks.row < batch
    row = jnp.minimum(blocks.row, batch - 1)
    qb = q[row][:, 0].reshape(-1, 1, kv_heads, groups, head_dim)  # [NB, 1, K, G, H]
    s = jnp.sum(qb.astype(f32) * k[:, :, :, None, :].astype(f32), axis=-1)  # [NB, S, K, G]
    key_pos = blocks.start[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)  # [NB, S]
    q_pos = seq_lens[row][:, None] - 1  # [NB, 1]
    valid = (key_pos <= q_pos) & real[:, None]  # [NB, S]
    if sliding_window is not None:
        valid &= key_pos > q_pos - sliding_window
    s = jnp.where(valid[:, :, None, None], s * sm_scale, MASK_VALUE)
    # Blocks merge into their rows as in `_general_blocks`.
    member = blocks.row[None, :] == jnp.arange(batch, dtype=blocks.row.dtype)[:, None]
    block_max = jnp.max(s, axis=1)  # [NB, K, G]
    m = jnp.max(jnp.where(member[:, :, None, None], block_max, MASK_VALUE), axis=1)  # [B, K, G]
    p = jnp.where(valid[:, :, None, None], jnp.exp(s - m[row][:, None]), 0.0)  # [NB, S, K, G]
    weights = member.astype(f32)
    nb = p.shape[0]
    denom = jnp.matmul(weights, jnp.sum(p, axis=1).reshape(nb, -1), precision=HIGHEST)  # [B, N]
    # Keys past a row's end may hold anything: zero their values so 0 * NaN cannot leak in.
    key_ok = (key_pos < seq_lens[row][:, None]) & real[:, None]
    v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))
    pv = p.astype(v.dtype)[..., None].astype(f32) * v[:, :, :, None, :].astype(f32)
    o = jnp.sum(pv, axis=1).reshape(nb, -1)  # [NB, K * G * H]
    o = jnp.matmul(weights, o, precision=HIGHEST).reshape(batch, heads, head_dim)
    out = o / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return out.reshape(batch, 1, heads, head_dim).astype(q.dtype)


def _general_blocks(
    q, k_pages, v_pages, blocks, seq_lens, *, sm_scale, k_scales, v_scales, sliding_window, layer
):
    """Any number of queries per row: per-block dots."""
    batch, num_q, heads, head_dim = q.shape
    kv_heads = k_pages.shape[-2]
    groups = heads // kv_heads
    # Each block's page ids form one row of a block table: [NB, BLOCK_PAGES * page_size, K, H].
    k = gather_pages(k_pages, blocks.pages, k_scales, head_dim, layer).astype(q.dtype)
    v = gather_pages(v_pages, blocks.pages, v_scales, head_dim, layer).astype(q.dtype)
    real = blocks.row < batch
    row = jnp.minimum(blocks.row, batch - 1)
    qb = q[row].reshape(-1, num_q, kv_heads, groups, head_dim)
    s = jnp.einsum(
        "btkgh,bskh->bkgts",
        qb,
        k,
        preferred_element_type=jnp.float32,
        precision=HIGHEST,
    )
    key_pos = blocks.start[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)  # [NB, S]
    q_pos = seq_lens[row][:, None] - num_q + jnp.arange(num_q, dtype=jnp.int32)  # [NB, T]
    valid = (key_pos[:, None, :] <= q_pos[:, :, None]) & real[:, None, None]  # [NB, T, S]
    if sliding_window is not None:
        valid &= key_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    s = jnp.where(valid[:, None, None], s * sm_scale, MASK_VALUE)
    # Blocks are merged into their rows through a [B, NB] membership matrix (padding blocks
    # belong to no row): dense max / matmul, no scatter.
    member = blocks.row[None, :] == jnp.arange(batch, dtype=blocks.row.dtype)[:, None]
    block_max = jnp.max(s, axis=-1)  # [NB, K, G, T]
    m = jnp.max(jnp.where(member[:, :, None, None, None], block_max, MASK_VALUE), axis=1)
    p = jnp.where(valid[:, None, None], jnp.exp(s - m[row][..., None]), 0.0)
    weights = member.astype(jnp.float32)
    denom = jnp.einsum("bn,nkgt->bkgt", weights, jnp.sum(p, axis=-1), precision=HIGHEST)
    # Keys past a row's end may hold anything (a page's unwritten slots): zero their values
    # so 0 * NaN cannot leak in.
    key_ok = (key_pos < seq_lens[row][:, None]) & real[:, None]
    v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))
    o = jnp.einsum(
        "bkgts,bskh->btkgh",
        p.astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,
        precision=HIGHEST,
    )
    o = jnp.einsum("bn,ntkgh->btkgh", weights, o, precision=HIGHEST)  # [B, T, K, G, H]
    denom = jnp.moveaxis(denom, -1, 1)  # [B, T, K, G]
    out = o / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return out.reshape(batch, num_q, heads, head_dim).astype(q.dtype)
