"""Host-side state of one generated sequence: token ids, logprobs, stop conditions and finish
reason (its text comes from the processor's incremental detokenizer). Plain Python; shared by
every batching strategy."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from jaxgen.engine.outputs import CompletionOutput, Logprob
from jaxgen.engine.params import SamplingParams

if TYPE_CHECKING:
    from jaxgen.engine.detokenizer import IncrementalDetokenizer
    from jaxgen.engine.sample.structured import GrammarState

# A sequence's status in the scheduler (`state.SeqState.status`).
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclasses.dataclass
class Sequence:
    """One sample of one request."""

    request_id: str
    index: int  # sample index within the request (n > 1)
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    detok: IncrementalDetokenizer
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    key: np.ndarray | None = None  # u32[2] PRNG key data (seed and sample index folded in)
    grammar: GrammarState | None = None  # structured outputs: the matcher of this sample

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token: int, logprob=None, rank=None, top=None, now=None) -> str:
        """Records one generated token; returns the text delta it makes safe to show.

        Args:
          logprob, rank: the token's raw log-probability and rank (if computed).
          top: [(token_id, logprob)] for the top-n alternatives (if requested).
        """
        assert not self.finished, "append to a finished sequence"
        self.output_ids.append(token)
        self.token_times.append(time.perf_counter() if now is None else now)
        if logprob is not None:
            self.cumulative_logprob += logprob
        if self.params.logprobs is not None:
            entry = {tid: Logprob(lp, r + 1) for r, (tid, lp) in enumerate(top or [])}
            entry[token] = Logprob(logprob, rank)
            self.logprobs = (self.logprobs or []) + [entry]
        n = len(self.output_ids)
        is_stop_token = token in self.stop_ids and n > self.params.min_tokens
        delta = "" if is_stop_token else self.detok.push(token, n >= self.params.min_tokens)
        if is_stop_token:
            self.finish_reason, self.stop_reason = "stop", token
        elif self.detok.stopped_by is not None:
            self.finish_reason, self.stop_reason = "stop", self.detok.stopped_by
        elif n >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            delta += self.detok.finish()
        return delta

    def fork(self, index: int) -> Sequence:
        """A copy of this sequence (tokens, logprobs, detokeniser) under a new index."""
        return dataclasses.replace(
            self,
            index=index,
            detok=self.detok.copy(),
            output_ids=list(self.output_ids),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            token_times=list(self.token_times),
            grammar=None if self.grammar is None else self.grammar.copy(),
        )

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.current_text(),
            token_ids=list(self.output_ids),
            # Shown with logprobs, and whenever best_of chose the completions by it.
            cumulative_logprob=self.cumulative_logprob
            if self.params.logprobs is not None or self.params.num_samples > self.params.n
            else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
