"""Contiguous KV cache: one pre-allocated [max_len] slab per batch row and layer.

The cache is a pytree passed into every jitted step and returned from it (donated, so XLA
updates it in place). A step writes its new keys/values at positions ``lengths[b] + i`` and
then advances ``lengths``; attention during the step sees the old entries plus the new ones.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxgen.pallas_kernels import dispatch


@struct.dataclass
class StepMetadata:
    """Per-step attention metadata for the contiguous cache (and for cache-free forwards)."""

    num_new: jax.Array  # i32[B] valid new tokens per row this step (rest of T is padding)
    # Static: no row holds cached tokens before this step, so attention runs over the new
    # keys/values only (S = T) instead of over the whole [max_len] slab.
    fresh: bool = struct.field(pytree_node=False, default=False)


# Logical axes of the keys / values [L, B, S, K, H] (see sharding.rules).
CACHE_AXES = ("layers", "cache_batch", "kv_seq", "cache_kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S_max, K, H]
    v: jax.Array  # [L, B, S_max, K, H]
    lengths: jax.Array  # i32[B] tokens held per row

    @classmethod
    def init(cls, cfg, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty cache for `cfg` (a `model.ModelConfig`), zero-filled."""
        if getattr(cfg, "mla", None) is not None:
            raise ValueError(
                f"{cfg.arch} uses Multi-head Latent Attention: build a cache.MLACache (the latent "
                "and rope key per token), not per-head keys and values"
            )
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch >= 1 and max_len >= 1, got {batch=} {max_len=}")
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @staticmethod
    def logical_axes():
        """Logical axis names of each field (see sharding.rules)."""
        return KVCache(k=CACHE_AXES, v=CACHE_AXES, lengths=("cache_batch",))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def positions(self, num_tokens: int) -> jax.Array:
        """i32[B, T]: absolute positions of the next `num_tokens` tokens of each row."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def attend(self, layer, q, k, v, md: StepMetadata, *, sm_scale, sliding_window, impl=None):
        """Writes this step's k/v into layer `layer` and attends q over the row's history.

        Args:
          layer: i32[] layer index (traced inside the layer scan).
          q: [B, T, N, H]; k, v: [B, T, K, H] for the new tokens.
        Returns:
          (out [B, T, N, H], updated cache).
        """
        num_q = q.shape[1]
        pos = self.positions(num_q)
        # Padding tokens (i >= num_new) scatter out of bounds and are dropped, so they never
        # overwrite a valid entry; positions past max_len are rejected by the engine upstream.
        pos = jnp.where(jnp.arange(num_q)[None, :] < md.num_new[:, None], pos, self.max_len)
        rows = jnp.arange(self.batch)[:, None]
        # The written values take the cache's layout (see sharding.rules on cache_batch).
        new_axes = (CACHE_AXES[1], None, *CACHE_AXES[3:])  # [B, T, K, H]
        k_new = nn.with_logical_constraint(k, new_axes)
        v_new = nn.with_logical_constraint(v, new_axes)
        # (The layer axis is left free: inside a pipeline stage it is the manual stage axis.)
        cache_axes = (None, *CACHE_AXES[1:])
        # Pin the cache's layout through the update: otherwise GSPMD may follow the query
        # heads' split into the KV heads and all-gather the whole cache back at the end.
        new = self.replace(
            k=nn.with_logical_constraint(
                self.k.at[layer, rows, pos].set(k_new.astype(self.k.dtype), mode="drop"), cache_axes
            ),
            v=nn.with_logical_constraint(
                self.v.at[layer, rows, pos].set(v_new.astype(self.v.dtype), mode="drop"), cache_axes
            ),
        )
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
        else:
            out = dispatch.cached_attention(
                q,
                new.k,
                new.v,
                layer,
                kv_lens=self.lengths + md.num_new,
                q_offsets=self.lengths,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                impl=impl,
            )
        return out, new

    def advance(self, md: StepMetadata) -> KVCache:
        return self.replace(lengths=self.lengths + md.num_new)
