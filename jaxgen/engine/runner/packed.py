"""The continuous-batching engine's device step: one packed step of a `ScheduledStep`.

`StepBatch` is what `runner.packer` builds on the host; `paged_step` runs it: the copy-on-write
page copies, one forward over every packed token (decode rows, speculative verify rows, prefill
chunks fresh or over cached context; on a ragged step one flat token axis), one sample per row
and the accept/reject of verify rows. `paged_logits` / `packed_outputs` are its two halves for
steps whose sampling waits for host work, `pipelined_paged_step` the same over a pipeline's
microbatches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxgen.cache.paged import FlatMetadata, PagedKVCache, RaggedMetadata
from jaxgen.engine.runner.steps import TokenInfo, block_stop_tokens
from jaxgen.engine.sample.sampling import SamplingArrays, sample, token_logprobs
from jaxgen.model.llama import Transformer
from jaxgen.model.lora import LoRABatch, LoRAWeights
from jaxgen.sharding.pipeline import lm_head, pipelined_ragged_layers


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
