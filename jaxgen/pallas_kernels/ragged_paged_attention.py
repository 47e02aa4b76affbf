"""Ragged paged attention: one call for every sequence of a step, over one flat token axis.

Decode rows, speculative-verification rows and prefill chunks (fresh, or after cached
context) are all sequences with 1..T query tokens packed back to back (as vLLM's unified
attention and tpu-inference's ragged paged attention take them). Layouts:

  q             [T, N, H]             the step's query tokens; T is the token bucket, tokens
                                      past cu_q_lens[num_seqs] are padding
  k/v_pages     [P, page_size, K, Hp]  the pool (Hp = `paged_attention.padded_head_dim(H)`), or
                [L, P, page_size, K, Hp] with `layer=`. This step's keys and values are
                already written into their slots (the cache writes, then attends).
  k/v_scales    f32[P, page_size, K] (f32[L, P, page_size, K] with `layer=`) for int8 / fp8
  page_tables   i32[S, W]             physical page of each logical page of sequence s, one
                                      fixed width W; entries past a sequence's pages are
                                      never dereferenced, whatever they hold
  cu_q_lens     i32[S + 1]            query start offsets: sequence s owns tokens
                                      cu_q_lens[s] .. cu_q_lens[s + 1] - 1
  seq_lens      i32[S]                tokens of sequence s in the cache after this step's writes
  num_seqs      i32[1]                sequences in use (the rest of the S rows is padding)

Token i of sequence s (q_len_s = cu_q_lens[s + 1] - cu_q_lens[s]) sits at position
seq_lens[s] - q_len_s + (i - cu_q_lens[s]) and attends its own sequence's keys at positions
<= its own (and > its own - sliding_window). Padding tokens get zeros. Accumulation is f32; the
output [T, N, H] has q's dtype.

GPU kernel: a Pallas kernel on the Triton backend (the pattern of `paged_attention`), not yet
Mosaic GPU. The host side (jnp, inside the same program) cuts every sequence into query
blocks of `block_rows // G` tokens; one program takes one (query block, KV head): its rows are
the (token, group head) pairs of that block, loaded from the flat token axis at a dynamic
offset under a row mask, and it walks the sequence's pages up to its last query's position
(causal page skipping, pages wholly before the window skipped) in one online softmax
(FlashAttention-2). There is no split of long contexts across programs (flash-decoding) yet.

The CPU path is `ragged_paged_attention_xla` (its own module); the pure-jnp
`ragged_paged_attention_reference` below defines the semantics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxgen.pallas_kernels.flash_attention import MASK_VALUE, mma, online_softmax_step
from jaxgen.pallas_kernels.paged_attention import check_scales, gather_pages, padded_head_dim

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_rows: int = 64  # (token, group head) rows per program: block_rows // G tokens
    pages_per_block: int = 4  # pages loaded per inner-loop step
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_rows", "pages_per_block"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two, got {value}")
        if self.block_rows < 16:
            raise ValueError(f"BlockSizes.block_rows must be >= 16, got {self.block_rows}")


@dataclasses.dataclass(frozen=True)
class _Static:
    num_groups: int
    block_rows: int  # rows per program (a power of two)
    block_tokens: int  # query tokens per program: block_rows // num_groups
    sm_scale: float
    pages_per_block: int
    quantized: bool
    sliding_window: int | None
    layered: bool


# Columns of the per-program scalar table (`_query_blocks`).
_SEQ, _ROW0, _NTOK, _POS0 = range(4)


def normalize_offsets(cu_q_lens, num_seqs):
    """cu_q_lens with every entry past num_seqs set to the last real offset, so rows past
    num_seqs own no tokens whatever the caller left there."""
    n = num_seqs[0]
    cu = cu_q_lens.astype(jnp.int32)
    return jnp.where(jnp.arange(cu.shape[0]) <= n, cu, cu[n])


def token_layout(cu_q_lens, seq_lens, num_seqs, num_tokens: int):
    """(sequence i32[T], position i32[T], valid bool[T]) of each token of the flat axis."""
    cu = normalize_offsets(cu_q_lens, num_seqs)
    idx = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], idx, side="right"), seq_lens.shape[0] - 1)
    seq = seq.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    pos = seq_lens[seq] - q_lens[seq] + idx - cu[seq]
    return seq, pos, idx < cu[-1]


def _kernel(layer_ref, meta_ref, tables_ref, q_ref, k_ref, v_ref, *rest, st: _Static):
    # layer_ref: i32[8] (layer index in [0]); meta_ref: i32[programs_pad, 8] per program
    #   (sequence, first flat row, tokens, position of the first token)
    # tables_ref: i32[S, W_pad] every sequence's table (the sequence is data-dependent)
    # q_ref, o_ref: [T * G + block_rows, Hp] (token, group head) rows of one KV head
    # k_ref, v_ref: [P, page_size, Hp] the pool's pages for this KV head ([L, P, ...] if layered)
    # (k_scales_ref, v_scales_ref: f32[P, page_size] ([L, P, page_size]) when quantized)
    if st.quantized:
        k_scales_ref, v_scales_ref, o_ref = rest
    else:
        (o_ref,) = rest
    prog = pl.program_id(0)
    seq, row0 = meta_ref[prog, _SEQ], meta_ref[prog, _ROW0]
    num_tok, pos0 = meta_ref[prog, _NTOK], meta_ref[prog, _POS0]
    page_size = k_ref.shape[-2]
    hp = q_ref.shape[-1]
    layer = (layer_ref[0],) if st.layered else ()
    tok = jnp.arange(st.block_rows, dtype=jnp.int32) // st.num_groups
    # Rows past this block's tokens belong to the next sequence (or padding): never written.
    row_ok = tok < num_tok
    rows = pl.ds(row0, st.block_rows)
    row_mask = jnp.broadcast_to(row_ok[:, None], (st.block_rows, hp))
    q = plgpu.load(q_ref.at[rows], mask=row_mask, other=0.0)
    q_pos = pos0 + tok
    block = st.pages_per_block * page_size
    # Causal: no query of the block sees past its last token (an empty block reads nothing).
    num_pages = jnp.where(num_tok > 0, pl.cdiv(pos0 + num_tok, page_size), 0)
    first_page = jnp.int32(0)
    if st.sliding_window is not None:  # pages wholly before every query's window are skipped
        first_page = jnp.maximum(pos0 - st.sliding_window + 1, 0) // page_size

    def body(i, carry):
        m_i, l_i, acc = carry
        page0 = first_page + i * st.pages_per_block
        logical = page0 + jnp.arange(st.pages_per_block, dtype=jnp.int32)
        # Table entries past the sequence may be garbage: never dereference them.
        pages = jnp.where(logical < num_pages, tables_ref[seq, pl.ds(page0, st.pages_per_block)], 0)
        k = k_ref[(*layer, pages)].reshape(block, -1)
        v = v_ref[(*layer, pages)].reshape(block, -1)
        if st.quantized:
            k = k.astype(jnp.float32) * k_scales_ref[(*layer, pages)].reshape(block)[:, None]
            v = v.astype(jnp.float32) * v_scales_ref[(*layer, pages)].reshape(block)[:, None]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        kv_pos = page0 * page_size + jnp.arange(block, dtype=jnp.int32)
        # Past the last query's position the slots are either not ours (beyond num_pages the
        # page was replaced by page 0) or never attended.
        valid = kv_pos < pos0 + num_tok
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # unused slots may hold NaN
        s = mma(q, k, trans_b=True) * st.sm_scale
        mask = valid[None, :] & (kv_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        if st.sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - st.sliding_window
        return online_softmax_step(s, mask, v, m_i, l_i, acc)

    init = (
        # Finite: a fully masked row would otherwise compute exp(-inf - -inf) = NaN.
        jnp.full((st.block_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((st.block_rows,), jnp.float32),
        jnp.zeros((st.block_rows, hp), jnp.float32),
    )
    num_blocks = pl.cdiv(jnp.maximum(num_pages - first_page, 0), st.pages_per_block)
    _, l_i, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
    plgpu.store(o_ref.at[rows], out.astype(o_ref.dtype), mask=row_mask)


def _query_blocks(cu, seq_lens, block_tokens: int, num_programs: int, groups: int):
    """i32[num_programs, 8]: for each program the sequence, first row of the flat
    [T * G] (token, group head) axis, tokens (0: no work) and position of its first token.
    Sequence s is cut into cdiv(q_len_s, block_tokens) blocks."""
    num_seqs = seq_lens.shape[0]
    q_lens = cu[1:] - cu[:-1]
    per_seq = pl.cdiv(q_lens, block_tokens)
    ends = jnp.cumsum(per_seq)
    prog = jnp.arange(num_programs, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, prog, side="right"), num_seqs - 1).astype(jnp.int32)
    first_tok = (prog - (ends[seq] - per_seq[seq])) * block_tokens  # within the sequence
    num_tok = jnp.where(prog < ends[-1], jnp.minimum(block_tokens, q_lens[seq] - first_tok), 0)
    pos0 = seq_lens[seq] - q_lens[seq] + first_tok
    row0 = jnp.where(num_tok > 0, (cu[seq] + first_tok) * groups, 0)  # in range when idle
    cols = [seq, row0, num_tok, pos0]
    meta = jnp.stack(cols + [jnp.zeros_like(seq)] * (8 - len(cols)), axis=1)
    return meta.astype(jnp.int32)


def _check(
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
):
    pool_ndim = 4 if layer is None else 5
    if q.ndim != 3 or k_pages.ndim != pool_ndim:
        raise ValueError(
            f"expected q [T,N,H] and pages [{'' if layer is None else 'L,'}P,page,K,Hp]: "
            f"{q.shape=} {k_pages.shape=}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} vs {v_pages.shape=}")
    _, heads, head_dim = q.shape
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
    num_rows = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    if (
        seq_lens.ndim != 1
        or page_tables.ndim != 2
        or page_tables.shape[0] != num_rows
        or cu_q_lens.shape != (num_rows + 1,)
    ):
        raise ValueError(
            f"need seq_lens [S], page_tables [S, W] and cu_q_lens [S + 1]: {seq_lens.shape=} "
            f"{page_tables.shape=} {cu_q_lens.shape=}"
        )
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be i32[1], got {num_seqs.shape=}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    quantized = check_scales(k_pages, k_scales, v_scales)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is not None and scales.shape != k_pages.shape[:-1]:
            raise ValueError(f"{name}.shape={scales.shape} must be {k_pages.shape[:-1]}")
    return quantized


def ragged_paged_attention(
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
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas kernel: q [T, N, H] -> [T, N, H]; see the module docstring for the inputs."""
    quantized = _check(
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
    blocks = block_sizes or BlockSizes()
    num_tokens, heads, head_dim = q.shape
    num_pages, page_size, kv_heads, hp = k_pages.shape[-4:]
    groups = heads // kv_heads
    block_rows = max(blocks.block_rows, pl.next_power_of_2(groups))
    block_tokens = block_rows // groups
    st = _Static(
        groups,
        block_rows,
        block_tokens,
        float(sm_scale if sm_scale is not None else head_dim**-0.5),
        blocks.pages_per_block,
        quantized,
        sliding_window,
        layer is not None,
    )
    num_rows = seq_lens.shape[0]
    # Each sequence adds at most one partial block, and every block holds a token.
    num_programs = max(1, min(pl.cdiv(num_tokens, block_tokens) + num_rows, num_tokens))
    cu = normalize_offsets(cu_q_lens, num_seqs)
    meta = _query_blocks(cu, seq_lens.astype(jnp.int32), block_tokens, num_programs, groups)
    meta = jnp.pad(meta, ((0, pl.next_power_of_2(num_programs) - num_programs), (0, 0)))
    # Flat (token, group head) rows per KV head, padded by one block so that a block's
    # load never runs past the end (an interpreter would clamp the slice, not mask it).
    rows = num_tokens * groups
    q_r = q.reshape(num_tokens, kv_heads, groups, head_dim).transpose(1, 0, 2, 3)
    q_r = jnp.pad(
        q_r.reshape(kv_heads, rows, head_dim), ((0, 0), (0, block_rows), (0, hp - head_dim))
    )
    width = page_tables.shape[1]
    table_len = pl.next_power_of_2(width + blocks.pages_per_block)  # + a window-shifted block
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, table_len - width)))
    layer_arr = jnp.zeros((8,), jnp.int32).at[0].set(0 if layer is None else layer)
    lead = k_pages.shape[:-4]  # (L,) when layered
    zeros = (0,) * len(lead)
    pool = pl.BlockSpec((*lead, num_pages, page_size, None, hp), lambda p, h: (*zeros, 0, 0, h, 0))
    flat = pl.BlockSpec((None, rows + block_rows, hp), lambda p, h: (h, 0, 0))
    in_specs = [
        pl.BlockSpec((8,), lambda p, h: (0,)),
        pl.BlockSpec(meta.shape, lambda p, h: (0, 0)),
        pl.BlockSpec(tables.shape, lambda p, h: (0, 0)),
        flat,
        pool,
        pool,
    ]
    args = [layer_arr, meta, tables, q_r, k_pages, v_pages]
    if quantized:
        scales = pl.BlockSpec((*lead, num_pages, page_size, None), lambda p, h: (*zeros, 0, 0, h))
        in_specs += [scales, scales]
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    out = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(num_programs, kv_heads),
        in_specs=in_specs,
        out_specs=flat,
        out_shape=jax.ShapeDtypeStruct(q_r.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*args)
    out = out[:, :rows, :head_dim].reshape(kv_heads, num_tokens, groups, head_dim)
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, heads, head_dim)
    # Rows no program wrote (padding tokens) hold whatever the buffer held.
    _, _, valid = token_layout(cu_q_lens, seq_lens, num_seqs, num_tokens)
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Every sequence's pages gathered dense (dequantized), each token scored against its own
    sequence's keys, f32 at Precision.HIGHEST. Memory [T, W * page_size, K, H]: for tests."""
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
    seq, pos, valid = token_layout(cu_q_lens, seq_lens, num_seqs, num_tokens)
    f32 = jnp.float32
    k = gather_pages(k_pages, page_tables, k_scales, head_dim, layer).astype(f32)[seq]
    v = gather_pages(v_pages, page_tables, v_scales, head_dim, layer).astype(f32)[seq]
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    # Slots past a sequence's end may hold anything: zero them so 0 * NaN cannot leak in.
    v = jnp.where((key_pos[None, :] < seq_lens[seq][:, None])[..., None, None], v, 0.0)
    qg = q.astype(f32).reshape(num_tokens, kv_heads, groups, head_dim)
    s = jnp.einsum("tkgh,tskh->tkgs", qg, k, precision=HIGHEST)
    s = s * (head_dim**-0.5 if sm_scale is None else sm_scale)
    mask = (key_pos[None, :] <= pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > pos[:, None] - sliding_window
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jnp.where(mask[:, None, None], jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    denom = jnp.sum(p, axis=-1)
    o = jnp.einsum("tkgs,tskh->tkgh", p, v, precision=HIGHEST)
    o = o / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return o.reshape(num_tokens, heads, head_dim).astype(q.dtype)
