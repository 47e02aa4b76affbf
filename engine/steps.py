"""The two jitted device steps over the contiguous cache: `prefill` and `decode`.

Both take the params and cache pytrees and return the new cache; the cache is donated so XLA
updates it in place. Statics are keyword-only (`cfg` is a frozen, hashable ModelConfig).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cache.contiguous import KVCache, StepMetadata
from model.llama import Transformer

_STATICS = ("cfg", "attn_impl", "chunked", "all_logits")


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("kv",))
def prefill(
    params, tokens, lengths, kv: KVCache, *, cfg, attn_impl=None, chunked=False, all_logits=False
):
    """Runs right-padded prompts through the model and fills the cache.

    Args:
      tokens: i32[B, T] (T a bucket size; row b's valid tokens are tokens[b, :lengths[b]]).
      lengths: i32[B] valid tokens per row (0 for padding rows).
      kv: the cache; row b's new tokens go at positions kv.lengths[b] + i.
      chunked: static; False when every row's cache is empty (attention then runs over the new
        tokens only), True to continue rows that already hold tokens (chunked prefill).
      all_logits: static; return logits for every position (prompt logprobs, perplexity).
    Returns:
      (logits f32[B, V] at each row's last valid token -- or f32[B, T, V] with all_logits --,
       the updated cache).
    """
    md = StepMetadata(num_new=lengths.astype(jnp.int32), fresh=not chunked)
    logits_index = None if all_logits else jnp.maximum(lengths - 1, 0)[:, None]
    logits, kv = Transformer(cfg, attn_impl).apply(
        {"params": params}, tokens, kv.positions(tokens.shape[1]), kv, md, logits_index
    )
    return (logits if all_logits else logits[:, 0]), kv


def decode_step(params, tokens, kv: KVCache, active, *, cfg, attn_impl=None):
    """One decode step (unjitted body, shared with the fused multi-token loop)."""
    md = StepMetadata(num_new=active.astype(jnp.int32))
    logits, kv = Transformer(cfg, attn_impl).apply(
        {"params": params}, tokens[:, None], kv.positions(1), kv, md
    )
    return logits[:, 0], kv


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"), donate_argnames=("kv",))
def decode(params, tokens, kv: KVCache, active=None, *, cfg, attn_impl=None):
    """Feeds one token per row and returns next-token logits.

    Args:
      tokens: i32[B] the last sampled token of each row.
      active: bool[B] or None; inactive rows neither write the cache nor advance.
    Returns:
      (logits f32[B, V], the updated cache).
    """
    if active is None:
        active = jnp.ones(tokens.shape, jnp.bool_)
    return decode_step(params, tokens, kv, active, cfg=cfg, attn_impl=attn_impl)
