"""On-device sampling: a pure function of (logits, per-row params as arrays, PRNG keys).

Order of operations (as vLLM): logit bias and penalties on the raw logits -> temperature ->
min-p -> top-k -> top-p (on the distribution renormalised after min-p and top-k) -> sample.
Greedy rows (temperature 0) take the argmax of the biased, penalised logits. Returned
log-probabilities are of the model's raw distribution (vLLM's default ``raw_logprobs``).

Every filter keeps a prefix of the tokens sorted by logit, so the kept set is "logit >= a
threshold". The threshold is found among the top `CANDIDATES` logits (a cheap `lax.top_k`);
only when a row's kept prefix may reach past that does the batch fall back to an exact
bisection over the whole vocabulary (a full sort costs ~8 ms per row on XLA:CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

CANDIDATES = 256


@struct.dataclass
class SamplingArrays:
    """Per-row sampling parameters, built on the host from SamplingParams."""

    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; 0 = disabled
    top_p: jax.Array  # f32[B]; 1 = disabled
    min_p: jax.Array  # f32[B]; 0 = disabled
    repetition_penalty: jax.Array  # f32[B]; 1 = disabled
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    keys: jax.Array  # u32[B, 2] raw threefry key per row (seed and sample index folded in)
    # logit_bias as [B, W] (token id, bias) pairs; ids >= 2**30 are padding. None: no row has one.
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    # Structured outputs: i32[B, ceil(V / 32)] token bitmask (bit v % 32 of word v // 32 set =
    # token v allowed; see `engine.sample.structured`). None: no row is constrained.
    allowed: jax.Array | None = None
    # bool[] a ragged step's: some row is constrained (its program always carries `allowed`,
    # applied only then). None: `allowed` applies whenever it is given.
    constrained: jax.Array | None = None

    @classmethod
    def build(cls, params_list, keys: np.ndarray, bias_width: int | None = None) -> SamplingArrays:
        """From a list of `engine.params.SamplingParams` (one per row; None = padding row).

        `bias_width`: logit-bias pairs per row (None: `logit_bias_width` of these rows)."""
        rows = [p for p in params_list]
        if bias_width is None:
            bias_width = logit_bias_width(rows)
        bias_ids = bias_values = None
        if bias_width:
            bias_ids = np.full((len(rows), bias_width), BIAS_PAD, np.int32)
            bias_values = np.zeros((len(rows), bias_width), np.float32)
            for r, p in enumerate(rows):
                if p is not None and p.logit_bias:
                    bias_ids[r, : len(p.logit_bias)] = list(p.logit_bias)
                    bias_values[r, : len(p.logit_bias)] = list(p.logit_bias.values())

        # Rows mostly share a few SamplingParams objects: one table row per distinct one.
        table, index, seen = [_PAD_ROW], np.zeros(len(rows), np.int64), {None: 0}
        for r, p in enumerate(rows):
            j = seen.get(id(p) if p is not None else None)
            if j is None:
                j = seen[id(p)] = len(table)
                table.append(_param_row(p))
            index[r] = j
        cols = np.asarray(table, np.float64)[index].T
        return cls(
            temperature=cols[0].astype(np.float32),
            top_k=cols[1].astype(np.int32),
            top_p=cols[2].astype(np.float32),
            min_p=cols[3].astype(np.float32),
            repetition_penalty=cols[4].astype(np.float32),
            presence_penalty=cols[5].astype(np.float32),
            frequency_penalty=cols[6].astype(np.float32),
            keys=np.asarray(keys, np.uint32),
            bias_ids=bias_ids,
            bias_values=bias_values,
        )


# (temperature, top_k, top_p, min_p, repetition, presence, frequency penalty) of a padding row.
_PAD_ROW = (0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0)


def _param_row(p) -> tuple:
    return (
        p.temperature,
        max(p.top_k, 0),
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    )


def uses_penalties(p) -> bool:
    """The `SamplingParams` ask for a repetition, presence or frequency penalty."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


BIAS_PAD = 2**30  # a padding logit-bias id: out of range, so its scatter is dropped


def logit_bias_width(params_list) -> int:
    """Logit-bias pairs per row for these rows: 0 when none has one, else a power of two >= 4
    (so the number of compiled shapes stays small)."""
    most = max(
        (len(p.logit_bias) for p in params_list if p is not None and p.logit_bias), default=0
    )
    return 0 if most == 0 else max(4, 1 << (most - 1).bit_length())


def row_key(seed: int, sample_index: int) -> np.ndarray:
    """u32[2] key data for one sequence: depends only on its seed and its index within the
    request (n > 1), never on the batch it runs in."""
    key = jax.random.fold_in(jax.random.key(seed % (2**32)), sample_index)
    key = jax.random.fold_in(key, seed >> 32)
    return np.asarray(jax.random.key_data(key), np.uint32)


def row_keys(seeds, sample_indices) -> np.ndarray:
    """u32[n, 2]: `row_key` of each (seed, sample index), derived in device calls of
    `KEYS_PER_CALL` rows each (one compiled program for any n)."""
    n = len(seeds)
    size = max(1, -(-n // KEYS_PER_CALL)) * KEYS_PER_CALL
    lo, hi, index = np.zeros((3, size), np.uint32)
    lo[:n] = [s % (2**32) for s in seeds]
    hi[:n] = [s >> 32 for s in seeds]
    index[:n] = sample_indices
    chunks = [
        np.asarray(_row_keys(*(a[i : i + KEYS_PER_CALL] for a in (lo, hi, index))))
        for i in range(0, size, KEYS_PER_CALL)
    ]
    return np.concatenate(chunks)[:n]


KEYS_PER_CALL = 64


@jax.jit
def _row_keys(lo, hi, index):
    def one(lo, hi, i):
        key = jax.random.fold_in(jax.random.key(lo), i)
        return jax.random.key_data(jax.random.fold_in(key, hi))

    return jax.vmap(one)(lo, hi, index).astype(jnp.uint32)


def allowed_tokens(bitmask, vocab_size: int):
    """bool[B, V] from a token bitmask i32[B, ceil(V / 32)] (llguidance's layout)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # arithmetic shift
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def apply_penalties(logits, sa: SamplingArrays, prompt_mask, output_counts):
    """Logit bias, the structured-output mask, then repetition (prompt + output), presence and
    frequency (output) penalties.

    `prompt_mask` and `output_counts` may be None when no row of the batch uses penalties."""
    if sa.bias_ids is not None:
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, sa.bias_ids].add(sa.bias_values, mode="drop")
    if sa.allowed is not None:

        def mask(x):
            return jnp.where(allowed_tokens(sa.allowed, x.shape[-1]), x, -jnp.inf)

        if sa.constrained is None:
            logits = mask(logits)
        else:
            logits = jax.lax.cond(sa.constrained, mask, lambda x: x, logits)
    if prompt_mask is None or output_counts is None:
        return logits

    def penalize(x):
        seen = prompt_mask | (output_counts > 0)
        rp = sa.repetition_penalty[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
        x = x - sa.frequency_penalty[:, None] * output_counts.astype(x.dtype)
        return x - sa.presence_penalty[:, None] * (output_counts > 0).astype(x.dtype)

    # A ragged step's program always takes the penalty arrays: a step without a penalized row
    # passes zeros and skips the pass over [B, V].
    penalized = (
        (sa.repetition_penalty != 1.0)
        | (sa.presence_penalty != 0.0)
        | (sa.frequency_penalty != 0.0)
    )
    return jax.lax.cond(jnp.any(penalized), penalize, lambda x: x, logits)


def _prefix_threshold(sorted_x, sa: SamplingArrays, total=None):
    """Threshold kept by min-p, top-k and top-p over descending-sorted scaled logits [B, C].

    Args:
      total: f32[B, 1] top-p normaliser (mass kept by min-p and top-k over the whole
        vocabulary, relative to the max token); None = the sum over these C columns.
    Returns:
      (threshold f32[B, 1], bool[B]: the kept prefix reaches the last column).
    """
    p = jnp.exp(sorted_x - sorted_x[:, :1])  # relative to the most likely token
    rank = jnp.arange(sorted_x.shape[-1])[None, :]
    keep = p >= sa.min_p[:, None]
    keep &= (sa.top_k[:, None] == 0) | (rank < sa.top_k[:, None])
    mass = jnp.where(keep, p, 0.0)
    if total is None:
        total = jnp.sum(mass, axis=-1, keepdims=True)
    # top_p = 1 keeps everything; f32 cumsum round-off must not cut the far tail.
    in_top_p = (jnp.cumsum(mass, axis=-1) - mass) < sa.top_p[:, None] * total
    keep &= in_top_p | (sa.top_p[:, None] >= 1.0)
    count = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(sorted_x, (count - 1)[:, None], axis=-1), keep[:, -1]


def argmax(x):
    """i32[B]: first index of each row's maximum. Two plain reductions: XLA:CPU's variadic
    argmax reduction is ~5x slower on [32, 49152]."""
    top = jnp.max(x, axis=-1, keepdims=True)
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == top, iota, x.shape[-1]), axis=-1)


def _ordered_key(x):
    """i32 keys with the order of the f32 values (bisection over keys is exact in 32 steps)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _smallest_kept_key(keys, weights, bound):
    """min t such that sum(weights[keys > t]) < bound, per row, by bisection on int keys.

    A token is kept iff the weight strictly above it is below `bound`; since that weight only
    decreases with the key, the kept set is exactly ``keys >= t``.
    Args: keys i32[B, V]; weights f32[B, V] (>= 0); bound f32[B, 1].
    """
    lo = jnp.min(keys, axis=-1, keepdims=True) - 1  # weight above lo = total (not below bound)
    hi = jnp.max(keys, axis=-1, keepdims=True)  # weight above hi = 0 < bound

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        below = jnp.sum(jnp.where(keys > mid, weights, 0.0), axis=-1, keepdims=True) < bound
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    _, hi = jax.lax.fori_loop(0, 33, body, (lo, hi))
    return hi


def _threshold_by_bisection(x, sa: SamplingArrays):
    """Exact min-p / top-k / top-p threshold over the whole vocabulary (no sort)."""
    keys = _ordered_key(x)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    keep = p >= sa.min_p[:, None]
    k = jnp.where(sa.top_k > 0, sa.top_k, x.shape[-1]).astype(jnp.float32)[:, None]
    keep &= keys >= _smallest_kept_key(keys, jnp.ones_like(x), k)
    mass = jnp.where(keep, p, 0.0)
    bound = sa.top_p[:, None] * jnp.sum(mass, axis=-1, keepdims=True)
    in_top_p = keys >= _smallest_kept_key(keys, mass, bound)
    keep &= in_top_p | (sa.top_p[:, None] >= 1.0)
    return jnp.min(jnp.where(keep, x, jnp.inf), axis=-1, keepdims=True)


def filter_threshold(x, sa: SamplingArrays):
    """f32[B, 1]: the smallest scaled logit that min-p, top-k and top-p keep."""
    vocab = x.shape[-1]
    num_cand = min(CANDIDATES, vocab)
    # The barrier keeps XLA from rewriting the top-k into a full sort of the vocabulary (it
    # does when only the values feed a gather: measured 191 ms against 5 ms at [24, 49152]
    # on XLA:CPU, 8x a whole decode step of the default model).
    cand = jax.lax.optimization_barrier(jax.lax.top_k(x, num_cand)[0])
    if num_cand == vocab:
        return _prefix_threshold(cand, sa)[0]
    # top-p needs the min-p / top-k mass over the whole vocabulary, computed without sorting.
    p_full = jnp.exp(x - cand[:, :1])
    in_min_p = p_full >= sa.min_p[:, None]
    kth = jnp.take_along_axis(cand, jnp.clip(sa.top_k - 1, 0, num_cand - 1)[:, None], axis=-1)
    top_k_known = sa.top_k <= num_cand
    in_top_k = (sa.top_k[:, None] == 0) | ~top_k_known[:, None] | (x >= kth)
    total = jnp.sum(jnp.where(in_min_p & in_top_k, p_full, 0.0), axis=-1, keepdims=True)
    threshold, reaches_end = _prefix_threshold(cand, sa, total)
    # Without top-p the kept set has a closed form: min-p and the k-th largest logit.
    min_p_threshold = jnp.where(sa.min_p > 0, jnp.log(sa.min_p), -jnp.inf)[:, None] + cand[:, :1]
    top_k_threshold = jnp.where((sa.top_k > 0)[:, None], kth, -jnp.inf)
    no_top_p = (sa.top_p >= 1.0)[:, None]
    threshold = jnp.where(no_top_p, jnp.maximum(min_p_threshold, top_k_threshold), threshold)
    # A top-k beyond the candidates that actually bites makes `total` and `kth` unknown here;
    # a top-p prefix reaching the last candidate may continue past it.
    top_k_bites = (sa.top_k > 0) & ~top_k_known & (jnp.sum(in_min_p, axis=-1) > sa.top_k)
    needs_bisection = jnp.any((reaches_end & ~no_top_p[:, 0]) | top_k_bites)
    return jax.lax.cond(needs_bisection, lambda: _threshold_by_bisection(x, sa), lambda: threshold)


def processed_logprobs(logits, sa: SamplingArrays, prompt_mask, output_counts):
    """f32[B, V]: log-probabilities the sampler draws from (filtered tokens get -inf).

    Greedy rows are returned as a point mass on their argmax.
    """
    penalised = apply_penalties(logits, sa, prompt_mask, output_counts)
    temp = jnp.where(sa.temperature > 0, sa.temperature, 1.0)[:, None]
    x = penalised / temp
    threshold = filter_threshold(x, sa)
    sampled = jax.nn.log_softmax(jnp.where(x >= threshold, x, -jnp.inf), axis=-1)
    greedy = jnp.where(
        jnp.arange(x.shape[-1])[None, :] == argmax(penalised)[:, None], 0.0, -jnp.inf
    )
    return jnp.where(sa.temperature[:, None] > 0, sampled, greedy)


def sample(logits, sa: SamplingArrays, prompt_mask, output_counts, step):
    """Draws one token per row.

    Args:
      logits: f32[B, V] raw model logits.
      prompt_mask: bool[B, V] tokens present in the prompt (repetition penalty).
      output_counts: i32[B, V] times each token was generated so far.
      step: i32[B] index of the token being generated (folded into the row's key, so a
        seeded row's draws do not depend on its batch).
    Returns:
      i32[B] sampled tokens.
    """
    penalised = apply_penalties(logits, sa, prompt_mask, output_counts)
    greedy_tokens = argmax(penalised)

    def draw(_):
        temp = jnp.where(sa.temperature > 0, sa.temperature, 1.0)[:, None]
        x = penalised / temp
        filtered = (sa.top_k > 0) | (sa.top_p < 1.0) | (sa.min_p > 0)
        x = jax.lax.cond(
            jnp.any(filtered & (sa.temperature > 0)),
            lambda: jnp.where(x >= filter_threshold(x, sa), x, -jnp.inf),
            lambda: x,  # no sampled row filters: every token stays
        )

        def gumbel(key_data, i):
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), i)
            return jax.random.gumbel(key, (x.shape[-1],), jnp.float32)

        noise = jax.vmap(gumbel)(sa.keys, step)
        drawn = argmax(x + noise)
        return jnp.where(sa.temperature > 0, drawn, greedy_tokens)

    return jax.lax.cond(jnp.any(sa.temperature > 0), draw, lambda _: greedy_tokens, None)


def token_logprobs(logits, tokens, num_top: int, allowed=None, wanted=None):
    """Raw log-probability and rank of `tokens` i32[B], plus the top `num_top` (static).

    `allowed`: structured outputs' token bitmask i32[B, ceil(V / 32)] or None; the top `num_top`
    are then the most likely tokens the grammar allows (their raw log-probabilities), so that
    beam search extends beams only with allowed tokens (vLLM lists allowed tokens too).
    `wanted`: bool[] or None; when given, the top `num_top` are computed only where it holds
    (zeros otherwise), so that a program carrying them costs a plain step nothing.
    Returns:
      (logprob f32[B], rank i32[B] (1 = most likely), top_ids i32[B, n], top_logprobs f32[B, n]).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logp > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    num_top = min(num_top, logits.shape[-1])
    batch = logits.shape[0]

    def top():
        ranked = logp
        if allowed is not None:
            ranked = jnp.where(allowed_tokens(allowed, logp.shape[-1]), logp, -jnp.inf)
        top_lp, top_ids = jax.lax.top_k(ranked, num_top)
        return top_lp, top_ids.astype(jnp.int32)

    def none():
        return jnp.zeros((batch, num_top), jnp.float32), jnp.zeros((batch, num_top), jnp.int32)

    if not num_top:
        top_lp, top_ids = none()
    elif wanted is None:
        top_lp, top_ids = top()
    else:
        top_lp, top_ids = jax.lax.cond(wanted, top, none)
    return chosen, rank, top_ids, top_lp
