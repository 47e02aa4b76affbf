"""Paged KV cache: one pool of fixed-size pages per layer, addressed through block tables.

The pool is a pytree passed into every jitted step and returned (donated). Which page holds
which token is decided on the host by `cache.block_manager.BlockManager`; the device sees it
only through `PagedMetadata` (slot of each new token, block table of each sequence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.page_blocks import PageBlocks
from jaxgen.pallas_kernels.paged_attention import (
    MAX_QUERY_TOKENS,
    kv_cache_shape,
    padded_head_dim,
)

# kv_quant -> (value dtype, largest value, storage dtype). fp8 pages are stored as their bits
# in uint8: XLA:CPU has no native fp8, so a scatter into an fp8 pool converted the whole pool to
# f32 and back on every write (0.5 s per step for a 4000-page pool); a uint8 scatter is in place.
KV_QUANT = {
    "int8": (jnp.int8, 127.0, jnp.int8),
    "fp8": (jnp.float8_e4m3fn, 448.0, jnp.uint8),
}


@struct.dataclass
class PagedMetadata:
    """What one step needs to know about the pages (built on the host each step)."""

    slot_mapping: (
        jax.Array
    )  # i32[B, T] pool slot (page * page_size + offset) per new token; -1 = pad
    block_tables: jax.Array  # i32[B, max_pages] physical page of each logical page
    context_lens: jax.Array  # i32[B] tokens already cached before this step
    num_new: jax.Array  # i32[B] valid new tokens per row
    # Static: no row has cached tokens, so attention can run over the new keys only.
    fresh: bool = struct.field(pytree_node=False, default=False)

    @property
    def seq_lens(self):
        return self.context_lens + self.num_new


@struct.dataclass
class RaggedMetadata:
    """A packed step of the continuous-batching engine: the model sees one row of N tokens,
    laid out as [num_decode decode tokens | verify_rows x verify_len speculative-verification
    tokens | prefill_rows x prefill_len prefill-chunk tokens], so every weight is read once per
    step whatever the mix."""

    slot_mapping: jax.Array  # i32[N] pool slot of each token; -1 = padding
    decode_tables: jax.Array  # i32[Bd, max_pages] ([Bd, 0] when decode_blocks are given)
    decode_seq_lens: jax.Array  # i32[Bd] tokens in each decode sequence, the new one included
    prefill_tables: jax.Array  # i32[Bp, max_pages]
    prefill_context: jax.Array  # i32[Bp] tokens cached before this chunk
    prefill_num_new: jax.Array  # i32[Bp] valid tokens in this chunk
    verify_tables: jax.Array | None = None  # i32[Bv, max_pages]
    verify_context: jax.Array | None = None  # i32[Bv] tokens cached before the verified ones
    # The decode rows' pages as a flat list of blocks (the XLA path; see page_blocks).
    decode_blocks: PageBlocks | None = None
    num_decode: int = struct.field(pytree_node=False, default=0)  # Bd
    verify_rows: int = struct.field(pytree_node=False, default=0)  # Bv
    verify_len: int = struct.field(pytree_node=False, default=0)  # k + 1 (<= 16)
    prefill_rows: int = struct.field(pytree_node=False, default=0)  # Bp
    prefill_len: int = struct.field(pytree_node=False, default=0)  # T per prefill row
    # Static: no prefill row has cached context, so chunks attend over their own keys only.
    prefill_fresh: bool = struct.field(pytree_node=False, default=True)


@struct.dataclass
class FlatMetadata:
    """One ragged step: every sequence's new tokens back to back on one flat token axis (the
    model sees one row of T tokens, T a token bucket), each sequence with its query offsets,
    length in the cache and page table in arrays of fixed size S. Decode rows, verify rows and
    prefill chunks (fresh or after cached context) are all sequences with 1..T tokens, so a
    step's program depends on T, S and W only (see `pallas_kernels.ragged_paged_attention`)."""

    slot_mapping: jax.Array  # i32[T] pool slot of each token; -1 = padding (not written)
    cu_q_lens: jax.Array  # i32[S + 1] sequence s owns tokens cu_q_lens[s] .. cu_q_lens[s+1]-1
    seq_lens: jax.Array  # i32[S] tokens of each sequence in the cache after this step
    page_tables: jax.Array  # i32[S, W] physical page of each logical page
    num_seqs: jax.Array  # i32[1] sequences in use; rows past it are padding
    # Batch-invariant attention order (`ragged_paged_attention_xla(invariant=True)`): a token's
    # output does not depend on the other sequences of its step.
    invariant: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class PagedKVCache:
    k: jax.Array  # [L, P, page_size, K, Hp] (Hp = head_dim padded to a power of two)
    v: jax.Array  # [L, P, page_size, K, Hp]
    k_scales: jax.Array | None  # f32[L, P, page_size, K] for int8 / fp8 pages, else None
    v_scales: jax.Array | None
    kv_quant: str | None = struct.field(pytree_node=False, default=None)  # None, "int8", "fp8"

    @classmethod
    def init(
        cls, cfg, num_pages: int, page_size: int, dtype=jnp.float32, kv_quant: str | None = None
    ) -> PagedKVCache:
        """An empty pool. `kv_quant` "int8" or "fp8" stores pages quantized per token and head."""
        if getattr(cfg, "mla", None) is not None:
            raise ValueError(
                f"{cfg.arch} uses Multi-head Latent Attention, whose pages hold the latent: build "
                "a cache.PagedMLACache (as the engine does for MLA models)"
            )
        if num_pages < 1 or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(
                f"need num_pages >= 1 and a power-of-two page_size: {num_pages=} {page_size=}"
            )
        if kv_quant is not None and kv_quant not in KV_QUANT:
            raise ValueError(
                f"kv_quant must be one of {sorted(KV_QUANT)} or None, got {kv_quant!r}"
            )
        shape = (
            cfg.num_layers,
            *kv_cache_shape(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim),
        )
        page_dtype = KV_QUANT[kv_quant][2] if kv_quant else dtype
        # Separate buffers for K and V scales: the pool is donated, and one buffer cannot be
        # donated twice.
        scales = (lambda: jnp.zeros(shape[:-1], jnp.float32)) if kv_quant else (lambda: None)
        return cls(
            k=jnp.zeros(shape, page_dtype),
            v=jnp.zeros(shape, page_dtype),
            k_scales=scales(),
            v_scales=scales(),
            kv_quant=kv_quant,
        )

    @staticmethod
    def bytes_per_page(cfg, page_size: int, dtype=jnp.float32, kv_quant: str | None = None) -> int:
        """2 (K and V) x layers x page_size x kv_heads x head_dim (padded) x itemsize, plus the
        f32 scales (2 x layers x page_size x kv_heads x 4) of quantized pages."""
        itemsize = 1 if kv_quant else jnp.dtype(dtype).itemsize
        hp = padded_head_dim(cfg.head_dim)
        nbytes = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * hp * itemsize
        if kv_quant:
            nbytes += 2 * cfg.num_layers * page_size * cfg.num_kv_heads * 4
        return nbytes

    @classmethod
    def pages_for_budget(
        cls, cfg, budget_bytes: int, page_size: int, dtype=jnp.float32, kv_quant: str | None = None
    ) -> int:
        """How many pages a memory budget holds (see `bytes_per_page` for the formula)."""
        return int(budget_bytes // cls.bytes_per_page(cfg, page_size, dtype, kv_quant))

    def logical_axes(self):
        """Logical axis names of each field (see sharding.rules): pages split by KV head."""
        pool = ("layers", None, None, "kv_heads", "head_dim")
        scales = None if self.k_scales is None else ("layers", None, None, "kv_heads")
        return PagedKVCache(
            k=pool, v=pool, k_scales=scales, v_scales=scales, kv_quant=self.kv_quant
        )

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self.k_scales is not None

    @property
    def nbytes(self) -> int:
        extra = self.k_scales.nbytes + self.v_scales.nbytes if self.quantized else 0
        return self.k.nbytes + self.v.nbytes + extra

    @property
    def pages(self) -> tuple[jax.Array, jax.Array]:
        """(K, V) pools in their value dtype (fp8 bits viewed as float8_e4m3fn; a bitcast of
        equal width, which XLA does not copy)."""
        if self.kv_quant is None or self.k.dtype == KV_QUANT[self.kv_quant][0]:
            return self.k, self.v
        dtype = KV_QUANT[self.kv_quant][0]
        return (
            jax.lax.bitcast_convert_type(self.k, dtype),
            jax.lax.bitcast_convert_type(self.v, dtype),
        )

    def _quantize(self, x):
        """Per token and head symmetric quantization of [..., H] -> (stored values, f32 scales)."""
        dtype, qmax, storage = KV_QUANT[self.kv_quant]
        x32 = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x32), axis=-1) / qmax
        scaled = x32 / jnp.where(scale == 0, 1.0, scale)[..., None]
        if dtype == jnp.int8:
            return jnp.round(scaled).astype(dtype), scale
        return jax.lax.bitcast_convert_type(scaled.astype(dtype), storage), scale

    def write(self, layer, k_new, v_new, slot_mapping) -> PagedKVCache:
        """Writes new keys/values [B, T, K, H] into their slots (slot -1: not written)."""
        num_pages, page_size = self.num_pages, self.page_size
        slots = slot_mapping.reshape(-1)
        # Out-of-range pages are dropped. Index (layer, page, offset) directly: a scatter through
        # a reshaped view of the pool is not done in place by XLA:CPU for a single slot.
        pages = jnp.where(slots < 0, num_pages, slots // page_size)
        offsets = slots % page_size
        hp = self.k.shape[-1]
        pad = ((0, 0), (0, 0), (0, 0), (0, hp - k_new.shape[-1]))
        k_new, v_new = jnp.pad(k_new, pad), jnp.pad(v_new, pad)

        def put(pool, new):
            new = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
            return pool.at[layer, pages, offsets].set(new, mode="drop")

        if not self.quantized:
            return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))
        kq, ks = self._quantize(k_new)
        vq, vs = self._quantize(v_new)
        return self.replace(
            k=put(self.k, kq),
            v=put(self.v, vq),
            k_scales=put(self.k_scales, ks),
            v_scales=put(self.v_scales, vs),
        )

    def attend(self, layer, q, k, v, md, *, sm_scale, sliding_window, impl=None):
        """Writes this step's k/v, then attends q [B, T, N, H] over each row's pages."""
        if isinstance(md, FlatMetadata):
            return self._attend_flat(
                layer, q, k, v, md, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl
            )
        if isinstance(md, RaggedMetadata):
            return self._attend_ragged(
                layer, q, k, v, md, sm_scale=sm_scale, sliding_window=sliding_window, impl=impl
            )
        new = self.write(layer, k, v, md.slot_mapping)
        num_q = q.shape[1]
        if md.fresh:
            out = dispatch.attention(
                q,
                k,
                v,
                kv_lens=md.num_new,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                impl=impl,
            )
            return out, new
        # The whole pool and the layer index go to attention: slicing one layer out of the
        # pool would copy it (all its pages, used or not) every layer of every step.
        k_pages, v_pages = new.pages
        scales = (new.k_scales, new.v_scales)
        if num_q <= MAX_QUERY_TOKENS:
            # Decode and short verification chunks. The kernel places query t at position
            # seq_len - T + t, so rows with fewer than T new tokens are given context + T:
            # their valid queries still see only keys before them (causal), and the padded
            # queries' outputs are discarded. Block-table padding must be a valid page (0).
            out = dispatch.paged_attention(
                q,
                k_pages,
                v_pages,
                md.block_tables,
                md.context_lens + num_q,
                sm_scale=sm_scale,
                k_scales=scales[0],
                v_scales=scales[1],
                sliding_window=sliding_window,
                layer=layer,
                impl=impl,
            )
            return out, new
        # Long chunks with cached context: the prefix from its pages (read in place by the
        # kernel), the chunk's own keys and values from the batch.
        out = dispatch.paged_prefill(
            q,
            k,
            v,
            k_pages,
            v_pages,
            md.block_tables,
            md.context_lens,
            md.num_new,
            sm_scale=sm_scale,
            k_scales=scales[0],
            v_scales=scales[1],
            sliding_window=sliding_window,
            layer=layer,
            impl=impl,
        )
        return out, new

    def _attend_flat(self, layer, q, k, v, md: FlatMetadata, *, sm_scale, sliding_window, impl):
        """q [1, T, N, H], the step's tokens as laid out by `FlatMetadata`: written into their
        slots first, so every token attends its sequence's keys from the pages alone."""
        if q.shape[0] != 1 or md.slot_mapping.shape != q.shape[1:2]:
            raise ValueError(
                f"a FlatMetadata step is one row of T tokens: {q.shape=} {md.slot_mapping.shape=}"
            )
        slots = md.slot_mapping[None]
        if k.shape[1] == 1:
            # One token: XLA would write it as a dynamic-update-slice that reads the slot's old
            # value (to keep it for slot -1), and for that copies the whole pool, every layer,
            # once the pool goes on into the attention's loops. A second, dropped slot keeps the
            # write a scatter, done in place.
            k, v = (jnp.concatenate([x, jnp.zeros_like(x)], axis=1) for x in (k, v))
            slots = jnp.concatenate([slots, jnp.full_like(slots, -1)], axis=1)
        new = self.write(layer, k, v, slots)
        k_pages, v_pages = new.pages
        out, (k_pages, v_pages, k_scales, v_scales) = dispatch.ragged_paged_attention(
            q[0],
            k_pages,
            v_pages,
            md.page_tables,
            md.cu_q_lens,
            md.seq_lens,
            md.num_seqs,
            sm_scale=sm_scale,
            k_scales=new.k_scales,
            v_scales=new.v_scales,
            sliding_window=sliding_window,
            layer=layer,
            impl=impl,
            return_pages=True,  # the pool back from the loops that read it: no copy of it
            invariant=md.invariant,
        )

        def stored(x, like):  # fp8 pools are viewed as float8 by `pages`: back to their bits
            return x if x.dtype == like.dtype else jax.lax.bitcast_convert_type(x, like.dtype)

        new = new.replace(
            k=stored(k_pages, new.k), v=stored(v_pages, new.v), k_scales=k_scales, v_scales=v_scales
        )
        return out[None], new

    def _attend_ragged(self, layer, q, k, v, md: RaggedMetadata, *, sm_scale, sliding_window, impl):
        """q [1, N, heads, H] packed as described by `RaggedMetadata`."""
        new = self.write(layer, k, v, md.slot_mapping[None])
        q, k, v = q[0], k[0], v[0]
        (k_pages, v_pages), k_scales, v_scales = new.pages, new.k_scales, new.v_scales
        opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
        outs = []
        nd = md.num_decode
        if nd:
            out = dispatch.paged_attention(
                q[:nd, None],
                k_pages,
                v_pages,
                md.decode_tables,
                md.decode_seq_lens,
                k_scales=k_scales,
                v_scales=v_scales,
                layer=layer,
                blocks=md.decode_blocks,
                **opts,
            )
            outs.append(out[:, 0])
        start = nd
        if md.verify_rows:
            # The last token and the drafts of each row, causal among themselves (the paged
            # kernel's multi-token variant; see PagedKVCache.attend on padded rows).
            end = start + md.verify_rows * md.verify_len
            qv = q[start:end].reshape(md.verify_rows, md.verify_len, *q.shape[1:])
            out = dispatch.paged_attention(
                qv,
                k_pages,
                v_pages,
                md.verify_tables,
                md.verify_context + md.verify_len,
                k_scales=k_scales,
                v_scales=v_scales,
                layer=layer,
                **opts,
            )
            outs.append(out.reshape(-1, *q.shape[1:]))
            start = end
        if md.prefill_rows:
            shape = (md.prefill_rows, md.prefill_len)
            end = start + md.prefill_rows * md.prefill_len
            qp = q[start:end].reshape(*shape, *q.shape[1:])
            if md.prefill_fresh:
                kp = k[start:end].reshape(*shape, *k.shape[1:])
                vp = v[start:end].reshape(*shape, *v.shape[1:])
                out = dispatch.attention(qp, kp, vp, kv_lens=md.prefill_num_new, **opts)
            else:
                out = dispatch.paged_prefill(
                    qp,
                    k[start:end].reshape(*shape, *k.shape[1:]),
                    v[start:end].reshape(*shape, *v.shape[1:]),
                    k_pages,
                    v_pages,
                    md.prefill_tables,
                    md.prefill_context,
                    md.prefill_num_new,
                    k_scales=k_scales,
                    v_scales=v_scales,
                    layer=layer,
                    **opts,
                )
            outs.append(out.reshape(-1, *q.shape[1:]))
        out = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
        pad = q.shape[0] - out.shape[0]  # padding tokens after the prefill rows
        if pad:
            out = jnp.concatenate([out, jnp.zeros((pad, *out.shape[1:]), out.dtype)], axis=0)
        return out[None], new

    def advance(self, md) -> PagedKVCache:
        return self  # lengths live on the host (block manager) and in the metadata

    def copy_pages(self, src, dst) -> PagedKVCache:
        """Copies whole pages src[i] -> dst[i] in every layer (copy-on-write)."""

        def cp(pool):
            return None if pool is None else pool.at[:, dst].set(pool[:, src])

        return self.replace(
            k=cp(self.k), v=cp(self.v), k_scales=cp(self.k_scales), v_scales=cp(self.v_scales)
        )


def slots_for(table: list[int], start: int, end: int, page_size: int) -> np.ndarray:
    """Pool slots of token positions [start, end) of a sequence with block table `table`."""
    pos = np.arange(start, end)
    return np.asarray(table, np.int64)[pos // page_size] * page_size + pos % page_size
