"""Structured outputs on the host: grammars compiled once, one matcher per sequence, and the
batch's token bitmask that the jitted sampler applies (`sampling.apply_penalties`).

The grammar engine is llguidance (Microsoft's, the one vLLM and SGLang also offer): a Rust
library with no Python dependencies, whose matcher computes a token mask over a 49k vocabulary
in ~10 us per row (0.3 ms for 32 rows with its thread pool, measured on this machine). xgrammar,
the other engine those servers use, requires torch, transformers and triton at run time, which
the runtime of jaxgen must not need.

The engine overlaps the mask with the step it belongs to (SGLang's design): it dispatches the
forward pass, computes the masks on the host while the device runs it, then dispatches the
sampling with the masks (`engine.core`, `runner.packed.paged_logits` / `packed_outputs`).

Bitmask layout (llguidance's): i32[rows, ceil(V / 32)], token v allowed iff bit v % 32 of word
v // 32 is set; all bits set = unconstrained.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

import numpy as np

from jaxgen.engine.params import StructuredOutputs
from jaxgen.errors import InvalidSamplingParams

log = logging.getLogger("jaxgen.engine")

MAX_CACHED_GRAMMARS = 256


def bitmask_width(vocab_size: int) -> int:
    """i32 words per row of a token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a runtime dependency; only a broken install lacks it
        raise InvalidSamplingParams(
            "structured outputs need the llguidance package: pip install llguidance"
        ) from e
    return llguidance


# The keywords whose value is a subschema or a list of them, or a map of names to subschemas.
_SUBSCHEMAS = ("additionalProperties", "items", "prefixItems", "contains", "not", "if", "then",
               "else", "anyOf", "oneOf", "allOf", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames")  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")  # fmt: skip


def closed_schema(schema):
    """`schema` with ``additionalProperties: false`` on every object schema that names its
    properties and says nothing of others (vLLM's default through its grammar backends, and
    OpenAI's strict mode): the output then holds only the keys the schema names. Without it a
    small model adds keys of its own until max_tokens. A copy; the caller's schema is kept."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_schema(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out


def grammar_text(structured: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (its JSON text; not yet checked)."""
    llg = _llguidance()
    kind = structured.kind
    try:
        if kind == "json":
            schema = structured.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise InvalidSamplingParams("structured outputs: json must be a JSON Schema object")
            if not structured.additional_properties:
                schema = closed_schema(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(structured.regex)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in structured.choice)
            return llg.LLMatcher.grammar_from_lark(lark)
        return llg.grammar_from("grammar", structured.grammar)
    except (ValueError, TypeError) as e:
        if isinstance(e, InvalidSamplingParams):
            raise
        raise InvalidSamplingParams(f"structured outputs: {kind} is not valid: {e}") from e


class GrammarCompiler:
    """Compiles constraints against one tokenizer (once per distinct constraint, LRU-cached) and
    hands out fresh matchers.

    Args:
      tokenizer: `jaxgen.model.Tokenizer` (its `tokenizers` backend is what llguidance reads).
      vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
      eos_ids: the tokens that end a sequence; a finished grammar allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        if not self.eos_ids:
            raise InvalidSamplingParams(
                "structured outputs need an end-of-sequence token, and this model has none"
            )
        self.tokenizer = llg.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=self.eos_ids
        )
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()  # the server builds requests on its own threads
        self.hits = self.misses = 0

    def matcher(self, structured: StructuredOutputs):
        """A fresh llguidance matcher for the constraint; raises InvalidSamplingParams (naming
        what is wrong) for an invalid or empty language."""
        key = grammar_text(structured)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template.deep_copy()
        llg = _llguidance()
        template = llg.LLMatcher(self.tokenizer, key, log_level=0)
        if template.is_error():
            raise InvalidSamplingParams(
                f"structured outputs: the {structured.kind} constraint is not valid: "
                f"{template.get_error().strip()}"
            )
        probe = template.deep_copy()
        probe.compute_bitmask()  # a language with no string stops (or errs) at its first mask
        if probe.is_error() or (probe.is_stopped() and not probe.is_accepting()):
            raise InvalidSamplingParams(
                f"structured outputs: the {structured.kind} constraint accepts no output "
                "(no string matches it); check it for a contradiction"
            )
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template.deep_copy()


class GrammarState:
    """One sequence's matcher, advanced lazily to the sequence's output tokens (whatever path
    appended them: a step, a speculative verification, a preemption's recompute)."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher, consumed: int = 0):
        self.matcher = matcher
        self.consumed = consumed

    def sync(self, output_ids: list[int]) -> None:
        """Consumes the output tokens not seen yet."""
        new = output_ids[self.consumed :]
        if new and not self.matcher.is_stopped():  # after a stop only EOS, which ends it
            self.matcher.consume_tokens(new)
            self.consumed = len(output_ids)
            if self.matcher.is_error():
                log.error("structured outputs: %s", self.matcher.get_error())

    def copy(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.consumed)

    @property
    def finished(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return self.matcher.is_stopped()


class BitmaskFiller:
    """Fills a step's token bitmask with llguidance's thread pool (the GIL is released while
    the pool works)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._executor = None
        self.reset()

    def reset(self) -> None:
        """Zeroes the host-time counters (`seconds` spent filling, over `calls`)."""
        self.seconds, self.calls = 0.0, 0

    def fill(self, rows: list[tuple], num_rows: int) -> np.ndarray:
        """i32[num_rows, W]: row r constrained by its grammar (synced to its output tokens first);
        rows not listed are unconstrained.

        Args:
          rows: (row index, the sequence's output ids, its GrammarState[, drafts]); with drafted
            tokens (speculative verification), rows index + j for j = 1..len(drafts) hold the
            mask after the first j drafts (up to the first one the grammar forbids; the matcher
            is rolled back afterwards).
        """
        t0 = time.perf_counter()
        mask = np.full((num_rows, self.width), -1, np.int32)
        matchers, drafted = [], []
        for r, output_ids, state, *draft in rows:
            state.sync(output_ids)
            if state.matcher.is_error():
                continue
            if draft and draft[0]:
                drafted.append((state.matcher, r, list(draft[0])))
            else:
                matchers.append((state.matcher, r))
        if matchers or drafted:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            if matchers:
                self._executor.unsafe_compute_mask_ptr(
                    matchers, mask.ctypes.data, self.width * 4, num_rows
                )
            if drafted:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(
                    drafted, mask.ctypes.data, self.width * 4, num_rows
                )
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return mask
