"""A latency model of one serving instance, and its least-squares fit to measured steps.

Functional forms (documented in docs/disaggregation.md, section disagg-sim):

  prefill step  = a + b * sum(L_i) + c * sum(L_i^2)        L_i: prompt tokens of row i
  decode step   = a + b * batch + c * sum(context_i)       context_i: KV tokens row i reads
  KV transfer   = a + bytes / bandwidth

The quadratic prefill term is causal attention (a prompt of L tokens scores ~L^2/2 pairs); a
chunk of c tokens after p cached ones costs c * (2p + c), so the chunks of one prompt sum to L^2.
The decode context term is the KV bytes a step reads (roofline.step_cost's bytes).

With a `Padding` (an engine that runs each step at one of its compiled shapes, as jaxgen's
does), the terms count what the program computes rather than the rows it holds: prefill rows
padded to a power of two, each row to the token bucket of the step's longest chunk, attention
over that bucket (a fresh step) or the padded page table (a step with cached context), and
decode rows padded to a batch bucket. Where the step's program is known (`Padding.program`:
a step the simulator plans, or a logged step's `shape`), the decode context term counts the KV
the program reads (`Padding.decode_read`: its page blocks, or its rows' padded tables) rather
than the rows' own tokens: a step on a larger program that covers it reads the larger one's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxgen.errors import JaxgenError


class PlanningError(JaxgenError):
    """A latency model, trace, SLO or search bound is out of range."""


@dataclasses.dataclass(frozen=True)
class Fit:
    """Least-squares coefficients of one functional form and how well they explain the data."""

    coef: tuple[float, ...]
    names: tuple[str, ...]
    rel_rms: float  # sqrt(mean(((pred - y) / y)^2)) over the samples
    rel_max: float  # max |pred - y| / y
    num_samples: int

    def to_dict(self) -> dict:
        return dict(
            coef=dict(zip(self.names, self.coef, strict=True)),
            rel_rms=self.rel_rms,
            rel_max=self.rel_max,
            num_samples=self.num_samples,
        )


def fit_least_squares(
    features: Sequence[Sequence[float]], seconds: Sequence[float], names: Sequence[str]
) -> Fit:
    """Fits seconds ~ features @ coef, weighting each sample by 1/seconds (relative error, so
    a 2 ms step counts as much as a 2 s one); coefficients are clipped at 0 (a negative cost
    term would predict negative times outside the profiled range)."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(names) or len(y) != len(x):
        raise PlanningError(f"features {x.shape} and {len(y)} times for {len(names)} terms")
    if len(y) < len(names):
        raise PlanningError(f"{len(y)} samples cannot fit {len(names)} coefficients")
    if (y <= 0).any():
        raise PlanningError("measured times must be > 0")
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    if (coef < 0).any():  # refit without the negative terms (non-negative least squares, one pass)
        keep = coef > 0
        coef = np.zeros_like(coef)
        if keep.any():
            coef[keep], *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        coef = np.maximum(coef, 0.0)
    rel = (x @ coef - y) / y
    return Fit(
        coef=tuple(float(c) for c in coef),
        names=tuple(names),
        rel_rms=float(np.sqrt(np.mean(rel**2))),
        rel_max=float(np.max(np.abs(rel))),
        num_samples=len(y),
    )


def fit_prefill(samples: Sequence[tuple[Sequence[int], float]]) -> Fit:
    """samples: (prompt lengths of one prefill step, seconds)."""
    feats = [(1.0, sum(lens), sum(n * n for n in lens)) for lens, _ in samples]
    return fit_least_squares(feats, [s for _, s in samples], ("a", "b_per_token", "c_per_token2"))


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> Fit:
    """samples: (batch, summed context tokens, seconds) of decode-only steps."""
    feats = [(1.0, b, ctx) for b, ctx, _ in samples]
    return fit_least_squares(
        feats, [s for *_, s in samples], ("a", "b_per_seq", "c_per_context_token")
    )


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise PlanningError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _pow2(n: int, minimum: int = 1) -> int:
    """The packer's rounding (`engine.runner.shapes.pow2`; that module imports JAX, this one
    must not)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


BLOCK_PAGES = 4  # pages per decode page block (`pallas_kernels.page_blocks.BLOCK_PAGES`)


def _block_bucket(n: int, minimum: int = 8) -> int:
    """Page-block counts padded to 8, 12, 16, 24, 32, ... (`engine.runner.packer`)."""
    p = _pow2(n, minimum)
    return p * 3 // 4 if n <= p * 3 // 4 and p * 3 // 4 >= minimum else p


Q_BLOCK = 128  # the XLA attention's query block (`pallas_kernels.flash_attention.Q_BLOCK`)


def reference_pairs(num_q: int, num_k: int, from_start: bool) -> int:
    """(query, key) pairs one row's attention computes (`pallas_kernels.flash_attention.
    reference_pairs`, which imports JAX): a fresh row (`from_start`) in query blocks that stop
    at their last query; a row with cached context over all its keys."""
    if not from_start:
        return num_q * num_k
    return sum((min(s + Q_BLOCK, num_q) - s) * min(num_k, s + Q_BLOCK)
               for s in range(0, num_q, Q_BLOCK))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Padding:
    """The shapes an engine pads its steps to (jaxgen's `engine.runner.packer.StepPacker`):
    decode rows to a batch bucket; prefill rows to a power of two, each as long as the token
    bucket of the step's longest chunk; the prefill rows' page tables to a power of two pages,
    at least `min_pages`, over the pages up to each chunk's end. That width is a lower bound of
    jaxgen's: a sequence holds its whole prompt's pages from admission, and decode rows sent as
    tables (not page blocks) widen the tables too. `shape` gives a step's padded sizes."""

    token_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...]
    page_size: int
    min_pages: int = 8

    def __post_init__(self):
        for name in ("token_buckets", "batch_buckets"):
            b = getattr(self, name)
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise PlanningError(f"{name}={b}: give increasing positive sizes")
        if self.page_size < 1 or self.min_pages < 1:
            raise PlanningError(f"{self.page_size=} and {self.min_pages=} must be >= 1")

    def token_bucket(self, n: int) -> int:
        """The padded length of a prefill row of `n` tokens."""
        return _bucket(n, self.token_buckets)

    def shape(self, chunks: Sequence[tuple[int, int]], batch: int) -> dict:
        """The padded step of these prefill chunks ((tokens, cached before)) and decode rows,
        in the step log's names (`metrics.step_record`): num_decode, prefill_rows, prefill_len,
        max_pages (the prefill rows' table width; 0 without prefill rows)."""
        out = dict(num_decode=_bucket(batch, self.batch_buckets) if batch else 0,
                   prefill_rows=0, prefill_len=0, max_pages=0)  # fmt: skip
        if chunks:
            pages = max(-(-(n + p) // self.page_size) for n, p in chunks)
            out.update(
                prefill_rows=_pow2(len(chunks)),
                prefill_len=self.token_bucket(max(n for n, _ in chunks)),
                max_pages=_pow2(pages, self.min_pages),
            )
        return out

    def program(
        self, chunks: Sequence[tuple[int, int]], prompts: Sequence[int], decode_lens: Sequence[int]
    ) -> tuple[int, int, int, int, int, bool, int]:
        """The program the engine compiles for this step, keyed as its step log's `shape`
        (num_decode, prefill_rows, prefill_len, max_pages, decode_blocks, prefill_fresh: no
        prefill row has cached context, a program of its own; num_rows: the rows it samples,
        bucketed): what decides whether a step compiles. `chunks`: (tokens, cached before)
        per prefill row; `prompts`: those rows' prompt lengths (a row's page table holds its
        whole prompt from admission); `decode_lens`: each decode row's tokens once this step's
        is written. `StepPacker.shape`'s rule: tables as wide as the widest row's, a power of
        two of at least `min_pages`; the decode rows read page blocks instead (bucketed) when
        those cover at most 3/4 of the pages their tables would, and the tables are then the
        prefill rows' alone."""
        pages = [-(-n // self.page_size) for n in prompts]
        decode_pages = [-(-n // self.page_size) for n in decode_lens]
        num_decode = _bucket(len(decode_lens), self.batch_buckets) if decode_lens else 0
        max_pages = _pow2(max(pages + decode_pages + [1]), self.min_pages)
        blocks = 0
        if decode_lens:
            per_block = self.page_size * BLOCK_PAGES
            need = _block_bucket(sum(-(-n // per_block) for n in decode_lens))
            if 4 * need * BLOCK_PAGES <= 3 * num_decode * max_pages:
                blocks = need
                max_pages = _pow2(max(pages + [1]), self.min_pages)
        s = self.shape(chunks, len(decode_lens))
        return (num_decode, s["prefill_rows"], s["prefill_len"], max_pages, blocks,
                _fresh(chunks), self.num_rows(len(decode_lens), len(chunks)))  # fmt: skip

    def num_rows(self, decode_rows: int, prefill_rows: int) -> int:
        """The rows a step samples, bucketed (the engine's `StepShape.num_rows`)."""
        return _bucket(max(decode_rows + prefill_rows, 1), self.batch_buckets)

    def program_features(self, key: tuple) -> tuple:
        """`features` of a step run by program `key` (`program`'s tuple), which may be larger
        than the step's own (a covering program: its padding is computed too). The decode
        term is the KV the program reads (`decode_read`)."""
        num_decode, rows, length, max_pages, _, fresh = key[:6]
        return (rows * length, rows * self.row_pairs(length, max_pages, fresh), num_decode,
                self.decode_read(key))  # fmt: skip

    def decode_read(self, key: tuple) -> int:
        """KV tokens the decode rows of program `key` read: its page blocks (`BLOCK_PAGES`
        pages each), or every padded row's page table. The padding is read too (the gathered
        pages are masked, not skipped): a step run on a covering program with 4x the blocks
        of its own took 0.105 s where its own program's 0.09 s (2026-12-05 19:05 run)."""
        num_decode, _, _, max_pages, blocks = key[:5]
        pages = blocks * BLOCK_PAGES if blocks else num_decode * max_pages
        return pages * self.page_size if num_decode else 0

    def key_of(self, shape: dict, chunks: Sequence[tuple[int, int]] = (),
               decode_rows: int = 0) -> tuple:  # fmt: skip
        """A step log's `shape` as `program`'s tuple; in a log written before the engine
        logged `prefill_fresh` and `num_rows`, the step's own `chunks` and `decode_rows`
        decide them."""
        names = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "decode_blocks")
        fresh = shape.get("prefill_fresh", _fresh(chunks))
        rows = shape.get("num_rows")
        if rows is None:
            rows = self.num_rows(decode_rows, len(chunks))
        return (*(int(shape[k]) for k in names), bool(fresh), int(rows))

    def row_pairs(self, length: int, max_pages: int, fresh: bool) -> int:
        """KV token pairs one padded prefill row attends: a fresh row its own tokens
        (causal, in query blocks); a row with cached context its table's pages and then its
        own tokens (`paged_prefill`)."""
        if fresh:
            return reference_pairs(length, length, True)
        return reference_pairs(length, max_pages * self.page_size + length, False)

    def cached_pairs(self, key: tuple) -> int:
        """The KV token pairs of program `key`'s prefill rows when they read cached context
        (`paged_prefill`, over their page tables; `LatencyModel.cached_pair` prices them beyond
        the pairs of fresh rows); 0 for a fresh or decode-only program."""
        _, rows, length, max_pages, _, fresh = key[:6]
        return 0 if fresh or not rows else rows * self.row_pairs(length, max_pages, False)

    def work(self, key: tuple) -> tuple[int, int]:
        """(tokens computed, KV token pairs attended) by program `key`: jaxgen's
        `StepShape.work`, on the step log's keys."""
        num_decode, rows, length, max_pages, blocks, fresh = key[:6]
        pages = blocks * BLOCK_PAGES if blocks else max_pages
        pairs = num_decode * pages * self.page_size
        return num_decode + rows * length, pairs + rows * self.row_pairs(length, max_pages, fresh)

    def covers(self, key: tuple, other: tuple, factor: float) -> bool:
        """Whether program `key` can run a step of program `other` within `factor` x its
        work (jaxgen's `StepShape.covers`, `EngineConfig.cover_new_shapes`): every size at
        least as large, decode rows reading page blocks where they would at their own and
        tables or enough page blocks where they would read tables, prefill rows with cached
        context on a program that reads it (one that does runs fresh rows too, its work as it
        computes them)."""
        sizes = (0, 1, 2, 3, 4, 6)  # all but prefill_fresh
        if any(key[i] < other[i] for i in sizes):
            return False
        if key[5] and not other[5]:
            return False
        if other[0] and (key[4] == 0) != (other[4] == 0):
            widest = -(-other[3] // BLOCK_PAGES)  # blocks a table-reading row may need
            if not key[4] or key[4] < other[0] * widest:
                return False
        mine, theirs = self.work(key), self.work(other)
        return all(m <= factor * max(t, 1) for m, t in zip(mine, theirs, strict=True))

    def features(self, chunks: Sequence[tuple[int, int]], batch: int, context: int) -> tuple:
        """(prefill tokens, prefill attention pairs, decode rows, decode context) computed:
        the padded rows; a step with cached context attends over its padded page tables."""
        if not chunks and not batch:
            return (0, 0, 0, context)
        s = self.shape(chunks, batch)
        pairs = s["prefill_rows"] * self.row_pairs(s["prefill_len"], s["max_pages"], _fresh(chunks))
        return (s["prefill_rows"] * s["prefill_len"], pairs, s["num_decode"], context)


def _fresh(chunks: Sequence[tuple[int, int]]) -> bool:
    """No prefill chunk has cached context (the engine's `StepShape.prefill_fresh`)."""
    return all(p == 0 for _, p in chunks)


def step_features(chunks, batch: int, context: int, padding: Padding | None = None) -> tuple:
    """(prefill tokens, prefill attention term, decode rows, decode context) of one step: the
    rows as they are, or as `padding` pads them."""
    if padding is not None:
        return padding.features(chunks, batch, context)
    return (
        sum(n for n, _ in chunks),
        sum(n * (2 * p + n) for n, p in chunks),
        batch,
        context,
    )


def record_features(record: dict, padding: Padding | None = None) -> tuple:
    """`step_features` of a logged step: with `padding` and the program it ran (its `shape`),
    that program's (`Padding.program_features`)."""
    if padding is not None and record.get("shape"):
        key = padding.key_of(record["shape"], record["chunks"], record["decode_rows"])
        return padding.program_features(key)
    return step_features(record["chunks"], record["decode_rows"], record["decode_context"],
                         padding)  # fmt: skip


def record_cached_pairs(record: dict, padding: Padding) -> int:
    """The pairs of a logged step's prefill rows with cached context, as `padding` pads them
    (`Padding.cached_pairs` of the program it ran; of its own padded rows without a
    `shape`)."""
    if record.get("shape"):
        key = padding.key_of(record["shape"], record["chunks"], record["decode_rows"])
        return padding.cached_pairs(key)
    chunks = record["chunks"]
    return 0 if _fresh(chunks) else padding.features(chunks, record["decode_rows"], 0)[1]


STEP_TERMS = ("a", "b_per_token", "c_per_token2", "b_per_seq", "c_per_context_token")


def fit_steps(records: Sequence[dict], padding: Padding | None = None,
              cached: bool = False) -> Fit:  # fmt: skip
    """Steps of any mix, as an engine logs them (`serve --step-log`: "chunks" [(tokens,
    cached before them)], "decode_rows", "decode_context", "seconds", and the program's
    "shape"), fitted jointly to `LatencyModel.mixed_seconds`' form with one fixed cost: a + b_p
    sum(n) + c_p sum(n (2p + n)) + b_d batch + c_d context (with `padding`: its padded terms,
    `record_features`). `cached` (with `padding`): one more term, c_cached_pair x the pairs of
    prefill rows with cached context (`record_cached_pairs`), which read their page tables
    (XLA:CPU ran a 512-token row over a 64-page table 1.3-1.5x slower than c_p alone priced).
    `LatencyModel.from_steps` makes the model (give it the same padding)."""
    if cached and padding is None:
        raise PlanningError("the cached-context term needs the padding that gives it")
    feats = [(1.0, *record_features(r, padding)) for r in records]
    names = STEP_TERMS
    if cached:
        feats = [(*f, record_cached_pairs(r, padding)) for f, r in zip(feats, records, strict=True)]
        names = (*STEP_TERMS, "c_cached_pair")
    return fit_least_squares(feats, [r["seconds"] for r in records], names)


def fit_background_share(records: Sequence[dict], model: LatencyModel) -> float | None:
    """`LatencyModel.background_share` from logged steps that ran while a background compile
    shared the host (their "compiling" > 0; not those that compiled inline): 1 / the median of
    measured / `model`'s price (a step slowed 2x had half the core). None without 5 of them."""
    ratios = [r["seconds"] / model.record_seconds(r) for r in records
              if r.get("compiling") and not r.get("compiled")]  # fmt: skip
    if len(ratios) < 5:
        return None
    return float(np.clip(1.0 / np.median(ratios), 0.05, 1.0))


def fit_transfer(samples: Sequence[tuple[int, float]]) -> Fit:
    """samples: (bytes, seconds). Coefficients: latency a and seconds per byte."""
    feats = [(1.0, n) for n, _ in samples]
    return fit_least_squares(feats, [s for _, s in samples], ("a", "s_per_byte"))


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Step times of one instance (one TP group). Seconds; see the module docstring."""

    prefill: tuple[float, float, float]  # a, b per token, c per token^2
    decode: tuple[float, float, float]  # a, b per sequence, c per context token
    transfer: tuple[float, float]  # a, seconds per byte
    kv_bytes_per_token: int
    max_kv_tokens: int  # KV tokens the instance's pool holds (admission stops there)
    max_num_seqs: int = 256  # sequences decoded together at most
    max_batched_tokens: int = 2048  # token budget of one step (prefill rows + decode rows)
    padding: Padding | None = None  # the engine's step shapes (None: steps as they are)
    # A step whose program (`Padding.program`) its instance has not compiled yet: `fit_steps`'
    # coefficients fitted to such steps (compile or load, and the run). (): programs never
    # compile (all compiled ahead of time).
    compile: tuple[float, ...] = ()
    # The engine's own work on a prompt's KV handed between instances, a + b per token moved,
    # which keeps the instance from stepping: a prefill instance's model, writing the pages
    # out before it answers; a decode instance's, admitting them (read, checked, loaded into
    # its pool) before the step that computes the prompt's tail. (0, 0): none.
    handoff: tuple[float, float] = (0.0, 0.0)
    # The share of its core a step gets while a compile runs beside it on another thread
    # (`compile_in_background`; the simulator's processor sharing): 0.5, two threads' fair
    # share, or fitted to logged steps (`fit_background_share`).
    background_share: float = 0.5
    # Seconds per attention pair of a prefill row with cached context beyond prefill's c
    # (`Padding.cached_pairs`; with a padding only): such a row reads its page table.
    cached_pair: float = 0.0

    def __post_init__(self):
        coefs = (*self.prefill, *self.decode, *self.transfer)
        if len(self.prefill) != 3 or len(self.decode) != 3 or len(self.transfer) != 2:
            raise PlanningError("prefill/decode need 3 coefficients, transfer 2")
        if any(c < 0 for c in (*coefs, self.cached_pair)) or self.prefill[0] + self.decode[0] <= 0:
            raise PlanningError(f"coefficients must be >= 0 with a fixed cost > 0: {coefs}")
        if min(self.kv_bytes_per_token, self.max_kv_tokens, self.max_num_seqs) < 1:
            raise PlanningError("kv_bytes_per_token, max_kv_tokens, max_num_seqs must be >= 1")
        if self.max_batched_tokens < 1:
            raise PlanningError(f"{self.max_batched_tokens=} must be >= 1")
        if len(self.handoff) != 2 or min(self.handoff) < 0:
            raise PlanningError(f"handoff={self.handoff}: give (seconds, seconds per token) >= 0")
        if self.compile and (len(self.compile) != 5 or min(self.compile) < 0):
            raise PlanningError(f"compile={self.compile}: give fit_steps' 5 coefficients >= 0")
        if not 0 < self.background_share <= 1:
            raise PlanningError(f"background_share={self.background_share}: give a share in (0, 1]")
        if (self.compile or self.cached_pair) and self.padding is None:
            raise PlanningError("a compile model or cached_pair needs the padding of the steps")

    @classmethod
    def from_steps(cls, fit: Fit, **kwargs) -> LatencyModel:
        """The model of a `fit_steps` fit (its fixed cost shared by prefill and decode, and
        its cached-context term where it has one); kwargs: the other fields."""
        coef = dict(zip(fit.names, fit.coef, strict=True))
        a, bp, cp, bd, cd = (coef[n] for n in STEP_TERMS)
        cached = coef.get("c_cached_pair", 0.0)
        return cls(prefill=(a, bp, cp), decode=(a, bd, cd), cached_pair=cached, **kwargs)

    def prefill_seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """chunks: (tokens, cached tokens before them) per row; a whole prompt is (L, 0)."""
        a, b, c = self.prefill
        tokens, pairs, _, _ = step_features(chunks, 0, 0, self.padding)
        return a + b * tokens + c * pairs + self._cached(chunks, pairs)

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        a, b, c = self.decode
        _, _, rows, context = step_features((), batch, context_tokens, self.padding)
        return a + b * rows + c * context

    def mixed_seconds(self, chunks, batch: int, context_tokens: int) -> float:
        """A step holding prefill chunks and decode rows: both variable costs, and the larger
        fixed cost once (one launch, one weight read)."""
        if not chunks:
            return self.decode_seconds(batch, context_tokens)
        if not batch:
            return self.prefill_seconds(chunks)
        feats = step_features(chunks, batch, context_tokens, self.padding)
        return self._priced(*feats) + self._cached(chunks, feats[1])

    def _cached(self, chunks, pairs: int) -> float:
        """`cached_pair`'s price of padded prefill rows with `pairs`, if they read cached
        context."""
        return 0.0 if _fresh(chunks) else self.cached_pair * pairs

    def program_seconds(self, key: tuple) -> float:
        """A step run by program `key` (`Padding.program`), its padding computed: its own, or
        a covering program's (`Padding.covers`), larger than the step's own."""
        cached = self.cached_pair * self.padding.cached_pairs(key)
        return self._priced(*self.padding.program_features(key)) + cached

    def record_seconds(self, record: dict) -> float:
        """A logged step (`fit_steps`' records) as this model prices it (`record_features`)."""
        cached = 0.0
        if self.cached_pair:
            cached = self.cached_pair * record_cached_pairs(record, self.padding)
        return self._priced(*record_features(record, self.padding)) + cached

    def _priced(self, tokens, pairs, rows, context) -> float:
        """A step of these features (`step_features`): the fixed cost of the phases it holds
        (the larger once), plus both variable costs."""
        (pa, bp, cp), (da, bd, cd) = self.prefill, self.decode
        fixed = max(pa, da) if tokens and rows else (pa if tokens else da)
        return fixed + bp * tokens + cp * pairs + bd * rows + cd * context

    def compile_seconds(self, key: tuple) -> float:
        """A step that compiles its program `key` first (`compile`'s coefficients, same terms
        as `fit_steps`); the plain step time without a compile model."""
        if not self.compile:
            return self.program_seconds(key)
        a, bp, cp, bd, cd = self.compile
        tokens, pairs, rows, context = self.padding.program_features(key)
        return a + bp * tokens + cp * pairs + bd * rows + cd * context

    def scaled(self, factor: float) -> LatencyModel:
        """This model on a host `factor` times slower: every step term (compiles and the
        handoff included) times `factor`; the transfer as it is."""
        if factor <= 0:
            raise PlanningError(f"{factor=} must be > 0")
        return dataclasses.replace(
            self,
            prefill=tuple(c * factor for c in self.prefill),
            decode=tuple(c * factor for c in self.decode),
            compile=tuple(c * factor for c in self.compile),
            handoff=tuple(c * factor for c in self.handoff),
            cached_pair=self.cached_pair * factor,
        )

    def handoff_seconds(self, num_tokens: int) -> float:
        """This instance's own seconds on a handed-off prompt's `num_tokens` of KV."""
        a, b = self.handoff
        return a + b * num_tokens if a or b else 0.0

    def transfer_seconds(self, num_tokens: int) -> float:
        a, s_per_byte = self.transfer
        return a + s_per_byte * num_tokens * self.kv_bytes_per_token

    def with_tp(
        self,
        tp: int,
        *,
        layers: int,
        hidden: int,
        act_bytes: int,
        allreduce_latency: float,
        link_bytes_per_s: float,
        kv_tokens: int,
    ) -> LatencyModel:
        """This model (measured on one device) run with tensor parallelism `tp`.

        Assumption (Megatron-style TP, read off roofline.step_cost): every term of the step
        (weight bytes, KV bytes, matmul and attention FLOPs) splits evenly over the tp devices,
        so each coefficient divides by tp, and each layer adds two ring all-reduces of the
        step's activations: 2 * layers * (latency + 2 (tp-1)/tp * tokens * hidden * act_bytes
        / link bandwidth). The per-token all-reduce cost goes into the b coefficients. kv_tokens:
        the KV pool of the tp devices together (the caller subtracts the weights)."""
        if tp < 1:
            raise PlanningError(f"{tp=} must be >= 1")
        if tp == 1:
            return dataclasses.replace(self, max_kv_tokens=kv_tokens)
        per_token = 2 * layers * 2 * (tp - 1) / tp * hidden * act_bytes / link_bytes_per_s
        fixed = 2 * layers * allreduce_latency
        pa, pb, pc = self.prefill
        da, db, dc = self.decode
        return dataclasses.replace(
            self,
            prefill=(pa / tp + fixed, pb / tp + per_token, pc / tp),
            decode=(da / tp + fixed, db / tp + per_token, dc / tp),
            cached_pair=self.cached_pair / tp,
            max_kv_tokens=kv_tokens,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LatencyModel:
        """`to_dict`'s inverse, also after a JSON round trip (lists back to tuples)."""
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        if d.get("padding") is not None:
            pad = d["padding"]
            d["padding"] = Padding(**{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in pad.items()})  # fmt: skip
        return cls(**d)
