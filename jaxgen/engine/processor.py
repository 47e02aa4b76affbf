"""Requests in, text out: the one layer that turns user input into validated `Request`s
(tokenising prompts, checking parameters and lengths, once per request) and gives each sequence
the `IncrementalDetokenizer` that turns its token ids back into text.

Every entry point (`LLM.generate`, the OpenAI server, batch jobs, the CLI) builds its requests
here; the scheduler below it sees token ids only and needs no tokenizer.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceABC

import numpy as np

from jaxgen.engine.detokenizer import IncrementalDetokenizer
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.request import Request
from jaxgen.engine.sample.sampling import row_keys
from jaxgen.engine.sched.sequence import Sequence
from jaxgen.errors import InvalidPrompt, InvalidSamplingParams, LoRANotLoaded


class Processor:
    """Builds validated requests for one model and tokenizer.

    Args:
      tokenizer: `jaxgen.model.Tokenizer` (or any object with ``encode``, ``decode`` and
        ``apply_chat_template``).
      vocab_size: the model's vocabulary; prompt ids must lie in ``[0, vocab_size)``.
      max_model_len: prompt tokens + max_tokens may not exceed it.
      eos_ids: the ids that end a sequence unless ``ignore_eos``.
      seed: draws the seeds of requests that set none (reproducible runs).
      loras: the `engine.lora.LoRARegistry` requests name their adapters in (None: no LoRA).
    """

    def __init__(
        self, tokenizer, vocab_size: int, max_model_len: int, eos_ids, seed=None, loras=None
    ):
        self.tokenizer = tokenizer
        self.loras = loras
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)
        self._rng = np.random.default_rng(seed)
        self._request_counter = itertools.count()
        self._grammars = None  # GrammarCompiler, built on the first structured request

    @property
    def grammars(self):
        """The `engine.sample.structured.GrammarCompiler` of this tokenizer and EOS set."""
        from jaxgen.engine.sample.structured import GrammarCompiler

        if self._grammars is None or self._grammars.eos_ids != sorted(self.eos_ids):
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars

    def _grammar_states(self, i: int, params: SamplingParams):
        """One fresh matcher per sample of a structured request (None otherwise)."""
        if params.structured is None:
            return [None] * params.num_samples
        from jaxgen.engine.sample.structured import GrammarState

        try:
            matcher = self.grammars.matcher(params.structured)
        except InvalidSamplingParams as e:
            raise InvalidSamplingParams(f"sampling params {i}: {e}") from None
        return [GrammarState(matcher)] + [
            GrammarState(matcher.deep_copy()) for _ in range(params.num_samples - 1)
        ]

    def apply_chat_template(self, conversation, add_generation_prompt=True, **kwargs) -> dict:
        """A conversation as a prompt: {"prompt": text, "prompt_token_ids": ids}. Extra keyword
        arguments reach the template (e.g. ``tools``); an assistant message may carry
        ``tool_calls`` instead of content."""
        if not isinstance(conversation, list) or not all(
            isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m)
            for m in conversation
        ):
            raise InvalidPrompt('a conversation is a list of {"role": ..., "content": ...} dicts')
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except ValueError as e:  # the template's raise_exception (roles out of order, ...)
            raise InvalidPrompt(f"the chat template rejects this conversation: {e}") from e
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    def make_requests(
        self, prompts, sampling_params, *, stream: bool = True, lora_request=None
    ) -> list[Request]:
        """Validated requests, one per prompt (a string, a token-id list, or {"prompt" |
        "prompt_token_ids"}), with one SamplingParams for all or one each; raises
        InvalidPrompt / InvalidSamplingParams / LoRANotLoaded before anything is queued.
        `stream=False`: nobody reads the text deltas, so a completion without stop strings is
        detokenized once, at its end. `lora_request`: the LoRA adapter of every prompt, or a
        list of one per prompt (an adapter name, an `engine.lora.LoRARequest`, or None for the
        base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts is None or not isinstance(prompts, SequenceABC) or len(prompts) == 0:
            raise InvalidPrompt(
                "no prompts given: pass a string, a token-id list, or a list of them"
            )
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # a single token-id list
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidSamplingParams(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one "
                    "or one per prompt"
                )
        parsed = [self.parse_prompt(i, p) for i, p in enumerate(prompts)]
        limit = self.max_model_len
        for i, ((_, ids), params) in enumerate(zip(parsed, params_list, strict=True)):
            if not isinstance(params, SamplingParams):
                raise InvalidSamplingParams(f"sampling params {i} is a {type(params).__name__}")
            bad_bias = [t for t in params.logit_bias or () if t >= self.vocab_size]
            if bad_bias:
                raise InvalidSamplingParams(
                    f"sampling params {i}: logit_bias names token ids outside the vocabulary "
                    f"[0, {self.vocab_size}): {bad_bias[:5]}"
                )
            if len(ids) + params.max_tokens > limit:
                raise InvalidPrompt(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={params.max_tokens} that "
                    f"exceeds max_model_len={limit}. Shorten the prompt or lower max_tokens."
                )
        loras = self._loras(lora_request, len(prompts))
        grammars = [self._grammar_states(i, p) for i, p in enumerate(params_list)]
        now = time.perf_counter()
        seeds = [
            p.seed if p.seed is not None else int(self._rng.integers(2**63)) for p in params_list
        ]
        samples = [
            (seed, i)
            for seed, p in zip(seeds, params_list, strict=True)
            for i in range(p.num_samples)
        ]
        keys = iter(row_keys([seed for seed, _ in samples], [i for _, i in samples]))
        requests = []
        for (text, ids), params, states, lora in zip(
            parsed, params_list, grammars, loras, strict=True
        ):
            request_id = str(next(self._request_counter))
            stop_ids = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_ids
            )
            seqs = [
                Sequence(
                    key=next(keys),
                    request_id=request_id,
                    index=i,
                    prompt_ids=ids,
                    params=params,
                    stop_ids=stop_ids,
                    detok=IncrementalDetokenizer(
                        self.tokenizer,
                        params.skip_special_tokens,
                        params.stop,
                        params.include_stop_str_in_output,
                        incremental=stream,
                    ),
                    grammar=states[i],
                )
                for i in range(params.num_samples)
            ]
            requests.append(
                Request(
                    request_id=request_id,
                    prompt=text,
                    prompt_ids=ids,
                    params=params,
                    seqs=seqs,
                    arrival_time=now,
                    lora=lora,
                )
            )
        return requests

    def _loras(self, lora_request, num_prompts: int) -> list:
        """Each prompt's `engine.lora.LoadedLoRA` (None: the base model)."""
        if isinstance(lora_request, list | tuple):
            if len(lora_request) != num_prompts:
                raise InvalidPrompt(
                    f"got {len(lora_request)} LoRA requests for {num_prompts} prompts; pass one "
                    "or one per prompt"
                )
            requests = list(lora_request)
        else:
            requests = [lora_request] * num_prompts
        if self.loras is None:
            if any(r is not None for r in requests):
                raise LoRANotLoaded(
                    "this engine serves no LoRA adapters: build it with LLM(enable_lora=True) "
                    "(jaxgen serve --enable-lora)"
                )
            return requests
        return [self.loras.resolve(r) for r in requests]

    def parse_prompt(self, i, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise InvalidPrompt(f'prompt {i} must have "prompt" or "prompt_token_ids"')
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            text, ids = None, prompt
        if ids is None:
            if not text:
                raise InvalidPrompt(f"prompt {i} is empty; give at least one character")
            ids = self.tokenizer.encode(text)
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError) as e:
            raise InvalidPrompt(f"prompt {i} must be a string or a list of token ids") from e
        if not ids:
            raise InvalidPrompt(f"prompt {i} has no tokens; give at least one")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidPrompt(
                f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return text, ids
