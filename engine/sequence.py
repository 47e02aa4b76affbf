"""Host-side state of one generated sequence: token ids, logprobs, incremental detokenisation,
stop conditions and finish reason. Plain Python; shared by every batching strategy."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from engine.outputs import CompletionOutput, Logprob
from engine.params import SamplingParams


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are never broken UTF-8 and
    never contain (part of) a stop string.

    Decodes a window ``ids[prefix_offset:]`` and compares it with the decode of
    ``ids[prefix_offset:read_offset]`` (the approach of HF's TextStreamer and vLLM), so each
    token costs O(window) rather than O(sequence).
    """

    def __init__(self, tokenizer, skip_special_tokens=True, stop=(), include_stop=False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (the output text unless a stop string cuts it)
        self.emitted = 0  # characters of `text` already returned as deltas
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped_by: str | None = None

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Adds one token; returns the newly safe-to-show text (possibly '').

        Stop strings are searched only when `check_stop` (False before min_tokens)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        if self.stop and check_stop:
            start = max(0, self.emitted - self._hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                index, stop = min(hits)
                self.stopped_by = stop
                self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
                return self._flush()
        safe = max(self.emitted, len(self.text) - self._hold)
        delta, self.emitted = self.text[self.emitted : safe], safe
        return delta

    def _flush(self) -> str:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta

    def copy(self) -> IncrementalDetokenizer:
        """An independent copy (the tokenizer is shared)."""
        other = IncrementalDetokenizer(
            self.tokenizer, self.skip_special_tokens, self.stop, self.include_stop
        )
        other.__dict__.update(self.__dict__, ids=list(self.ids))
        return other

    def finish(self) -> str:
        """The text held back (a possible stop-string prefix, an incomplete character)."""
        if self.stopped_by is None:
            full = self._decode(self.ids)
            # The windowed decode equals the full decode except for a trailing incomplete
            # character, which is only final now.
            if full.startswith(self.text):
                self.text = full
        return self._flush()


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
        )

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.text,
            token_ids=list(self.output_ids),
            cumulative_logprob=self.cumulative_logprob
            if self.params.logprobs is not None
            else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
