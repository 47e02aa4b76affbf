"""Latent cache for Multi-head Latent Attention (`model.mla`): per token and layer it holds only
the compressed latent (kv_lora_rank) and the rope key shared by all heads (qk_rope_head_dim), as
one entry of width C = R + Hr, never per-head keys and values.

Contiguous layout, one pre-allocated [max_len] slab per batch row and layer, with the same
step semantics as `cache.KVCache` (write at ``lengths[b] + i``, attend, then `advance`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxgen.cache.contiguous import StepMetadata

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


@struct.dataclass
class MLACache:
    entries: jax.Array  # [L, B, S_max, C]: latent (R) then rope key (Hr) of each token
    lengths: jax.Array  # i32[B] tokens held per row

    @classmethod
    def init(cls, cfg, batch: int, max_len: int, dtype=jnp.float32) -> MLACache:
        """An empty latent cache for an MLA `cfg` (a `model.ModelConfig` with `mla`)."""
        if cfg.mla is None:
            raise ValueError(f"MLACache needs an MLA model config; {cfg.arch!r} has none")
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
