"""FlashAttention forward for Hopper on Pallas' Mosaic GPU backend (FlashAttention-3 design).

Same semantics as `pallas_kernels.flash_attention` (ragged kv_lens and q_offsets, GQA, causal,
sliding window, soft cap; see that module's docstring), for bf16/f16 inputs.

Layout. As in the Triton kernel, the rows of a query tile are (query, head-in-group) pairs: q
[B, T, N, H] is viewed as [B, K, T * G, H] (row r of a (batch, kv head) is query r // G of head
kv_head * G + r % G), so each K/V tile is loaded once for all G query heads that share it.

One program (CTA) takes 2 * block_q rows of one (batch, kv head) and runs three warpgroups:
  * warpgroup 2, the producer, issues TMA copies of K and V tiles [block_kv, H] into a ring of
    `stages` shared-memory slots, each guarded by a "loaded" barrier, and waits on a "consumed"
    barrier before it refills a slot;
  * warpgroups 0 and 1, the consumers, each own block_q rows: QK^T and PV are wgmma's from shared
    memory (P from registers), the online softmax runs in registers in the exp2 domain, and the
    two consumers take turns on the tensor cores through a schedule barrier, so that one's
    softmax overlaps the other's matmul.
Key tiles are visited only where some row of the program can attend (causal and window block
skipping, and kv_lens); the mask is computed only on the tiles that cross a boundary.

Keys and values at positions >= kv_len are never attended. A tile at a mask boundary (the one
crossing kv_len among them) reaches PV through a consumer-private copy with its rows past kv_len
zeroed, so padding may hold anything (NaN included), as in the Triton kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxgen.pallas_kernels import flash_attention as _triton
from jaxgen.pallas_kernels import mosaic_interpret
from jaxgen.pallas_kernels.flash_attention import MASK_VALUE, _defaults, check_shapes

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 128  # smaller head dims are zero-padded to 64 or 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per CTA


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Tiles of the Hopper kernel: block_q rows per consumer warpgroup (a program has two),
    block_kv keys per K/V tile, `stages` tiles of K and of V in flight."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 3

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MosaicBlocks.block_q must be 64 (one wgmma M), got {self.block_q}")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(
                f"MosaicBlocks.block_kv must be 64, 128, 192 or 256, got {self.block_kv}"
            )
        if self.stages < 2:
            raise ValueError(f"MosaicBlocks.stages must be >= 2, got {self.stages}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        q = 2 * self.block_q * head_dim
        kv = 2 * self.stages * self.block_kv * head_dim
        v_tail = 2 * self.block_kv * head_dim  # each consumer's V tile with padding zeroed
        p = 2 * self.block_q * self.block_kv  # each consumer's P tile
        return (q + kv + v_tail + p) * itemsize + 2 * self.block_q * 4


def padded_head_dim(head_dim: int) -> int:
    """64 or 128: wgmma operands in 128-byte swizzled rows."""
    return 64 if head_dim <= 64 else 128


def default_blocks(head_dim: int) -> MosaicBlocks:
    """Tiles that fit shared memory for the head dim (176 KiB at head_dim 128)."""
    del head_dim
    return MosaicBlocks()


def supports(q, k, v, blocks: MosaicBlocks | None = None) -> str | None:
    """None if the kernel takes these inputs, else why not (the dispatch falls back)."""
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in DTYPES:
        return f"dtype {q.dtype} (the Hopper kernel takes bf16 or f16)"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} (the Hopper kernel takes up to {MAX_HEAD_DIM})"
    head_dim = padded_head_dim(q.shape[-1])
    blocks = blocks or default_blocks(head_dim)
    if blocks.smem_bytes(head_dim) > SMEM_BYTES:
        return f"{blocks} needs {blocks.smem_bytes(head_dim)} bytes of shared memory"
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    groups: int
    causal: bool
    sm_scale: float
    window: int | None
    soft_cap: float | None
    blocks: MosaicBlocks


def _transforms(dtype):
    """Shared-memory tiling and swizzle for wgmma operands: 128-byte rows."""
    elems = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _row_vector(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _program_key_blocks(kv_len, first_q, last_q, st: _Static):
    """[lo, hi) key tiles some query at positions first_q..last_q may attend."""
    bkv = st.blocks.block_kv
    hi = kv_len
    if st.causal:
        hi = jnp.minimum(hi, last_q + 1)
    lo = jnp.int32(0)
    if st.window is not None:
        lo = jnp.maximum(first_q - st.window + 1, 0)
    lo_blk = lax.div(lo, jnp.int32(bkv))
    hi_blk = lax.div(jnp.maximum(hi, 0) + (bkv - 1), jnp.int32(bkv))
    return lo_blk, jnp.maximum(hi_blk, lo_blk)


def _unmasked_key_blocks(kv_len, q_min, q_max, lo_blk, hi_blk, st: _Static):
    """[a, c) within [lo_blk, hi_blk): tiles every row of a warpgroup (query positions
    q_min..q_max) attends whole, so they need no mask."""
    bkv = jnp.int32(st.blocks.block_kv)
    end = kv_len
    if st.causal:
        end = jnp.minimum(end, q_min + 1)
    full_hi = lax.div(jnp.maximum(end, 0), bkv)  # tiles ending at or before `end`
    full_lo = lo_blk
    if st.window is not None:
        first_key = jnp.maximum(q_max - st.window + 1, 0)
        full_lo = lax.div(first_key + (bkv - 1), bkv)
    a = jnp.clip(full_lo, lo_blk, hi_blk)
    c = jnp.clip(full_hi, a, hi_blk)
    return a, c


class _Smem(NamedTuple):
    """One program's shared memory and barriers, in the order `_scratch` allocates them."""

    q: Any  # [2, block_q, H]: each consumer's query tile, then its output tile
    k: Any  # [stages, block_kv, H]: the ring of key tiles
    v: Any  # [stages, block_kv, H]: the ring of value tiles
    v_tail: Any  # [2, block_kv, H]: each consumer's V tile with the rows past kv_len zeroed
    p: Any  # [2, block_q, block_kv]: each consumer's P tile
    lse: Any  # f32[2, block_q]: each consumer's log-sum-exp rows
    q_bar: Any  # 2 barriers: a consumer's query tile has landed
    k_bar: Any  # [stages]: a key slot has landed
    v_bar: Any  # [stages]: a value slot has landed
    k_free: Any  # [stages], 2 arrivals: both consumers are done with a key slot
    v_free: Any  # [stages], 2 arrivals: both consumers are done with a value slot
    turn: Any  # 2 arrivals: the schedule barrier (one consumer on the tensor cores at a time)


def _scratch(st: _Static, head_dim: int, dtype) -> tuple:
    """`pl.run_scoped` allocations of `_Smem`'s fields, in its order."""
    bq, bkv, stages = st.blocks.block_q, st.blocks.block_kv, st.blocks.stages
    tr = _transforms(dtype)
    return (
        plgpu.SMEM((2, bq, head_dim), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, head_dim), dtype, transforms=tr),
        plgpu.SMEM((stages, bkv, head_dim), dtype, transforms=tr),
        plgpu.SMEM((2, bkv, head_dim), dtype, transforms=tr),
        plgpu.SMEM((2, bq, bkv), dtype, transforms=tr),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    )


@dataclasses.dataclass(frozen=True)
class _Program:
    """What one program (CTA) works on: its 2 * block_q rows of one (batch, kv head) and the key
    tiles [lo_blk, hi_blk) that some of those rows may attend. All fields are traced i32
    scalars."""

    b: Any  # batch
    kvh: Any  # kv head
    kv_len: Any  # keys of batch b
    q_off: Any  # position of batch b's first query
    row0: Any  # the program's first row
    groups: Any  # G: rows per query
    lo_blk: Any  # first key tile visited
    hi_blk: Any  # one past the last key tile visited
    steps: Any  # hi_blk - lo_blk

    def query_position(self, row):
        """Position of the query of row(s) `row` (row r is query r // G)."""
        return self.q_off + lax.div(row, self.groups)


def _locate(b, kvh, lens_ref, offs_ref, st: _Static) -> _Program:
    """The program's rows (grid axis "rows") and the key tiles they may attend."""
    bq = st.blocks.block_q
    kv_len = lens_ref[b]
    q_off = offs_ref[b]
    row0 = lax.axis_index("rows") * (2 * bq)
    groups = jnp.int32(st.groups)
    first_q = q_off + lax.div(row0, groups)
    last_q = q_off + lax.div(row0 + 2 * bq - 1, groups)
    lo_blk, hi_blk = _program_key_blocks(kv_len, first_q, last_q, st)
    return _Program(b, kvh, kv_len, q_off, row0, groups, lo_blk, hi_blk, hi_blk - lo_blk)


def _forward_kernel(lens_ref, offs_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static):
    # lens_ref, offs_ref: i32[B] kv_lens and q_offsets;
    # q_ref / o_ref: [B, K, R, H] rows (query, group head); k_ref, v_ref: [B, S, K, H];
    # lse_ref: f32[B, K, R] (natural log-sum-exp per row, +inf for a row with no key).
    def body(*scratch):
        smem = _Smem(*scratch)
        b = lax.axis_index("batch")
        kvh = lax.axis_index("kv_head")
        wg = lax.axis_index("wg")
        prog = _locate(b, kvh, lens_ref, offs_ref, st)

        @pl.when(wg < 2)
        def _consumers():
            _consumer(wg, prog, smem, q_ref, o_ref, lse_ref, st)

        @pl.when(wg == 2)
        def _producers():
            _producer(prog, smem, k_ref, v_ref, st)

    scratch = _scratch(st, q_ref.shape[-1], q_ref.dtype)
    pl.run_scoped(body, *scratch, collective_axes="wg")


def _producer(prog: _Program, smem: _Smem, k_ref, v_ref, st: _Static):
    """Warpgroup 2: TMA copies of the program's K and V tiles into the ring of `stages` slots,
    refilling a slot once both consumers have released it."""
    plgpu.set_max_registers(40, action="decrease")
    bkv, stages = st.blocks.block_kv, st.blocks.stages

    def kv_tile(ref, blk):  # [block_kv, H] keys or values of tile blk
        return ref.at[prog.b, pl.ds(blk * bkv, bkv), prog.kvh]

    def issue(i, slot):
        blk = prog.lo_blk + i
        plgpu.copy_gmem_to_smem(kv_tile(k_ref, blk), smem.k.at[slot], smem.k_bar.at[slot])
        plgpu.copy_gmem_to_smem(kv_tile(v_ref, blk), smem.v.at[slot], smem.v_bar.at[slot])

    for i in range(stages):
        pl.when(i < prog.steps)(functools.partial(issue, i, i))

    @pl.loop(stages, jnp.maximum(prog.steps, stages))
    def _refill(i):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(smem.k_free.at[slot])
        plgpu.barrier_wait(smem.v_free.at[slot])
        issue(i, slot)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A consumer warpgroup's block_q rows: its views of the shared memory and the query
    position of each row."""

    q: Any  # [block_q, H]: its query tile (its output tile in the epilogue)
    v_tail: Any  # [block_kv, H]: its V tile with the rows past kv_len zeroed
    p: Any  # [block_q, block_kv]: its P tile
    q_pos: Any  # i32[block_q, block_kv]: each row's query position, broadcast along the keys


def _take_turn(turn):
    """End this consumer's turn on the tensor cores and wait for the other consumer to end its
    own (the schedule barrier takes 2 arrivals)."""
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def _consumer(wg, prog: _Program, smem: _Smem, q_ref, o_ref, lse_ref, st: _Static):
    """Consumer warpgroup wg (0 or 1): its block_q rows through the program's key tiles
    (masked tiles at both ends, unmasked between), then its output and lse rows."""
    plgpu.set_max_registers(232, action="increase")
    bq, bkv = st.blocks.block_q, st.blocks.block_kv
    head_dim = q_ref.shape[-1]
    q_smem = smem.q.at[wg]
    base = prog.row0 + wg * bq  # the warpgroup's first row
    q_min = prog.query_position(base)
    q_max = prog.query_position(base + bq - 1)
    plgpu.copy_gmem_to_smem(q_ref.at[prog.b, prog.kvh, pl.ds(base, bq)], q_smem, smem.q_bar.at[wg])
    plgpu.barrier_wait(smem.q_bar.at[wg])
    rows = _Rows(
        q=q_smem,
        v_tail=smem.v_tail.at[wg],
        p=smem.p.at[wg],
        q_pos=prog.query_position(base + _iota((bq, bkv), 0)),
    )

    acc = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((bq,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    a, c = _unmasked_key_blocks(prog.kv_len, q_min, q_max, prog.lo_blk, prog.hi_blk, st)
    take_turn = functools.partial(_take_turn, smem.turn)
    pl.when(wg == 1)(take_turn)  # consumer 0 goes first
    step = functools.partial(_step, prog=prog, smem=smem, rows=rows, st=st)
    carry = (acc, m_i, l_i)
    masked_step = functools.partial(step, masked=True)
    carry = lax.fori_loop(0, a - prog.lo_blk, masked_step, carry)
    carry = lax.fori_loop(
        a - prog.lo_blk, c - prog.lo_blk, functools.partial(step, masked=False), carry
    )
    acc, m_i, l_i = lax.fori_loop(c - prog.lo_blk, prog.steps, masked_step, carry)
    pl.when(wg == 0)(take_turn)  # let consumer 1 finish its last turn

    out_rows = (prog.b, prog.kvh, pl.ds(base, bq))
    _epilogue(acc, m_i, l_i, q_smem, smem.lse.at[wg], o_ref.at[out_rows], lse_ref.at[out_rows])


def _step(i, carry, *, masked: bool, prog: _Program, smem: _Smem, rows: _Rows, st: _Static):
    """One consumer's pass over key tile lo_blk + i (ring slot i % stages): QK^T and PV on the
    tensor cores in its turns, the online softmax between them while the other consumer
    multiplies (FlashAttention-3 §3.1, ping-pong scheduling)."""
    acc, m_i, l_i = carry  # f32[block_q, H], f32[block_q], f32[block_q]
    blk = prog.lo_blk + i
    slot = lax.rem(i, jnp.int32(st.blocks.stages))
    s = _scores(blk, slot, masked=masked, prog=prog, smem=smem, rows=rows, st=st)
    m_new, p, acc, l_i = _softmax_update(s, m_i, acc, l_i)
    p16 = p.astype(rows.p.dtype)
    plgpu.barrier_arrive(smem.turn)  # softmax done: the other consumer's turn
    plgpu.barrier_wait(smem.v_bar.at[slot])
    plgpu.barrier_wait(smem.turn)
    acc = acc + _pv(p16, blk, slot, masked=masked, prog=prog, smem=smem, rows=rows, st=st)
    plgpu.barrier_arrive(smem.v_free.at[slot])
    return acc, m_new, l_i


def _scores(blk, slot, *, masked: bool, prog: _Program, smem: _Smem, rows: _Rows, st: _Static):
    """f32[block_q, block_kv] scores of key tile blk (in ring slot `slot`) in the exp2 domain:
    QK^T in this consumer's turn, then the scale or soft cap, and on a masked tile the kv_len,
    causal and window masks (MASK_VALUE where a key is not attended)."""
    shape = (st.blocks.block_q, st.blocks.block_kv)
    plgpu.barrier_wait(smem.k_bar.at[slot])

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, rows.q, smem.k.at[slot].transpose((1, 0)))
        _take_turn(smem.turn)
        return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
    plgpu.barrier_arrive(smem.k_free.at[slot])
    if st.soft_cap is not None:
        s = jnp.tanh(s * (st.sm_scale / st.soft_cap)) * (st.soft_cap * LOG2E)
    else:
        s = s * (st.sm_scale * LOG2E)
    if masked:
        kv_pos = blk * st.blocks.block_kv + _iota(shape, 1)
        mask = kv_pos < prog.kv_len
        if st.causal:
            mask &= kv_pos <= rows.q_pos
        if st.window is not None:
            mask &= kv_pos > rows.q_pos - st.window
        s = jnp.where(mask, s, MASK_VALUE)
    return s


def _softmax_update(s, m_i, acc, l_i):
    """Online softmax over one tile of scores s f32[block_q, block_kv] (exp2 domain): the new
    running max m f32[block_q], P = exp2(s - m), and the accumulator f32[block_q, H] and row
    sums l f32[block_q] rescaled to the new max (FlashAttention-2 Alg. 1)."""
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - _row_vector(m_new, s.shape))
    acc = acc * _row_vector(alpha, acc.shape)
    l_i = l_i * alpha + p.sum(axis=1)
    return m_new, p, acc, l_i


def _pv(p16, blk, slot, *, masked: bool, prog: _Program, smem: _Smem, rows: _Rows, st: _Static):
    """f32[block_q, H] product of P (p16, [block_q, block_kv] in the input dtype) and value tile
    blk (in ring slot `slot`, landed), in this consumer's turn."""
    bkv = st.blocks.block_kv
    head_dim = rows.q.shape[-1]
    v_tile = smem.v.at[slot]
    if masked:
        # A tile at a boundary may cross kv_len: PV reads this consumer's own copy with the rows
        # past kv_len zeroed (padding may be NaN, and 0 * NaN = NaN).
        kv_rows = blk * bkv + _iota((bkv, head_dim), 0)
        tile = v_tile[...]
        rows.v_tail[...] = jnp.where(kv_rows < prog.kv_len, tile, jnp.zeros_like(tile))
        plgpu.commit_smem()
        v_tile = rows.v_tail

    # P goes through shared memory and PV into a fresh accumulator, added to the rescaled one in
    # registers: JAX's Mosaic GPU interpreter runs neither a register operand of wgmma nor a
    # `pl.run_state` accumulator.
    rows.p[...] = p16
    plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, rows.p, v_tile)
        return acc_ref[...]

    return pl.run_scoped(pv, plgpu.ACC((st.blocks.block_q, head_dim), jnp.float32))


def _epilogue(acc, m_i, l_i, out_smem, lse_smem, out_gmem, lse_gmem):
    """A consumer's rows normalised: the output [block_q, H] = acc / l in the input dtype and the
    natural lse f32[block_q], through shared memory (out_smem, lse_smem) to HBM (out_gmem,
    lse_gmem)."""
    # A row that attended no key kept m at MASK_VALUE: its output is 0.
    empty = m_i < 0.5 * MASK_VALUE
    l_safe = jnp.where(empty, 1.0, l_i)
    inv = jnp.where(empty, 0.0, 1.0 / l_safe)
    out_smem[...] = (acc * _row_vector(inv, acc.shape)).astype(out_smem.dtype)
    lse_smem[...] = jnp.where(empty, jnp.inf, (m_i + jnp.log2(l_safe)) * (1.0 / LOG2E))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
    plgpu.wait_smem_to_gmem(0)


def _forward_call(q_rows, k, v, kv_lens, q_offsets, st: _Static, interpret):
    batch, num_kv, rows, head_dim = q_rows.shape
    bq = st.blocks.block_q
    kernel = plgpu.kernel(
        functools.partial(_forward_kernel, st=st),
        out_type=(
            jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
            jax.ShapeDtypeStruct((batch, num_kv, rows), jnp.float32),
        ),
        grid=(rows // (2 * bq), num_kv, batch),
        grid_names=("rows", "kv_head", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return kernel(kv_lens, q_offsets, q_rows, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _differentiable(q, k, v, kv_lens, q_offsets, opts):
    return flash_attention_mgpu(q, k, v, kv_lens=kv_lens, q_offsets=q_offsets, **dict(opts))


def _differentiable_fwd(q, k, v, kv_lens, q_offsets, opts):
    out = _differentiable(q, k, v, kv_lens, q_offsets, opts)
    return out, (q, k, v, kv_lens, q_offsets)


def _differentiable_bwd(opts, residuals, d_out):
    # The Hopper backward is not written yet: the Triton kernel's (which recomputes its own
    # forward statistics) gives dq, dk, dv.
    q, k, v, kv_lens, q_offsets = residuals
    triton_opts = {name: value for name, value in opts if name not in ("blocks", "interpret")}
    triton_opts["interpret"] = bool(dict(opts).get("interpret", False))
    _, vjp = jax.vjp(
        lambda q, k, v: _triton.flash_attention(
            q, k, v, kv_lens=kv_lens, q_offsets=q_offsets, **triton_opts
        ),
        q,
        k,
        v,
    )
    return (*vjp(d_out), None, None)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def attention(q, k, v, *, kv_lens=None, q_offsets=None, **opts):
    """`flash_attention_mgpu` (forward) that `jax.grad` can differentiate: the backward runs
    the Triton kernel's. `opts`: causal, sm_scale, sliding_window, logits_soft_cap, blocks,
    interpret."""
    kv_lens, q_offsets, _ = _defaults(q, k, kv_lens, q_offsets, None)
    return _differentiable(q, k, v, kv_lens, q_offsets, tuple(sorted(opts.items())))


def flash_attention_mgpu(
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
    blocks: MosaicBlocks | None = None,
    interpret: bool = False,
    return_lse: bool = False,
):
    """FlashAttention forward on Hopper (Mosaic GPU). Arguments as `flash_attention`.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H]; bf16 or f16, H <= 128 (64 and 128 run as they
        are; other head dims are zero-padded, a copy of q, k and v).
      blocks: tiles (default `default_blocks(H)`).
      interpret: run in JAX's Mosaic GPU interpreter (CPU tests; see `mosaic_interpret`).
      return_lse: also return the log-sum-exp per (row, head) as f32[B, N, T].
    Returns:
      [B, T, N, H] in q's dtype (and the lse when asked).
    """
    check_shapes(q, k, v, kv_lens, q_offsets)
    why = supports(q, k, v, blocks)
    if why is not None:
        raise ValueError(f"flash_attention_mgpu does not take {why}; use flash_attention")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    kv_lens, q_offsets, sm_scale = _defaults(q, k, kv_lens, q_offsets, sm_scale)
    batch, seq_q, num_heads, head_dim = q.shape
    seq_k, num_kv = k.shape[1], k.shape[2]
    groups = num_heads // num_kv
    blocks = blocks or default_blocks(padded_head_dim(head_dim))
    st = _Static(groups, causal, float(sm_scale), sliding_window, logits_soft_cap, blocks)
    rows = seq_q * groups
    rows_padded = -(-rows // (2 * blocks.block_q)) * (2 * blocks.block_q)
    q_rows = q.reshape(batch, seq_q, num_kv, groups, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv, rows, head_dim)
    if rows_padded != rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    keys_padded = -(-seq_k // blocks.block_kv) * blocks.block_kv
    if keys_padded != seq_k:  # a partial last tile: TMA boxes are whole tiles
        pad = ((0, 0), (0, keys_padded - seq_k), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    hp = padded_head_dim(head_dim)
    if hp != head_dim:
        widths = ((0, 0), (0, 0), (0, 0), (0, hp - head_dim))
        q_rows, k, v = (jnp.pad(x, widths) for x in (q_rows, k, v))
    kv_lens = jnp.minimum(kv_lens, seq_k)
    params = mosaic_interpret.interpret_params() if interpret else None
    out, lse = _forward_call(q_rows, k, v, kv_lens, q_offsets, st, params)
    out = out[:, :, :rows, :head_dim].reshape(batch, num_kv, seq_q, groups, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(batch, seq_q, num_heads, head_dim)
    if not return_lse:
        return out
    lse = lse[:, :, :rows].reshape(batch, num_kv, seq_q, groups).transpose(0, 1, 3, 2)
    return out, lse.reshape(batch, num_heads, seq_q)
