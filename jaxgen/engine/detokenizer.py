"""Token ids back into text, one token at a time: deltas that are never broken UTF-8 and never
contain (part of) a stop string. Works with any tokenizer that has ``decode``."""

from __future__ import annotations

import weakref

# One token decoded alone does not depend on its context: its text is kept per tokenizer (and
# skip_special_tokens), which halves the decodes of the steady one-token-per-step case.
_SINGLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are never broken UTF-8 and
    never contain (part of) a stop string.

    Decodes a window ``ids[prefix_offset:]`` and compares it with the decode of
    ``ids[prefix_offset:read_offset]`` (the approach of HF's TextStreamer and vLLM), so each
    token costs O(window) rather than O(sequence).

    ``incremental=False`` (a completion nobody streams, with no stop strings to search): pushes
    only record the ids and return ''; the text is decoded once, in one call, when it is asked
    for (`finish`, `current_text`), off the per-step path.
    """

    def __init__(
        self, tokenizer, skip_special_tokens=True, stop=(), include_stop=False, incremental=True
    ):
        self.tokenizer = tokenizer
        self.incremental = incremental or bool(stop)
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
        try:
            self._single = _SINGLE.setdefault(tokenizer, {}).setdefault(skip_special_tokens, {})
        except TypeError:  # a tokenizer that cannot be weakly referenced: a cache of its own
            self._single = {}

    def _decode(self, ids):
        if len(ids) == 1:
            text = self._single.get(ids[0])
            if text is None:
                text = self._single[ids[0]] = self.tokenizer.decode(
                    ids, skip_special_tokens=self.skip_special_tokens
                )
            return text
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Adds one token; returns the newly safe-to-show text (possibly '').

        Stop strings are searched only when `check_stop` (False before min_tokens)."""
        self.ids.append(token_id)
        if not self.incremental:
            return ""
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
            self.tokenizer, self.skip_special_tokens, self.stop, self.include_stop, self.incremental
        )
        other.__dict__.update(self.__dict__, ids=list(self.ids))
        return other

    def current_text(self) -> str:
        """All text so far (an unfinished completion's text, e.g. when it is aborted)."""
        if not self.incremental:
            return self._decode(self.ids)
        return self.text

    def finish(self) -> str:
        """The text held back (a possible stop-string prefix, an incomplete character)."""
        if not self.incremental:
            self.text = self._decode(self.ids)
        elif self.stopped_by is None:
            full = self._decode(self.ids)
            # The windowed decode equals the full decode except for a trailing incomplete
            # character, which is only final now.
            if full.startswith(self.text):
                self.text = full
        return self._flush()
