"""The jitted device steps over the contiguous cache: `prefill`, `decode` and `decode_loop`
(the static engine's), with the sampling records every step returns (`TokenInfo`).

They take the params and cache pytrees and return the new cache; the cache is donated so XLA
updates it in place. Statics are keyword-only (`cfg` is a frozen, hashable ModelConfig). The
paged engine's packed step is `runner.packed.paged_step`.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxgen.cache.contiguous import KVCache, StepMetadata
from jaxgen.engine.sample.sampling import SamplingArrays, sample, token_logprobs
from jaxgen.model.llama import Transformer
from jaxgen.sharding.pipeline import pipelined_apply

_STATICS = ("cfg", "attn_impl", "chunked", "all_logits", "pipeline")


def apply_model(
    cfg, params, tokens, positions, kv, md, logits_index=None, *, attn_impl=None, pipeline=None
):
    """The decoder, with its layers pipelined over the mesh's stages when `pipeline` is set."""
    if pipeline is not None:
        return pipelined_apply(
            cfg, pipeline, params, tokens, positions, kv, md, logits_index, attn_impl
        )
    return Transformer(cfg, attn_impl).apply(
        {"params": params}, tokens, positions, kv, md, logits_index
    )


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("kv",))
def prefill(
    params,
    tokens,
    lengths,
    kv: KVCache,
    *,
    cfg,
    attn_impl=None,
    chunked=False,
    all_logits=False,
    pipeline=None,
):
    """Runs right-padded prompts through the model and fills the cache.

    Args:
      tokens: i32[B, T] (T a bucket size; row b's valid tokens are tokens[b, :lengths[b]]).
      lengths: i32[B] valid tokens per row (0 for padding rows).
      kv: the cache; row b's new tokens go at positions kv.lengths[b] + i.
      chunked: static; False when every row's cache is empty (attention then runs over the new
        tokens only), True to continue rows that already hold tokens (chunked prefill).
      all_logits: static; return logits for every position (prompt logprobs, perplexity).
      pipeline: static `sharding.pipeline.PipelineSpec` to run the layers pipelined.
    Returns:
      (logits f32[B, V] at each row's last valid token -- or f32[B, T, V] with all_logits --,
       the updated cache).
    """
    md = StepMetadata(num_new=lengths.astype(jnp.int32), fresh=not chunked)
    logits_index = None if all_logits else jnp.maximum(lengths - 1, 0)[:, None]
    logits, kv = apply_model(
        cfg,
        params,
        tokens,
        kv.positions(tokens.shape[1]),
        kv,
        md,
        logits_index,
        attn_impl=attn_impl,
        pipeline=pipeline,
    )
    return (logits if all_logits else logits[:, 0]), kv


def decode_step(params, tokens, kv: KVCache, active, *, cfg, attn_impl=None, pipeline=None):
    """One decode step (unjitted body, shared with the fused multi-token loop)."""
    md = StepMetadata(num_new=active.astype(jnp.int32))
    logits, kv = apply_model(
        cfg,
        params,
        tokens[:, None],
        kv.positions(1),
        kv,
        md,
        attn_impl=attn_impl,
        pipeline=pipeline,
    )
    return logits[:, 0], kv


@functools.partial(
    jax.jit, static_argnames=("cfg", "attn_impl", "pipeline"), donate_argnames=("kv",)
)
def decode(params, tokens, kv: KVCache, active=None, *, cfg, attn_impl=None, pipeline=None):
    """Feeds one token per row and returns next-token logits.

    Args:
      tokens: i32[B] the last sampled token of each row.
      active: bool[B] or None; inactive rows neither write the cache nor advance.
    Returns:
      (logits f32[B, V], the updated cache).
    """
    if active is None:
        active = jnp.ones(tokens.shape, jnp.bool_)
    return decode_step(params, tokens, kv, active, cfg=cfg, attn_impl=attn_impl, pipeline=pipeline)


@struct.dataclass
class DecodeState:
    """Per-row generation state carried through the fused decode loop (all on device)."""

    tokens: jax.Array  # i32[B] last sampled token (fed at the next step)
    num_generated: jax.Array  # i32[B]
    max_tokens: jax.Array  # i32[B]
    min_tokens: jax.Array  # i32[B]
    stop_ids: jax.Array  # i32[B, E] EOS + stop_token_ids, padded with vocab_size (never a token)
    done: jax.Array  # bool[B]
    prompt_mask: jax.Array  # bool[B, V] tokens in the prompt (repetition penalty)
    output_counts: jax.Array  # i32[B, V] generated-token counts (penalties)

    @classmethod
    def create(
        cls, vocab_size, max_tokens, min_tokens=None, stop_ids=None, live=None, prompt_mask=None
    ) -> DecodeState:
        """State for a batch about to sample its first token (host arrays in, device out).

        Args:
          max_tokens, min_tokens: i32[B]; stop_ids: i32[B, E] padded with vocab_size;
          live: bool[B] rows in use (padding rows start done); prompt_mask: bool[B, V].
        """
        max_tokens = np.asarray(max_tokens, np.int32)
        batch = max_tokens.shape[0]
        if stop_ids is None:
            stop_ids = np.full((batch, 4), vocab_size, np.int32)
        return cls(
            tokens=jnp.zeros(batch, jnp.int32),
            num_generated=jnp.zeros(batch, jnp.int32),
            max_tokens=jnp.asarray(max_tokens),
            min_tokens=jnp.asarray(
                np.zeros(batch, np.int32) if min_tokens is None else min_tokens, jnp.int32
            ),
            stop_ids=jnp.asarray(stop_ids, jnp.int32),
            done=jnp.asarray(np.zeros(batch, bool) if live is None else ~np.asarray(live)),
            prompt_mask=jnp.asarray(
                np.zeros((batch, vocab_size), bool) if prompt_mask is None else prompt_mask
            ),
            output_counts=jnp.zeros((batch, vocab_size), jnp.int32),
        )


@struct.dataclass
class TokenInfo:
    """What one sampling step produced for each row."""

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B] raw log-probability of the token
    ranks: jax.Array  # i32[B]
    top_ids: jax.Array  # i32[B, n]
    top_logprobs: jax.Array  # f32[B, n]
    # A ragged step's tokens padded to max_num_seqs: the next step's pending decode rows read
    # theirs from it (`StepBatch.splice_source`) at one shape whatever this step's rows.
    padded: jax.Array | None = None


def block_stop_tokens(logits, stop_ids, blocked):
    """min_tokens: rows in `blocked` bool[B] cannot pick their stop ids i32[B, E] yet."""
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    stop_mask = jnp.zeros((batch, vocab), jnp.bool_).at[rows, stop_ids].set(True, mode="drop")
    return jnp.where(stop_mask & blocked[:, None], -jnp.inf, logits)


def _sample_step(logits, state: DecodeState, sa: SamplingArrays, num_logprobs: int):
    """Samples one token per live row and advances the state (rows already done stay put)."""
    batch = logits.shape[0]
    # Sampling reads whole vocabulary rows: gather vocab-parallel logits first (a no-op
    # without a mesh), which also keeps XLA's partitioner away from sharded scatters here.
    logits = nn.with_logical_constraint(logits, (None, None))
    blocked = state.num_generated < state.min_tokens
    token = sample(
        block_stop_tokens(logits, state.stop_ids, blocked),
        sa,
        state.prompt_mask,
        state.output_counts,
        state.num_generated,
    )
    live = ~state.done
    token = jnp.where(live, token, state.tokens)
    lp, rank, top_ids, top_lp = token_logprobs(logits, token, num_logprobs)
    num_generated = state.num_generated + live
    hit_stop = jnp.any(token[:, None] == state.stop_ids, axis=-1)
    state = state.replace(
        tokens=token,
        num_generated=num_generated,
        done=state.done | hit_stop | (num_generated >= state.max_tokens),
        output_counts=state.output_counts.at[jnp.arange(batch), token].add(live.astype(jnp.int32)),
    )
    return state, TokenInfo(token, lp, rank, top_ids, top_lp)


@functools.partial(jax.jit, static_argnames=("num_logprobs",), donate_argnames=("state",))
def sample_tokens(logits, state: DecodeState, sa: SamplingArrays, *, num_logprobs=0):
    """Samples each row's next token from `logits` f32[B, V] (e.g. prefill's last position)."""
    return _sample_step(logits, state, sa, num_logprobs)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "num_steps", "num_logprobs", "attn_impl", "pipeline"),
    donate_argnames=("kv", "state"),
)
def decode_loop(
    params,
    kv,
    state: DecodeState,
    sa: SamplingArrays,
    *,
    cfg,
    num_steps,
    num_logprobs=0,
    attn_impl=None,
    pipeline=None,
):
    """Up to `num_steps` decode + sample steps on device, stopping early once every row is done.

    Rows that finish stop writing the cache. Returns (TokenInfo with a leading step axis
    [num_steps, B, ...] -- tokens of rows not live at a step are -1 --, kv, state, steps run).
    """
    batch = state.tokens.shape[0]
    outs = TokenInfo(
        tokens=jnp.full((num_steps, batch), -1, jnp.int32),
        logprobs=jnp.zeros((num_steps, batch), jnp.float32),
        ranks=jnp.zeros((num_steps, batch), jnp.int32),
        top_ids=jnp.zeros((num_steps, batch, num_logprobs), jnp.int32),
        top_logprobs=jnp.zeros((num_steps, batch, num_logprobs), jnp.float32),
    )

    def cond(carry):
        i, _, state, _ = carry
        return (i < num_steps) & ~jnp.all(state.done)

    def body(carry):
        i, kv, state, outs = carry
        live = ~state.done
        logits, kv = decode_step(
            params, state.tokens, kv, live, cfg=cfg, attn_impl=attn_impl, pipeline=pipeline
        )
        state, info = _sample_step(logits, state, sa, num_logprobs)
        info = info.replace(tokens=jnp.where(live, info.tokens, -1))
        outs = jax.tree.map(lambda o, x: o.at[i].set(x), outs, info)
        return i + 1, kv, state, outs

    steps, kv, state, outs = jax.lax.while_loop(cond, body, (jnp.int32(0), kv, state, outs))
    return outs, kv, state, steps


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def prompt_token_logprobs(logits, tokens, *, num_logprobs):
    """Logprobs of each prompt token given its prefix: logits f32[B, T, V] -> TokenInfo [B, T-1]."""
    b, t, v = logits.shape
    lp, rank, top_ids, top_lp = token_logprobs(
        logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1), num_logprobs
    )
    return TokenInfo(
        tokens=tokens[:, 1:],
        logprobs=lp.reshape(b, t - 1),
        ranks=rank.reshape(b, t - 1),
        top_ids=top_ids.reshape(b, t - 1, -1),
        top_logprobs=top_lp.reshape(b, t - 1, -1),
    )
