"""Latent cache for Multi-head Latent Attention (`model.mla`): per token and layer it holds only
the compressed latent (kv_lora_rank) and the rope key shared by all heads (qk_rope_head_dim), as
one entry of width C = R + Hr, never per-head keys and values.

`MLACache`: contiguous, one pre-allocated [max_len] slab per batch row and layer, with the same
step semantics as `cache.KVCache` (write at ``lengths[b] + i``, attend, then `advance`).
`PagedMLACache`: a pool of pages of entries addressed through block tables (`PagedMetadata`),
as `cache.PagedKVCache` holds K/V pages.

Both hand the model (`model.mla`) the entries a step's queries attend over with
``latent_context``; the engine's packed steps read the pages in place
(`pallas_kernels.dispatch.paged_mla_attention`: the Pallas MLA kernel on GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxgen.cache.contiguous import StepMetadata
from jaxgen.cache.paged import PagedMetadata, RaggedMetadata

# Logical axes of the entries [L, B, S, C] (see sharding.rules): never split across devices
# but by batch, since every head reads the whole entry.
CACHE_AXES = ("layers", "cache_batch", "kv_seq", None)


def latent_bytes_per_token(cfg, dtype=jnp.float32) -> int:
    """Cache bytes one token takes in an MLA model: layers x (kv_lora_rank + qk_rope_head_dim)
    x itemsize."""
    mla = cfg.mla
    return cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * jnp.dtype(dtype).itemsize


def mha_bytes_per_token(cfg, dtype=jnp.float32) -> int:
    """What the same model's cache would take per token with the expanded per-head keys and
    values stored (K: N x (Hn + Hr), V: N x Hv per layer), as an MHA cache would hold them."""
    mla = cfg.mla
    per_layer = cfg.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    return cfg.num_layers * per_layer * jnp.dtype(dtype).itemsize


def cache_size_report(cfg, dtype=jnp.float32) -> dict[str, float]:
    """The latent cache's bytes per token beside an equivalent MHA cache's, and their ratio."""
    latent, mha = latent_bytes_per_token(cfg, dtype), mha_bytes_per_token(cfg, dtype)
    return {"latent_bytes_per_token": latent, "mha_bytes_per_token": mha, "ratio": mha / latent}


def _check_mla(cfg, name):
    if cfg.mla is None:
        raise ValueError(f"{name} needs an MLA model config; {cfg.arch!r} has none")


@struct.dataclass
class MLACache:
    entries: jax.Array  # [L, B, S_max, C]: latent (R) then rope key (Hr) of each token
    lengths: jax.Array  # i32[B] tokens held per row

    @classmethod
    def init(cls, cfg, batch: int, max_len: int, dtype=jnp.float32) -> MLACache:
        """An empty latent cache for an MLA `cfg` (a `model.ModelConfig` with `mla`)."""
        _check_mla(cfg, "MLACache")
        if batch < 1 or max_len < 1:
            raise ValueError(f"MLACache needs batch >= 1 and max_len >= 1, got {batch=} {max_len=}")
        shape = (cfg.num_layers, batch, max_len, cfg.mla.latent_dim)
        return cls(entries=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))

    @staticmethod
    def logical_axes():
        return MLACache(entries=CACHE_AXES, lengths=("cache_batch",))

    @property
    def batch(self) -> int:
        return self.entries.shape[1]

    @property
    def max_len(self) -> int:
        return self.entries.shape[2]

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def positions(self, num_tokens: int) -> jax.Array:
        """i32[B, T]: absolute positions of the next `num_tokens` tokens of each row."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def write_latent(self, layer, entries_btc, md: StepMetadata) -> MLACache:
        """Writes the step's entries [B, T, C] into layer `layer` (padding tokens are dropped)."""
        num_q = entries_btc.shape[1]
        pos = self.positions(num_q)
        pos = jnp.where(jnp.arange(num_q)[None, :] < md.num_new[:, None], pos, self.max_len)
        rows = jnp.arange(self.batch)[:, None]
        new = self.entries.at[layer, rows, pos].set(
            entries_btc.astype(self.entries.dtype), mode="drop"
        )
        return self.replace(entries=new)

    def latent_context(self, layer, md: StepMetadata):
        """(entries [B, S_max, C] of layer `layer`, kv_lens i32[B], q_offsets i32[B]) for the
        step's queries, once its entries are written."""
        return self.entries[layer], self.lengths + md.num_new, self.lengths

    def advance(self, md: StepMetadata) -> MLACache:
        return self.replace(lengths=self.lengths + md.num_new)


@struct.dataclass
class PagedMLACache:
    entries: jax.Array  # [L, P, page_size, C]: latent (R) then rope key (Hr) of each token

    @classmethod
    def init(cls, cfg, num_pages: int, page_size: int, dtype=jnp.float32) -> PagedMLACache:
        """An empty pool of `num_pages` pages of `page_size` tokens for an MLA `cfg`."""
        _check_mla(cfg, "PagedMLACache")
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1: {num_pages=} {page_size=}")
        shape = (cfg.num_layers, num_pages, page_size, cfg.mla.latent_dim)
        return cls(entries=jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_page(cfg, page_size: int, dtype=jnp.float32) -> int:
        """page_size x `latent_bytes_per_token`."""
        return page_size * latent_bytes_per_token(cfg, dtype)

    @classmethod
    def pages_for_budget(cls, cfg, budget_bytes: int, page_size: int, dtype=jnp.float32) -> int:
        return int(budget_bytes // cls.bytes_per_page(cfg, page_size, dtype))

    def logical_axes(self):
        return PagedMLACache(entries=("layers", None, None, None))

    @property
    def num_pages(self) -> int:
        return self.entries.shape[1]

    @property
    def page_size(self) -> int:
        return self.entries.shape[2]

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def write_latent(self, layer, entries_btc, md: PagedMetadata | RaggedMetadata) -> PagedMLACache:
        """Writes the step's entries [B, T, C] (the engine's packed step: [1, N, C]) into their
        slots (slot -1: not written)."""
        slots = md.slot_mapping.reshape(-1)
        # Index (layer, page, offset) directly, as PagedKVCache.write does (in place on XLA:CPU).
        pages = jnp.where(slots < 0, self.num_pages, slots // self.page_size)
        offsets = slots % self.page_size
        new = entries_btc.reshape(-1, entries_btc.shape[-1]).astype(self.entries.dtype)
        return self.replace(entries=self.entries.at[layer, pages, offsets].set(new, mode="drop"))

    def latent_context(self, layer, md: PagedMetadata):
        """(entries [B, max_pages * page_size, C] gathered through each row's block table,
        kv_lens i32[B], q_offsets i32[B]) once the step's entries are written. The engine's
        packed steps (RaggedMetadata) attend over the pages in place instead
        (`model.mla.ragged_mla_attention`)."""
        if isinstance(md, RaggedMetadata):
            raise ValueError("latent_context takes PagedMetadata; packed steps read pages in place")
        rows = self.entries[layer, md.block_tables]  # [B, max_pages, page_size, C]
        b, num_pages, page_size, c = rows.shape
        return rows.reshape(b, num_pages * page_size, c), md.seq_lens, md.context_lens

    def advance(self, md) -> PagedMLACache:
        return self  # lengths live on the host (block manager) and in the metadata

    def copy_pages(self, src, dst) -> PagedMLACache:
        """Copies whole pages src[i] -> dst[i] in every layer (copy-on-write)."""
        return self.replace(entries=self.entries.at[:, dst].set(self.entries[:, src]))
