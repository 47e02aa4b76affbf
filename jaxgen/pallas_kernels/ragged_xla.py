"""Ragged paged attention in XLA: the CPU path, whose cost follows the step's real tokens and
context, not its padded maxima (token bucket T, sequence rows S, table width W).

Semantics and layouts are those of `pallas_kernels.ragged_paged_attention`. Gathering every
row's pages up to the table width (what the reference does) reads S x W pages per layer
whatever the step holds; on a CPU that read is the step. Here the work is a flat list of
items, each one (query tile of one sequence, block of its pages), built on
the device from the metadata and processed in a loop whose trip count is the number of real
items divided by a chunk: a chunk's items are gathered and scored at once, and their softmax
partials are merged exactly into per-token accumulators (the flash-decoding merge, by
scatter-max / scatter-add on the token index), so no item ever waits on another.

Sequences fall into classes by query length, each with its own static tile (one loop each;
an absent class costs one zero-trip loop):

  q_len == 1       decode rows   tile 1   scores as broadcast-multiplies on the gathered layout
                                          (no transposing copy, as `page_blocks` measured)
  q_len > 1        prefill       tile 64  (causal: a tile reads pages up to its last query)

Each class is about a third of a step program's compile time on XLA:CPU (1.3 s of 3.5 s for the
tiny test model's forward at 64 tokens), which every engine start pays once per token bucket: a
third class for short chunks (tile 16, for verify rows) cost more start-up than it saved a
ragged step, which verifies no drafts.

Pages wholly before a tile's window are skipped, table entries past a sequence's pages are
never dereferenced, and unused slots may hold NaN.

Measured (`python -m benchmarks.ragged_cpu --repeats 11`, 2026-12-07, this 2-core host shared
with other busy processes at load ~20, so every figure is noisy, ~+-50% at the small ones;
process CPU time in ms, median of 11, old and new in the same run, one attention layer at
9 heads / 3 KV heads / head dim 64 / page 16, f32; the ragged call always with 64 sequence
rows and 128-page tables):

  | case                        | today                         | ragged (bucket)           |
  |-----------------------------|-------------------------------|---------------------------|
  | decode B=1, ctx 256         | 0.15  page_blocks             | 0.48 (T=64)               |
  | decode B=8, ctx 256         | 0.78  page_blocks             | 1.93 (T=64)               |
  | decode B=32, ctx 256        | 5.22  page_blocks             | 5.44 (T=64)               |
  | decode B=1, ctx 1024        | 0.37  page_blocks             | 0.50 (T=64)               |
  | decode B=8, ctx 1024        | 4.72  page_blocks             | 4.43 (T=64), 3.39 (T=512) |
  | decode B=32, ctx 1024       | 41.17 page_blocks             | 14.49 (T=64)              |
  | fresh prefill 512           | 10.09 dispatch.attention      | 15.35 (T=512)             |
  | chunk 256 after 1024 cached | 72.48 paged_prefill_reference | 27.06 (T=512)             |

The cost follows the real work: neither the 64 rows, the 128-page width nor a 512-token
bucket shows. Small decode batches keep a fixed ~0.3 ms and a per-item cost up to ~2x
`page_blocks`'; large ones win because page_blocks merges its blocks through a [B, NB]
matmul, which grows as B x NB.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgen.pallas_kernels.flash_attention import MASK_VALUE
from jaxgen.pallas_kernels.ragged_paged_attention import _check, normalize_offsets

HIGHEST = jax.lax.Precision.HIGHEST


class _Class(NamedTuple):
    max_q_len: int | None  # sequences with q_len <= this (None: any longer one)
    tile: int  # query tokens per item
    chunk: int  # items per loop trip; the items a whole chunk leaves go chunk // 8 at a time
    block_pages: int  # pages per item


# Decode chunks of 32 items (~3 MB of K and V per trip at the default model's shape): 16 and
# 64 measured no better at B = 8 / 32, 256 worse (noisy host: within ~20%). A prefill item of
# 64 queries takes 128 keys (fewer merges per score).
CLASSES = (_Class(1, 1, 32, 4), _Class(None, 64, 8, 8))


def _cdiv(a, b):
    return (a + b - 1) // b


def ragged_paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    seq_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    return_pages: bool = False,
    invariant: bool = False,
):
    """q [T, N, H] -> [T, N, H]; inputs as in `ragged_paged_attention`.

    `invariant`: batch-invariant order. Trip j takes the j-th block of every query tile that has
    one, so every token merges its blocks one at a time, in order, whatever else the step
    holds: its output is bitwise the same in any batch (for a program of the same shape).

    `return_pages`: also return (k_pages, v_pages, k_scales, v_scales), the same arrays, threaded
    through the loops that read them. A caller that has just written the step's keys into the
    pool (`cache.PagedKVCache`, inside the model's scan over layers) takes the pool back from
    here: a pool that a loop only reads while the caller still holds it is copied whole for
    the loop, every layer (XLA's while loops own their operands), which made a step on the
    default model's pool take seconds."""
    _check(
        q,
        k_pages,
        v_pages,
        page_tables,
        cu_q_lens,
        seq_lens,
        num_seqs,
        k_scales,
        v_scales,
        sliding_window,
        layer,
    )
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[-2]
    groups = heads // kv_heads
    cu = normalize_offsets(cu_q_lens, num_seqs)
    q_lens = cu[1:] - cu[:-1]
    seq_lens = seq_lens.astype(jnp.int32)
    f32 = jnp.float32
    # Accumulators per token (+ one row that takes every dropped index).
    carry = (
        jnp.full((num_tokens + 1, kv_heads, groups), MASK_VALUE, f32),  # running max
        jnp.zeros((num_tokens + 1, kv_heads, groups), f32),  # running denominator
        jnp.zeros((num_tokens + 1, kv_heads, groups, head_dim), f32),
    )
    # A zero query row at index T, for tile rows past their sequence.
    q_ext = jnp.concatenate([q, jnp.zeros((1, heads, head_dim), q.dtype)])
    q_ext = q_ext.reshape(num_tokens + 1, kv_heads, groups, head_dim)
    pools = _flat_pools(k_pages, v_pages, k_scales, v_scales, layer)
    opts = dict(
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale),
        sliding_window=sliding_window,
        invariant=invariant,
        head_dim=head_dim,
    )
    lower = 0
    for cls in CLASSES:
        if lower >= num_tokens:  # no sequence of this step can be this long: no loop at all
            break
        upper = cls.max_q_len
        member = q_lens > lower
        if upper is not None:
            member &= q_lens <= upper
            lower = upper
        carry, pools = _pass(
            carry, q_ext, pools, page_tables, cu, q_lens, seq_lens, member, cls, **opts
        )
    _, denom, acc = carry
    out = acc[:num_tokens] / jnp.where(denom == 0.0, 1.0, denom)[:num_tokens, ..., None]
    out = out.reshape(num_tokens, heads, head_dim).astype(q.dtype)
    if not return_pages:
        return out
    back = lambda x, like: None if x is None else x.reshape(like.shape)  # noqa: E731
    return out, (
        back(pools.k, k_pages),
        back(pools.v, v_pages),
        back(pools.k_scales, k_scales),
        back(pools.v_scales, v_scales),
    )


class _Pools(NamedTuple):
    k: jax.Array  # [L * P, page_size * K * Hp] one row per page
    v: jax.Array
    k_scales: jax.Array | None  # f32[L * P, page_size * K]
    v_scales: jax.Array | None
    base: jax.Array | int  # layer * P: this layer's first row
    page_size: int
    kv_heads: int


def _flat_pools(k_pages, v_pages, k_scales, v_scales, layer):
    """Each page as one contiguous row: XLA:CPU's gather then copies whole pages (see
    `page_blocks._gather_rows`). A free reshape, no copy of the pool."""
    num_pages, page_size, kv_heads, hp = k_pages.shape[-4:]
    rows = lambda x, width: None if x is None else x.reshape(-1, width)
    return _Pools(
        rows(k_pages, page_size * kv_heads * hp),
        rows(v_pages, page_size * kv_heads * hp),
        rows(k_scales, page_size * kv_heads),
        rows(v_scales, page_size * kv_heads),
        0 if layer is None else layer * num_pages,
        page_size,
        kv_heads,
    )


def _pass(
    carry,
    q_ext,
    pools,
    tables,
    cu,
    q_lens,
    seq_lens,
    member,
    cls: _Class,
    *,
    sm_scale,
    sliding_window,
    head_dim,
    invariant,
):
    """Adds the items of the sequences in `member` (tile `cls.tile`) to the accumulators.
    Returns (accumulators, pools): the pools' arrays ride in the loops' carry."""
    num_tokens = q_ext.shape[0] - 1
    num_rows = seq_lens.shape[0]
    tile, pages_per_block = cls.tile, cls.block_pages
    block = pages_per_block * pools.page_size
    # Query tiles: a static bound on their count (each holds a token, each sequence adds at
    # most one partial tile), the real count on the device.
    max_tiles = max(1, min(_cdiv(num_tokens, tile) + num_rows, num_tokens))
    if cls.max_q_len is not None and cls.max_q_len <= tile:  # one tile per sequence at most
        max_tiles = max(1, min(max_tiles, num_rows))
    per_seq = jnp.where(member, _cdiv(q_lens, tile), 0)
    tile_ends = jnp.cumsum(per_seq)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), num_rows - 1)
    first = (t - (tile_ends[seq] - per_seq[seq])) * tile  # first query token within the sequence
    num_q = jnp.where(t < tile_ends[-1], jnp.minimum(tile, q_lens[seq] - first), 0)
    pos0 = seq_lens[seq] - q_lens[seq] + first
    hi = jnp.where(num_q > 0, _cdiv(pos0 + num_q, block), 0)  # causal: up to the last query
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        lo = jnp.minimum(jnp.maximum(pos0 - sliding_window + 1, 0) // block, hi)
    per_tile = hi - lo
    item_ends = jnp.cumsum(per_tile)
    num_items = item_ends[-1]
    width = tables.shape[1]
    kv_heads = pools.kv_heads
    hp = pools.k.shape[1] // (pools.page_size * kv_heads)

    def items(ids, state):
        """The items `ids` of the flat list: each tile's blocks back to back."""
        it = jnp.minimum(jnp.searchsorted(item_ends, ids, side="right"), max_tiles - 1)
        return tile_blocks(
            it, lo[it] + ids - (item_ends[it] - per_tile[it]), ids < num_items, state
        )

    def tile_blocks(it, blk, real, state):
        """Adds block `blk[c]` of query tile `it[c]` for each item c (where `real[c]`)."""
        (m_all, l_all, acc), arrays = state
        pools_ = _with_arrays(pools, arrays)
        chunk = it.shape[0]
        s_of = seq[it]
        # Query rows of each item; rows past the tile's tokens read the zero row T and are
        # dropped by the scatters below.
        r = jnp.arange(tile, dtype=jnp.int32)
        row_ok = real[:, None] & (r[None, :] < num_q[it][:, None])  # [C, tile]
        tok = jnp.where(row_ok, cu[s_of][:, None] + first[it][:, None] + r[None, :], num_tokens)
        q_pos = pos0[it][:, None] + r[None, :]  # [C, tile]
        qc = q_ext[tok]  # [C, tile, K, G, H]
        # This item's pages; logical pages past the sequence are never dereferenced.
        logical = blk[:, None] * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        key_pos = blk[:, None] * block + jnp.arange(block, dtype=jnp.int32)  # [C, block]
        seq_len = seq_lens[s_of]
        used = logical < _cdiv(seq_len, pools.page_size)[:, None]
        phys = jnp.where(used, tables[s_of[:, None], jnp.minimum(logical, width - 1)], 0)
        index = (pools.base + phys).reshape(-1)
        k = _dense(pools_.k, pools_.k_scales, index, chunk, kv_heads, hp, head_dim).astype(
            q_ext.dtype
        )
        v = _dense(pools_.v, pools_.v_scales, index, chunk, kv_heads, hp, head_dim).astype(
            q_ext.dtype
        )
        key_ok = (key_pos < seq_len[:, None]) & real[:, None]
        # Slots past a sequence's end may hold anything: zero them so 0 * NaN cannot leak in.
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros_like(v))
        mask = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None]) & row_ok[..., None]
        if sliding_window is not None:
            mask &= key_pos[:, None, :] > q_pos[:, :, None] - sliding_window
        m_item, l_item, o_item = _partials(qc, k, v, mask, sm_scale)
        m_all, l_all, acc = _merge((m_all, l_all, acc), tok, m_item, l_item, o_item)
        # Through a barrier: JAX would otherwise see the pool passed through unchanged and take
        # it out of the carry (a loop invariant again, copied as described above).
        return (m_all, l_all, acc), jax.lax.optimization_barrier(arrays)

    state = (carry, (pools.k, pools.v, pools.k_scales, pools.v_scales))
    if invariant:
        carry, arrays = _invariant_trips(tile_blocks, per_tile, lo, cls.chunk, state)
        return carry, _with_arrays(pools, arrays)
    # Whole chunks, then what is left in small ones: a step of few items (decode at B = 1)
    # must not pay for a whole chunk.
    big, small = cls.chunk, max(1, cls.chunk // 8)
    r_big, r_small = jnp.arange(big, dtype=jnp.int32), jnp.arange(small, dtype=jnp.int32)
    num_big = num_items // big
    state = jax.lax.fori_loop(0, num_big, lambda i, c: items(i * big + r_big, c), state)
    rest = num_big * big
    carry, arrays = jax.lax.fori_loop(
        0, _cdiv(num_items - rest, small), lambda i, c: items(rest + i * small + r_small, c), state
    )
    return carry, _with_arrays(pools, arrays)


def _invariant_trips(tile_blocks, per_tile, lo, chunk, state):
    """The batch-invariant order: trip j adds the j-th block of each tile that has one
    (`tile_blocks(tiles, blocks, real, state)`), in chunks. A token gets at most one item per
    trip, so how the trip is chunked cannot change its arithmetic. Tiles longest first: trip
    j's tiles lead the order, and its chunks cost its items."""
    max_tiles = per_tile.shape[0]
    order = jnp.argsort(-per_tile, stable=True).astype(jnp.int32)
    chunk = min(chunk, max_tiles)
    r_chunk = jnp.arange(chunk, dtype=jnp.int32)

    def trip(j, c):
        count = jnp.sum(per_tile > j)

        def part(i, c):
            slot = i * chunk + r_chunk
            it = order[jnp.minimum(slot, max_tiles - 1)]
            return tile_blocks(it, lo[it] + j, slot < count, c)

        return jax.lax.fori_loop(0, _cdiv(count, chunk), part, c)

    return jax.lax.fori_loop(0, jnp.max(per_tile), trip, state)


def _with_arrays(pools: _Pools, arrays) -> _Pools:
    """`pools` holding the (k, v, k_scales, v_scales) a loop carried."""
    return pools._replace(**dict(zip(("k", "v", "k_scales", "v_scales"), arrays, strict=True)))


def _partials(qc, k, v, mask, sm_scale):
    """One chunk's softmax partials: queries qc [C, tile, K, G, H] over keys k, v
    [C, block, K, H] under mask [C, tile, block] -> (max, denominator [C, tile, K, G],
    numerator [C, tile, K, G, H]), in f32."""
    f32 = jnp.float32
    if qc.shape[1] == 1:
        # [C, block, K, G]: multiply-reduce on the layout K was gathered in.
        s = jnp.sum(qc[:, 0, None].astype(f32) * k[:, :, :, None, :].astype(f32), axis=-1)
        s = jnp.where(mask[:, 0, :, None, None], s * sm_scale, MASK_VALUE)
        m_item = jnp.max(s, axis=1)[:, None]  # [C, 1, K, G]
        p = jnp.where(mask[:, 0, :, None, None], jnp.exp(s - m_item), 0.0)
        l_item = jnp.sum(p, axis=1)[:, None]
        pv = p.astype(v.dtype)[..., None].astype(f32) * v[:, :, :, None, :].astype(f32)
        return m_item, l_item, jnp.sum(pv, axis=1)[:, None]  # numerator [C, 1, K, G, H]
    s = jnp.einsum("ctkgh,cskh->ckgts", qc, k, preferred_element_type=f32, precision=HIGHEST)
    s = jnp.where(mask[:, None, None], s * sm_scale, MASK_VALUE)  # [C, K, G, tile, S]
    m_kgt = jnp.max(s, axis=-1)
    p = jnp.where(mask[:, None, None], jnp.exp(s - m_kgt[..., None]), 0.0)
    l_item = jnp.moveaxis(jnp.sum(p, axis=-1), -1, 1)  # [C, tile, K, G]
    o_item = jnp.einsum(
        "ckgts,cskh->ctkgh", p.astype(v.dtype), v, preferred_element_type=f32, precision=HIGHEST
    )
    return jnp.moveaxis(m_kgt, -1, 1), l_item, o_item


def _merge(accumulators, tok, m_item, l_item, o_item):
    """Exact merge of a chunk's partials into their tokens' accumulators (rows `tok`
    [C, tile]). Several items of a chunk may share a token: scatter-max first; then only the
    touched rows are rescaled to the new maxima, by a scatter-set whose duplicate indices all
    carry the same value (so a trip's cost does not grow with the token bucket)."""
    m_all, l_all, acc = accumulators
    m_new = m_all.at[tok].max(m_item)
    m_tok = m_new[tok]
    alpha = jnp.exp(m_all[tok] - m_tok)  # [C, tile, K, G]
    w = jnp.exp(m_item - m_tok)
    l_all = l_all.at[tok].set(l_all[tok] * alpha).at[tok].add(l_item * w)
    acc = acc.at[tok].set(acc[tok] * alpha[..., None]).at[tok].add(o_item * w[..., None])
    return m_new, l_all, acc


def _dense(pool, scales, index, items, kv_heads, hp, head_dim):
    """[C, pages_per_block * page_size, K, H] of the pages `index` i32[C * pages_per_block]
    (rows of the flat pool), dequantized when scales are given."""
    dense = jnp.take(pool, index, axis=0, mode="clip")
    dense = dense.reshape(items, -1, kv_heads, hp)
    if scales is not None:
        scale = jnp.take(scales, index, axis=0, mode="clip").reshape(items, -1, kv_heads, 1)
        dense = dense.astype(jnp.float32) * scale
    return dense[..., :head_dim]
