"""Speculative decoding: a cheap drafter proposes k tokens, the target scores all k+1 positions
in one forward pass, and a rejection rule keeps the output distribution exactly the target's.

Drafters (one interface, `propose`):
  ngram   prompt lookup: the continuation of the latest earlier occurrence of the sequence's
          last n tokens (n = max..1) in its own prompt and output; no model.
  draft   a smaller model sharing the tokenizer, with its own paged KV cache.
  self    the target's first L layers and LM head (shares the target's weights).
  mtp     DeepSeek-V3's multi-token-prediction module (`spec_decode.mtp`; shares the weights).

Verification (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): with target distribution p
and draft distribution q at each drafted position i,
  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection j, emit a sample of normalize(max(p_j - q_j, 0)) and stop;
  if all k are accepted, emit a bonus sample of p_k.
Greedy rows accept the longest prefix equal to the target's argmax and emit the target's next
token. A deterministic drafter (n-gram) has q = one-hot(x_i): accept with probability p_i(x_i),
and on rejection sample p_j with x_j removed. Rejected positions are rolled back by truncating
the sequence's pages (no copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.engine.config import SpeculativeConfig
from jaxgen.engine.sample.sampling import (
    SamplingArrays,
    allowed_tokens,
    argmax,
    processed_logprobs,
    uses_penalties,
)


def ngram_propose(tokens: list[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Prompt lookup: up to k tokens following the latest earlier match of the last n tokens."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return list(follow)
    return []


def verify(logits, drafts, num_drafts, draft_logq, sa: SamplingArrays, step, allowed=None):
    """Accept/reject drafted tokens for each verify row (all on device).

    When every row is greedy, acceptance is a plain argmax comparison (`_verify_greedy`); the
    sampling path builds the processed distributions, which costs a third of a decode step on
    the CPU inside the step program. Arguments and results as in `_verify_sampled`, plus
    `allowed`: i32[B, k+1, ceil(V / 32)] structured outputs' token bitmask at each position (the
    grammar advanced by the drafts before it), or None. Acceptance and the next token then follow
    the constrained target distribution (a forbidden draft has p = 0: rejected, and the
    resample draws from max(p - q, 0) as Leviathan et al. prescribe); the emitted log-probabilities
    stay raw.
    """
    raw = logits
    if allowed is not None:
        batch, kp1, vocab = logits.shape
        ok = allowed_tokens(allowed.reshape(batch * kp1, -1), vocab).reshape(logits.shape)
        logits = jnp.where(ok, logits, -jnp.inf)
    return jax.lax.cond(
        jnp.any(sa.temperature > 0),
        lambda: _verify_sampled(logits, drafts, num_drafts, draft_logq, sa, step, raw),
        lambda: _verify_greedy(logits, drafts, num_drafts, raw),
    )


def _emitted_logprobs(logits, drafts, num_accepted, next_token):
    """Raw target log-probabilities of the emitted tokens: the accepted drafts, then the next."""
    batch = logits.shape[0]
    emitted = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    emitted = emitted.at[jnp.arange(batch), num_accepted].set(next_token)
    raw = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(raw, emitted[..., None], axis=-1)[..., 0]


def _verify_greedy(logits, drafts, num_drafts, raw):
    """Greedy rows: a draft is accepted while it equals the target's argmax (verify rows carry
    no penalties, so the argmax of the raw -- or grammar-masked -- logits is the greedy token);
    `raw`: the unmasked logits, for the emitted tokens' log-probabilities."""
    batch, kp1, vocab = logits.shape
    best = argmax(logits.reshape(-1, vocab)).reshape(batch, kp1)
    ok = (drafts == best[:, :-1]) & (jnp.arange(kp1 - 1)[None, :] < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    next_token = jnp.take_along_axis(best, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token, _emitted_logprobs(raw, drafts, num_accepted, next_token)


def _verify_sampled(logits, drafts, num_drafts, draft_logq, sa: SamplingArrays, step, raw):
    """Accept/reject drafted tokens for each verify row (all on device).

    Args:
      logits: f32[B, k+1, V] target logits at the row's last token and each draft.
      drafts: i32[B, k] drafted tokens (only the first num_drafts[b] are real).
      num_drafts: i32[B].
      draft_logq: f32[B, k, V] the drafter's log-probabilities, or None for a deterministic
        drafter (q = one-hot of the draft).
      sa: the rows' sampling parameters; step: i32[B] index of the first token generated now.
      raw: the logits before any grammar mask (for the emitted tokens' log-probabilities).
    Returns:
      (num_accepted i32[B], next_token i32[B], token_logprobs f32[B, k+1]: raw target
       log-probabilities of the emitted tokens in order).
    """
    batch, kp1, vocab = logits.shape
    k = kp1 - 1
    flat_sa = jax.tree.map(lambda a: jnp.repeat(a, kp1, axis=0), sa)
    no_penalty = (None, None)
    logp = processed_logprobs(logits.reshape(-1, vocab), flat_sa, *no_penalty).reshape(logits.shape)
    p = jnp.exp(logp)  # the target's (processed) distribution at each position
    positions = jnp.arange(k)
    is_draft = positions[None, :] < num_drafts[:, None]
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    greedy = sa.temperature <= 0
    if draft_logq is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.exp(jnp.take_along_axis(draft_logq, drafts[..., None], axis=-1)[..., 0])

    def uniform(key_data, s):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), 0x5EC)  # separate stream
        key = jax.random.fold_in(key, s)
        return jax.random.uniform(key, (kp1 + 1,))

    u = jax.vmap(uniform)(sa.keys, step)  # [B, k+2]
    # Leviathan et al. Alg. 1: accept x_i iff u_i < min(1, p(x_i) / q(x_i)).
    sampled_ok = u[:, :k] * q_draft < p_draft
    greedy_ok = drafts == argmax(logp[:, :k].reshape(-1, vocab)).reshape(batch, k)
    ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok) & is_draft
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    # The next token: at the first rejection, a sample of normalize(max(p - q, 0)); after all
    # drafts (or for greedy rows), a sample of p (argmax for greedy).
    j = num_accepted
    p_j = jnp.take_along_axis(p, j[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = j < num_drafts
    if draft_logq is None:
        q_j = jax.nn.one_hot(
            jnp.take_along_axis(drafts, jnp.minimum(j, k - 1)[:, None], 1)[:, 0], vocab
        )
    else:
        q_j = jnp.exp(
            jnp.take_along_axis(draft_logq, jnp.minimum(j, k - 1)[:, None, None], 1)[:, 0]
        )
    residual = jnp.maximum(p_j - q_j, 0.0)
    residual = residual / jnp.maximum(jnp.sum(residual, axis=-1, keepdims=True), 1e-30)
    target = jnp.where((rejected & ~greedy)[:, None], residual, p_j)

    def draw(key_data, s, probs):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), 0xB0)
        key = jax.random.fold_in(key, s)
        gumbel = jax.random.gumbel(key, (vocab,))
        return argmax(
            jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)) + gumbel, -jnp.inf)[None]
        )[0]

    sampled_next = jax.vmap(draw)(sa.keys, step + j, target)
    greedy_next = argmax(jnp.take_along_axis(logp, j[:, None, None], axis=1)[:, 0])
    next_token = jnp.where(greedy, greedy_next, sampled_next).astype(jnp.int32)
    num_accepted = num_accepted.astype(jnp.int32)
    return num_accepted, next_token, _emitted_logprobs(raw, drafts, num_accepted, next_token)


@dataclasses.dataclass
class SpecStats:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify rows processed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify row (accepted drafts + the target's token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_rows": self.steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted,
        }

    def add(self, step, verified) -> None:
        """Counts a landed step's verify rows (`verified`: its host verification)."""
        for v, row in enumerate(step.verify):
            self.drafted += len(row.draft)
            self.accepted += int(verified[0][v])
            self.steps += 1


def propose(spec: SpeculativeConfig, drafter, decoding) -> tuple[dict, object, object]:
    """Drafts for the decoding sequences' states `decoding` (n-gram on the host, or the draft
    model `drafter`): ({sequence id: drafts}, the draft model's log-probs and their rows, both
    None for n-gram drafts)."""
    # Rows whose plain sampling does more than the verifier reproduces (penalties, logit
    # bias, min_tokens blocking, logprob ranks) decode without drafts.
    states = [
        s
        for s in decoding
        if not uses_penalties(s.seq.params)
        and not s.seq.params.logit_bias
        and s.seq.params.logprobs is None
        and len(s.seq.output_ids) >= s.seq.params.min_tokens
    ]
    if not states:
        return {}, None, None
    if drafter is None:
        return ngram_batch(states, spec.num_tokens, spec), None, None
    sa = SamplingArrays.build([s.seq.params for s in states], np.stack([s.seq.key for s in states]))
    return drafter.propose(states, spec.num_tokens, sa)


def sync_drafter(drafter, running: dict) -> None:
    """After verification: the draft model's sequences rolled back to what the target
    accepted, and those of sequences no longer running released (`running`: id -> state)."""
    for sid in list(drafter.bm.tables):
        if sid not in running:
            drafter.release(sid)
        else:
            drafter.rollback(sid, len(running[sid].tokens) - 1)


def ngram_batch(states, k: int, cfg: SpeculativeConfig) -> dict:
    """Drafts for each decoding sequence state (by id)."""
    return {s.id: ngram_propose(s.tokens, k, cfg.ngram_max, cfg.ngram_min) for s in states}


def pad_drafts(drafts: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(drafts), k), np.int32)
    lens = np.zeros(len(drafts), np.int32)
    for i, d in enumerate(drafts):
        out[i, : len(d)] = d
        lens[i] = len(d)
    return out, lens


# ------------------------------------------------------------------------------------------------
# A model as the drafter ("draft": another model; "self": the target's first layers)
# ------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"), donate_argnames=("kv",))
def draft_step(
    params, kv, tokens, positions, md, logit_index, sa: SamplingArrays, step, *, cfg, attn_impl=None
):
    """One drafter forward over packed tokens; samples one token per row from the drafter's
    processed distribution q and returns (tokens i32[R], log q f32[R, V], kv)."""
    from jaxgen.model.llama import Transformer

    logits, kv = Transformer(cfg, attn_impl).apply(
        {"params": params}, tokens[None], positions[None], kv, md, logit_index[None]
    )
    logq = processed_logprobs(logits[0], sa, None, None)

    def draw(key_data, s, lq):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), 0xD5), s)
        return argmax((lq + jax.random.gumbel(key, lq.shape))[None])[0]

    token = jax.vmap(draw)(sa.keys, step, logq)
    greedy = argmax(logq)
    token = jnp.where(sa.temperature > 0, token, greedy).astype(jnp.int32)
    return token, logq, kv


def pack_draft_rows(bm, buckets, rows, sa: SamplingArrays, step, table_pages: int):
    """The drafters' packing of one forward: rows [(seq id, tokens to feed, first position)] as
    prefill rows of one token bucket each (row r's tokens start at r * width), the rows padded to
    a power of two, slots and page tables from the drafter's block manager `bm`.

    Returns (tokens i32[n], positions i32[n], RaggedMetadata, logit_index i32[b]: each row's
    last token, sa and step i32[b] padded by repeating the last row, width)."""
    from jaxgen.cache.paged import RaggedMetadata

    width = buckets.token_bucket(max(len(t) for _, t, _ in rows))
    b = 1 << max(len(rows) - 1, 0).bit_length()
    n = b * width
    tokens = np.zeros(n, np.int32)
    positions = np.zeros(n, np.int32)
    slots = np.full(n, -1, np.int32)
    tables = np.zeros((b, table_pages), np.int32)
    ctx = np.zeros(b, np.int32)
    new = np.zeros(b, np.int32)
    logit_index = np.zeros(b, np.int32)
    for r, (sid, feed, first) in enumerate(rows):
        base = r * width
        tokens[base : base + len(feed)] = feed
        positions[base : base + len(feed)] = np.arange(first, first + len(feed))
        slots[base : base + len(feed)] = bm.slots(sid, first, first + len(feed))
        tables[r, : len(bm.tables[sid])] = bm.tables[sid]
        ctx[r], new[r] = first, len(feed)
        logit_index[r] = base + len(feed) - 1
    md = RaggedMetadata(
        slot_mapping=slots,
        decode_tables=np.zeros((0, table_pages), np.int32),
        decode_seq_lens=np.zeros(0, np.int32),
        prefill_tables=tables,
        prefill_context=ctx,
        prefill_num_new=new,
        prefill_rows=b,
        prefill_len=width,
        prefill_fresh=bool((ctx == 0).all()),
    )
    pad = b - len(rows)
    sa = jax.tree.map(lambda a: np.concatenate([a, np.repeat(a[-1:], pad, 0)]) if pad else a, sa)
    step = np.concatenate([step, np.zeros(pad, np.int32)])
    return tokens, positions, md, logit_index, sa, step, width


class ModelDrafter:
    """A draft model with its own page pool and block manager, mirroring the target's sequences:
    it catches up on tokens it has not seen (one chunk), then drafts k tokens one at a time."""

    handoff = False  # whether the engine hands over its steps' hidden states (MTPDrafter)

    def __init__(self, cfg, params, dtype, page_size: int, num_pages: int, buckets, placement=None):
        from jaxgen.cache.block_manager import BlockManager
        from jaxgen.cache.paged import PagedKVCache

        self.cfg, self.params, self.buckets = cfg, params, buckets
        self.kv = PagedKVCache.init(cfg, num_pages, page_size, dtype)
        if placement is not None:
            self.kv = placement.cache(self.kv)
        self.placement = placement
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.computed: dict = {}  # seq id -> leading tokens with correct K/V in the draft pool

    def release(self, seq_id) -> None:
        if seq_id in self.bm.tables:
            self.bm.free(seq_id)
        self.computed.pop(seq_id, None)

    def _ensure(self, s) -> bool:
        """Reserves draft-pool slots for all of the sequence's tokens; False if out of pages."""
        if s.id not in self.bm.tables:
            if self.bm.allocate(s.id, s.tokens) is None:
                return False
            self.computed[s.id] = 0
            return True
        have = len(self.bm.tokens[s.id])
        for token in s.tokens[have:]:
            if self.bm.append(s.id, token) is None:
                self.release(s.id)
                return False
        return True

    def _run(self, rows, sa, step, table_pages):
        """rows: [(seq id, tokens to feed, first position)] -> (tokens [R], logq [R, V])."""
        tokens, positions, md, logit_index, sa, step, _ = pack_draft_rows(
            self.bm, self.buckets, rows, sa, step, table_pages
        )
        with self.placement.context() if self.placement else contextlib.nullcontext():
            token, logq, self.kv = draft_step(
                self.params, self.kv, tokens, positions, md, logit_index, sa, step, cfg=self.cfg
            )
        return token[: len(rows)], logq[: len(rows)]

    def propose(self, states, k: int, sa: SamplingArrays):
        """Drafts k tokens for each sequence (rows of `sa` in the same order).

        Returns:
          ({seq id: [k tokens]}, f32[len(states), k, V] log q, {seq id: row}).
        """
        live = [i for i, s in enumerate(states) if self._ensure(s)]
        if not live:
            return {}, None, {}
        states = [states[i] for i in live]
        sa = jax.tree.map(lambda a: np.asarray(a)[live], sa)
        drafted = {s.id: [] for s in states}
        logqs = []
        for i in range(k):
            rows = []
            for s in states:
                if i == 0:
                    start = self.computed[s.id]
                    feed = s.tokens[start:]
                else:
                    start = len(s.tokens) + i - 1
                    feed = [drafted[s.id][-1]]
                    if self.bm.append(s.id, feed[0]) is None:
                        return self._finish(states, drafted, logqs, live)
                rows.append((s.id, feed, start))
            pages = 1 << max(max(len(self.bm.tables[s.id]) for s in states) - 1, 0).bit_length()
            step = np.asarray([len(s.seq.output_ids) + i for s in states], np.int32)
            token, logq = self._run(rows, sa, step, max(pages, 8))
            for s, t in zip(states, np.asarray(token).tolist(), strict=True):
                drafted[s.id].append(int(t))
            logqs.append(logq)
        return self._finish(states, drafted, logqs, live)

    def _finish(self, states, drafted, logqs, live):
        k = len(logqs)
        for s in states:  # K/V now cover the tokens and drafts fed (all but the last draft)
            self.computed[s.id] = len(s.tokens) + max(k - 1, 0)
            drafted[s.id] = drafted[s.id][:k]
        logq = jnp.stack(logqs, axis=1) if logqs else None
        return drafted, logq, {s.id: r for r, s in enumerate(states)}

    def rollback(self, seq_id, correct: int) -> None:
        """After verification: only the first `correct` tokens' K/V are right."""
        if seq_id in self.bm.tables:
            keep = min(self.computed.get(seq_id, 0), correct)
            self.bm.truncate(seq_id, keep)
            self.computed[seq_id] = keep
