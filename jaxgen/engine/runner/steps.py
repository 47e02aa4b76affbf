"""The two jitted device steps over the contiguous cache: `prefill` and `decode`.

Both take the params and cache pytrees and return the new cache; the cache is donated so XLA
updates it in place. Statics are keyword-only (`cfg` is a frozen, hashable ModelConfig).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxgen.cache.contiguous import KVCache, StepMetadata
from jaxgen.cache.paged import FlatMetadata, PagedKVCache, RaggedMetadata
from jaxgen.engine.sample.sampling import SamplingArrays, sample, token_logprobs
from jaxgen.model.llama import Transformer
from jaxgen.model.lora import LoRABatch, LoRAWeights
from jaxgen.sharding.pipeline import lm_head, pipelined_apply, pipelined_ragged_layers

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


@struct.dataclass
class StepBatch:
    """One packed step of the continuous-batching engine (built on the host by the scheduler).

    N = packed tokens, R = rows that produce logits (decode rows, prefill rows, and extra
    sampling rows of n > 1 siblings that share a prefill row's last position), C = page copies.
    """

    tokens: jax.Array  # i32[N]
    positions: jax.Array  # i32[N]
    md: RaggedMetadata | FlatMetadata
    copy_src: jax.Array  # i32[C] copy-on-write page copies done before the step's writes
    copy_dst: jax.Array  # i32[C]
    logit_index: jax.Array  # i32[R] packed token whose logits row r samples from
    row_step: jax.Array  # i32[R] index of the token being generated (folded into the key)
    block_stop: jax.Array  # bool[R] min_tokens not reached
    stop_ids: jax.Array  # i32[R, E] padded with vocab_size
    prompt_mask: jax.Array | None  # bool[R, V] (None when no row uses penalties)
    output_counts: jax.Array | None  # i32[R, V]
    # Prompt logprobs: the token following each packed token (None when no row asks).
    next_tokens: jax.Array | None = None  # i32[N]
    # Speculative verification (None without verify rows).
    verify_drafts: jax.Array | None = None  # i32[Bv, k]
    verify_num_drafts: jax.Array | None = None  # i32[Bv]
    verify_step: jax.Array | None = None  # i32[Bv] index of the first token generated now
    verify_sa: SamplingArrays | None = None  # [Bv]
    verify_logq: jax.Array | None = None  # f32[Bv, k, V] drafter log-probs (None: n-gram)
    # Structured outputs: i32[Bv, k+1, ceil(V / 32)] token bitmask per verify position (None:
    # no verify row is constrained). Set by the engine after the forward is dispatched.
    verify_allowed: jax.Array | None = None
    # Multi-LoRA: i32[N] each packed token's slot in the engine's adapter stack, -1 for the base
    # model and padding (None: the engine runs without LoRA).
    lora_ids: jax.Array | None = None
    # A ragged step's decode rows whose input token is still on the device: token i is
    # `prev_tokens[splice_source[i]]` where `splice_source[i] >= 0` (`prev_tokens`: the step in
    # flight's `TokenInfo.padded`, i32[max_num_seqs]). None on `StepShape` steps (`splice_tokens`).
    splice_source: jax.Array | None = None
    prev_tokens: jax.Array | None = None
    # A ragged step: bool[] some row asks for top logprobs (computed only then, under a cond,
    # for the program's fixed `num_logprobs`). None: always computed (`StepShape` buckets them).
    want_top: jax.Array | None = None


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "num_logprobs", "prompt_logprobs", "attn_impl", "return_hidden"),
    donate_argnames=("kv",),
)
def paged_step(
    params,
    kv: PagedKVCache,
    batch: StepBatch,
    sa: SamplingArrays,
    lora: LoRAWeights | None = None,
    *,
    cfg,
    num_logprobs=0,
    prompt_logprobs=0,
    attn_impl=None,
    return_hidden=False,
):
    """Copy-on-write copies, one forward over the packed tokens, one sample per row, and the
    accept/reject of speculative verify rows.

    Args:
      lora: the engine's adapter stack (an argument, so writing a slot compiles nothing), each
        token's slot in `batch.lora_ids`; None without LoRA.
      prompt_logprobs: static; > 0 also scores `batch.next_tokens` at every packed position
        (top-n of that size), for requests asking for prompt logprobs.
      return_hidden: static; also return every packed token's last hidden state (after the final
        norm, [N, D], left on the device) for the MTP drafter (`spec_decode.mtp`).
    Returns:
      (TokenInfo [R], TokenInfo [N] of prompt logprobs or None, verify results
       (num_accepted, next_token, token_logprobs) or None, the updated page pool), then the
      hidden states with return_hidden.
    """
    logits, kv, hidden = _packed_forward(
        params, kv, batch, lora, cfg, prompt_logprobs, attn_impl, return_hidden
    )
    outputs = (*_packed_outputs(logits, batch, sa, num_logprobs, prompt_logprobs), kv)
    return (*outputs, hidden) if return_hidden else outputs


def _packed_forward(
    params, kv, batch: StepBatch, lora, cfg, prompt_logprobs, attn_impl, return_hidden=False
):
    """Copy-on-write copies and one forward: (logits f32[R', V] -- every packed token's with
    prompt logprobs, else each logit_index row's --, the updated pool, hidden [N, D] with
    return_hidden else None)."""
    if batch.copy_src.shape[0]:  # a ragged step's copies ran before it (`copy_pages`)
        kv = kv.copy_pages(batch.copy_src, batch.copy_dst)
    logits_index = None if prompt_logprobs else batch.logit_index[None]
    if lora is not None:
        lora = LoRABatch(lora, batch.lora_ids[None])
    tokens = batch.tokens
    if batch.splice_source is not None:
        source = batch.splice_source
        tokens = jnp.where(source >= 0, batch.prev_tokens[jnp.maximum(source, 0)], tokens)
    out = Transformer(cfg, attn_impl).apply(
        {"params": params},
        tokens[None],
        batch.positions[None],
        kv,
        batch.md,
        logits_index,
        lora=lora,
        return_hidden=return_hidden,
    )
    hidden = out[2][0] if return_hidden else None
    return out[0][0], out[1], hidden


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "prompt_logprobs", "attn_impl"),
    donate_argnames=("kv",),
)
def paged_logits(
    params,
    kv: PagedKVCache,
    batch: StepBatch,
    lora: LoRAWeights | None = None,
    *,
    cfg,
    prompt_logprobs=0,
    attn_impl=None,
):
    """The first half of `paged_step`, for steps whose sampling waits for host work (structured
    outputs' masks, computed while this runs): (logits, the updated page pool)."""
    return _packed_forward(params, kv, batch, lora, cfg, prompt_logprobs, attn_impl)[:2]


@functools.partial(jax.jit, static_argnames=("num_logprobs", "prompt_logprobs"))
def packed_outputs(
    logits, batch: StepBatch, sa: SamplingArrays, *, num_logprobs=0, prompt_logprobs=0
):
    """The second half of `paged_step`: (TokenInfo [R], prompt TokenInfo or None, verify
    results or None) from `paged_logits`' logits."""
    return _packed_outputs(logits, batch, sa, num_logprobs, prompt_logprobs)


@functools.partial(jax.jit, donate_argnames=("kv",))
def copy_pages(kv, src, dst):
    """Copy-on-write page copies src[i] -> dst[i] before a ragged step (whose program then
    does not depend on how many a step has: their count is padded to a power of two, the
    padding repeating the last copy)."""
    return kv.copy_pages(src, dst)


@jax.jit
def splice_tokens(tokens, source, sampled):
    """The packed tokens with `tokens[i] = sampled[source[i]]` wherever `source[i] >= 0`: the
    overlapped engine loop decodes a token the previous step sampled without reading it back
    first (it stays on the device)."""
    return jnp.where(source >= 0, sampled[jnp.maximum(source, 0)], tokens)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "pipeline", "num_logprobs", "prompt_logprobs", "attn_impl"),
    donate_argnames=("kv",),
)
def pipelined_paged_step(
    params,
    kv: PagedKVCache,
    batch: StepBatch,
    sa: SamplingArrays,
    *,
    cfg,
    pipeline,
    num_logprobs=0,
    prompt_logprobs=0,
    attn_impl=None,
):
    """`paged_step` over M packed microbatches (a leading axis on every array of `batch` and
    `sa`, one packed step of disjoint sequences each), with the layers pipelined over the mesh's
    stages (`sharding.pipeline.pipelined_ragged_layers`). Speculative verify rows are not
    supported here. Returns what `paged_step` does, with a leading M axis on the outputs."""
    kv = kv.copy_pages(batch.copy_src.reshape(-1), batch.copy_dst.reshape(-1))
    xs = jnp.take(params["embed"], batch.tokens, axis=0)[:, None]
    hidden, kv = pipelined_ragged_layers(
        cfg, pipeline, params["layers"], xs, batch.positions, kv, batch.md, attn_impl
    )

    def finish(h, b, s):
        logits_index = None if prompt_logprobs else b.logit_index[None]
        logits = lm_head(cfg, params, h, logits_index)[0]
        info, prompt_info, _ = _packed_outputs(logits, b, s, num_logprobs, prompt_logprobs)
        return info, prompt_info

    info, prompt_info = jax.vmap(finish)(hidden, batch, sa)
    return info, prompt_info, None, kv


def _packed_outputs(logits, batch: StepBatch, sa: SamplingArrays, num_logprobs, prompt_logprobs):
    """From a packed step's logits: prompt logprobs, speculative verification and one sampled
    token per row (see `paged_step`)."""
    from jaxgen.engine.spec_decode.speculative import verify

    prompt_info = None
    if prompt_logprobs:
        prompt_info = TokenInfo(
            batch.next_tokens, *token_logprobs(logits, batch.next_tokens, prompt_logprobs)
        )
        logits = logits[batch.logit_index]
    num_rows = batch.row_step.shape[0]
    verified = None
    if batch.verify_drafts is not None:
        verify_rows, k = batch.verify_drafts.shape
        vlogits = logits[num_rows:].reshape(verify_rows, k + 1, -1)
        verified = verify(
            vlogits,
            batch.verify_drafts,
            batch.verify_num_drafts,
            batch.verify_logq,
            batch.verify_sa,
            batch.verify_step,
            batch.verify_allowed,
        )
    logits = logits[:num_rows]
    token = sample(
        block_stop_tokens(logits, batch.stop_ids, batch.block_stop),
        sa,
        batch.prompt_mask,
        batch.output_counts,
        batch.row_step,
    )
    lp, rank, top_ids, top_lp = token_logprobs(
        logits, token, num_logprobs, sa.allowed, batch.want_top
    )
    padded = None
    if batch.prev_tokens is not None:
        padded = jnp.zeros_like(batch.prev_tokens).at[: token.shape[0]].set(token)
    return TokenInfo(token, lp, rank, top_ids, top_lp, padded), prompt_info, verified
