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


def _forward_kernel(lens_ref, offs_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static):
    # q_ref / o_ref: [B, K, R, H] rows (query, group head); k_ref, v_ref: [B, S, K, H];
    # lse_ref: f32[B, K, R] (natural log-sum-exp per row, +inf for a row with no key).
    blocks = st.blocks
    bq, bkv, stages = blocks.block_q, blocks.block_kv, blocks.stages
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    tr = _transforms(dtype)

    def body(
        q_smem2,
        k_smem,
        v_smem,
        v_tail2,
        p_smem2,
        lse_smem2,
        q_bar,
        k_bar,
        v_bar,
        k_free,
        v_free,
        turn,
    ):
        b = lax.axis_index("batch")
        kvh = lax.axis_index("kv_head")
        wg = lax.axis_index("wg")
        kv_len = lens_ref[b]
        q_off = offs_ref[b]
        row0 = lax.axis_index("rows") * (2 * bq)
        groups = jnp.int32(st.groups)
        first_q = q_off + lax.div(row0, groups)
        last_q = q_off + lax.div(row0 + 2 * bq - 1, groups)
        lo_blk, hi_blk = _program_key_blocks(kv_len, first_q, last_q, st)
        steps = hi_blk - lo_blk

        def kv_tile(ref, blk):
            return ref.at[b, pl.ds(blk * bkv, bkv), kvh]

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q_smem = q_smem2.at[wg]
            v_tail = v_tail2.at[wg]
            p_smem = p_smem2.at[wg]
            base = row0 + wg * bq
            q_min = q_off + lax.div(base, groups)
            q_max = q_off + lax.div(base + bq - 1, groups)
            plgpu.copy_gmem_to_smem(q_ref.at[b, kvh, pl.ds(base, bq)], q_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            shape = (bq, bkv)
            q_pos = q_off + lax.div(base + _iota(shape, 0), groups)

            def take_turn():
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

            def step(i, carry, *, masked: bool):
                acc, m_i, l_i = carry
                blk = lo_blk + i
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if st.soft_cap is not None:
                    s = jnp.tanh(s * (st.sm_scale / st.soft_cap)) * (st.soft_cap * LOG2E)
                else:
                    s = s * (st.sm_scale * LOG2E)
                if masked:
                    kv_pos = blk * bkv + _iota(shape, 1)
                    mask = kv_pos < kv_len
                    if st.causal:
                        mask &= kv_pos <= q_pos
                    if st.window is not None:
                        mask &= kv_pos > q_pos - st.window
                    s = jnp.where(mask, s, MASK_VALUE)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - _row_vector(m_new, shape))
                acc = acc * _row_vector(alpha, acc.shape)
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                plgpu.barrier_arrive(turn)  # softmax done: the other consumer's turn
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(turn)
                v_tile = v_smem.at[slot]
                if masked:
                    # A tile at a boundary may cross kv_len: PV reads this consumer's own copy
                    # with the rows past kv_len zeroed (padding may be NaN, and 0 * NaN = NaN).
                    rows = blk * bkv + plgpu.broadcasted_iota(
                        jnp.int32, (bkv, head_dim), 0, layout=plgpu.Layout.WGMMA
                    )
                    tile = v_tile[...]
                    v_tail[...] = jnp.where(rows < kv_len, tile, jnp.zeros_like(tile))
                    plgpu.commit_smem()
                    v_tile = v_tail

                # P goes through shared memory and PV into a fresh accumulator, added to the
                # rescaled one in registers: JAX's Mosaic GPU interpreter runs neither a
                # register operand of wgmma nor a `pl.run_state` accumulator.
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_tile)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, head_dim), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            acc = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA)
            m_i = plgpu.layout_cast(
                jnp.full((bq,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            )
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            a, c = _unmasked_key_blocks(kv_len, q_min, q_max, lo_blk, hi_blk, st)
            pl.when(wg == 1)(take_turn)  # consumer 0 goes first
            carry = (acc, m_i, l_i)
            masked_step = functools.partial(step, masked=True)
            carry = lax.fori_loop(0, a - lo_blk, masked_step, carry)
            carry = lax.fori_loop(
                a - lo_blk, c - lo_blk, functools.partial(step, masked=False), carry
            )
            acc, m_i, l_i = lax.fori_loop(c - lo_blk, steps, masked_step, carry)
            pl.when(wg == 0)(take_turn)  # let consumer 1 finish its last turn

            # A row that attended no key kept m at MASK_VALUE: its output is 0.
            empty = m_i < 0.5 * MASK_VALUE
            l_safe = jnp.where(empty, 1.0, l_i)
            inv = jnp.where(empty, 0.0, 1.0 / l_safe)
            q_smem[...] = (acc * _row_vector(inv, acc.shape)).astype(dtype)
            lse_smem2.at[wg][...] = jnp.where(
                empty, jnp.inf, (m_i + jnp.log2(l_safe)) * (1.0 / LOG2E)
            )
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, kvh, pl.ds(base, bq)])
            plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[b, kvh, pl.ds(base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def issue(i, slot):
                blk = lo_blk + i
                plgpu.copy_gmem_to_smem(kv_tile(k_ref, blk), k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(kv_tile(v_ref, blk), v_smem.at[slot], v_bar.at[slot])

            for i in range(stages):
                pl.when(i < steps)(functools.partial(issue, i, i))

            @pl.loop(stages, jnp.maximum(steps, stages))
            def _refill(i):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                issue(i, slot)

    pl.run_scoped(
        body,
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
        collective_axes="wg",
    )


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
