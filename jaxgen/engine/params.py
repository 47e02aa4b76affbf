"""SamplingParams: vLLM's names and semantics, validated when constructed."""

from __future__ import annotations

import dataclasses
import numbers

from jaxgen.errors import InvalidSamplingParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # OpenAI's limit
_REAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Constrains a request's output to a language (vLLM's ``StructuredOutputsParams``). Set
    exactly one of:

    json: a JSON Schema (a dict, or its JSON text); the output is a JSON value it validates.
    json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
    regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar, in Lark syntax (llguidance's dialect, which may embed
      ``%json {...}`` schemas) or GBNF/EBNF as llama.cpp writes it.

    additional_properties: whether an object schema (of `json`) that names its properties and
    does not say ``additionalProperties`` allows properties it does not name. False (the
    default, as vLLM's grammar backends and OpenAI's strict mode treat such a schema): it does
    not, so the output holds only the keys the schema names. A schema that says
    ``additionalProperties`` is always taken at its word.

    Whether the language is valid and non-empty is checked with the model's tokenizer when the
    request is built (`engine.sample.structured`), before any device work.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    additional_properties: bool = False

    def __post_init__(self):
        def bad(msg):
            raise InvalidSamplingParams(f"structured outputs: {msg}")

        if not isinstance(self.additional_properties, bool):
            bad(f"additional_properties must be a bool, got {self.additional_properties!r}")

        given = self._given()
        if len(given) != 1:
            bad(
                "set exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad(f"json must be a JSON Schema dict or its JSON text, got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            bad(f"json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                bad(f"choice must be a list of non-empty strings, got {self.choice!r}")
            choice = tuple(self.choice)
            if not choice:
                bad("choice must name at least one string")
            object.__setattr__(self, "choice", choice)

    @classmethod
    def from_dict(cls, d) -> StructuredOutputs:
        """From ``{"json": ...}``-style dicts (the server's and batch files' spelling)."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise InvalidSamplingParams(
                f"structured outputs must be a StructuredOutputs or a dict, got {type(d).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidSamplingParams(
                f"structured outputs: unknown fields {unknown}; use {sorted(names)}"
            )
        return cls(**d)

    def _given(self) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "additional_properties" and getattr(self, f.name) not in (None, False)
        ]

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._given()[0]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Field names and meanings follow vLLM.

    temperature 0 means greedy. ``top_k=-1`` disables top-k. Penalties follow vLLM:
    ``repetition_penalty`` (> 0, 1 = off) divides positive / multiplies negative logits of
    tokens seen in the prompt or output; ``presence_penalty`` and ``frequency_penalty``
    (in [-2, 2]) subtract from logits of tokens already generated. ``logprobs=n`` returns the
    top-n log-probabilities (of the model's raw distribution) for each generated token,
    ``prompt_logprobs=n`` the same for each prompt token. ``logit_bias`` ({token id: bias in
    [-100, 100]}, OpenAI's) is added to those tokens' logits before everything else.
    ``structured`` (a `StructuredOutputs`, or a dict of its fields) constrains the output to a
    JSON Schema, regex, choice or grammar: tokens the grammar forbids are masked before
    sampling (the returned logprobs stay the model's raw ones).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutputs | None = None

    def __post_init__(self):
        def bad(msg):
            raise InvalidSamplingParams(msg)

        if self.structured is not None:
            object.__setattr__(self, "structured", StructuredOutputs.from_dict(self.structured))

        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                bad(f"{name} must be a number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or self.best_of < self.n
        ):
            bad(f"best_of must be an int >= n ({self.n}), got {self.best_of!r}")
        if not self.temperature >= 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            bad(f"top_k must be -1 (disabled) or a positive int, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                bad(f"{name} must be in [-2, 2], got {value}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(i, int) or i < 0 for i in ids):
            bad(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad(f"seed must be a non-negative int, got {self.seed!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} {{token id: bias}}")
            for token, value in bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    bad(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    bad(f"logit_bias[{token}] must be a number, got {value!r}")
                if not -100 <= value <= 100:
                    bad(f"logit_bias[{token}] must be in [-100, 100], got {value}")
            object.__setattr__(self, "logit_bias", dict(bias) or None)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                bad(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences generated per prompt (best_of if set, else n)."""
        return self.best_of or self.n
