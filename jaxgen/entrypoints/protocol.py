"""The OpenAI API's wire format, shared by the server and batch jobs (no HTTP here): the
fields each route accepts, request bodies into prompts and `SamplingParams`, our typed errors
into OpenAI's error shape, and outputs into response bodies (`choices`, `usage`, `logprobs`)."""

from __future__ import annotations

from jaxgen.engine.params import SamplingParams
from jaxgen.errors import CapacityError, InvalidPrompt, JaxgenError

# Fields each route understands; anything else is rejected (strict), so typos do not silently
# change behaviour. Fields OpenAI defines that we accept but do not act on are listed too.
_SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "user",
    "stream_options",
    "logit_bias",
    # vLLM's extra sampling fields
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"model", "prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "model",
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
}


class APIError(Exception):
    """An error answered in OpenAI's JSON error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type_, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self):
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status)


def check_type(body, name, types, required=False):
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"'{name}' is required", name)
        return None
    value = body[name]
    if isinstance(value, bool) and bool not in types:
        raise APIError(400, f"'{name}' must be {' or '.join(t.__name__ for t in types)}", name)
    if not isinstance(value, types):
        raise APIError(
            400,
            f"'{name}' must be {' or '.join(t.__name__ for t in types)}, "
            f"got {type(value).__name__}",
            name,
        )
    return value


def sampling_params(body: dict, chat: bool) -> dict:
    """SamplingParams keyword arguments from a request body (None: not given)."""
    num = (int, float)
    max_tokens = check_type(
        body,
        "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
        (int,),
    )
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    if chat:
        want = check_type(body, "logprobs", (bool,))
        logprobs = (check_type(body, "top_logprobs", (int,)) or 0) if want else None
        if not want and body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = check_type(body, "logprobs", (int,))
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            bias = logit_bias_by_id(bias)
        except ValueError:
            raise APIError(
                400, "'logit_bias' must map token ids (as strings) to numbers", "logit_bias"
            ) from None
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in stop_ids)
    ):
        raise APIError(400, "'stop_token_ids' must be a list of ints", "stop_token_ids")
    kwargs = dict(
        n=check_type(body, "n", (int,)),
        best_of=check_type(body, "best_of", (int,)),
        temperature=check_type(body, "temperature", num),
        top_p=check_type(body, "top_p", num),
        top_k=check_type(body, "top_k", (int,)),
        min_p=check_type(body, "min_p", num),
        presence_penalty=check_type(body, "presence_penalty", num),
        frequency_penalty=check_type(body, "frequency_penalty", num),
        repetition_penalty=check_type(body, "repetition_penalty", num),
        max_tokens=max_tokens if max_tokens is not None else (None if chat else 16),
        min_tokens=check_type(body, "min_tokens", (int,)),
        seed=check_type(body, "seed", (int,)),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=check_type(body, "ignore_eos", (bool,)),
        skip_special_tokens=check_type(body, "skip_special_tokens", (bool,)),
        include_stop_str_in_output=check_type(body, "include_stop_str_in_output", (bool,)),
        logprobs=logprobs,
        logit_bias=bias,
    )
    return kwargs


def logit_bias_by_id(bias) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, ids as JSON strings) keyed by int token ids;
    ValueError if it is not such a map (the values' range is SamplingParams' to check)."""
    if not isinstance(bias, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()
    ):
        raise ValueError("logit_bias must map token ids to numbers")
    return {int(k): v for k, v in bias.items()}


def include_usage(body: dict) -> bool:
    """`stream_options: {"include_usage": bool}` (streaming only, as OpenAI)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(
            400, "'stream_options' must be {\"include_usage\": true|false}", "stream_options"
        )
    return bool(check_type(options, "include_usage", (bool,)))


def error_from(e: JaxgenError) -> APIError:
    """Our typed input errors as OpenAI errors (400; prompts over the context say so)."""
    code = None
    if isinstance(e, InvalidPrompt) and "max_model_len" in str(e):
        code = "context_length_exceeded"
    elif isinstance(e, CapacityError):
        code = "capacity_exceeded"
    return APIError(400, str(e), code=code)


def check_fields(body, allowed: set[str]) -> dict:
    """The body as a dict with only fields the route knows (strict: typos are errors)."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if body.get("echo") or body.get("suffix"):
        raise APIError(400, "'echo' and 'suffix' are not supported", "echo")
    return body


def params_from(kwargs: dict, defaults: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams from body kwargs (None: not given), over `defaults` when given."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    if defaults is None:
        return SamplingParams(**given)
    return SamplingParams(**{**defaults.__dict__, **given})


def completion_request(body: dict, defaults: SamplingParams | None = None):
    """(prompts, SamplingParams) of a /v1/completions body."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "'prompt' is required", "prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise APIError(400, "'prompt' must be a string, a token list, or a list of them", "prompt")
    kwargs = sampling_params(body, chat=False)
    if defaults is not None and "max_tokens" not in body:
        kwargs["max_tokens"] = None  # the job's default, not OpenAI's 16
    return prompts, params_from(kwargs, defaults)


def chat_request(body: dict, defaults: SamplingParams | None = None):
    """(messages, SamplingParams) of a /v1/chat/completions body."""
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise APIError(
            400,
            "'messages' must be a non-empty list of {role, content} objects with string content",
            "messages",
        )
    kwargs = sampling_params(body, chat=True)
    if kwargs["max_tokens"] is None and defaults is None:
        kwargs["max_tokens"] = 256
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return messages, params_from(kwargs, defaults)


def completion_choices(tokenizer, outputs, n: int) -> list[dict]:
    return [
        {
            "index": i * n + c.index,
            "text": c.text,
            "logprobs": completion_logprobs(tokenizer, c),
            "finish_reason": c.finish_reason,
        }
        for i, out in enumerate(outputs)
        for c in out.outputs
    ]


def chat_choices(tokenizer, output, num_top: int) -> list[dict]:
    return [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(tokenizer, c, num_top),
            "finish_reason": c.finish_reason,
        }
        for c in output.outputs
    ]


def response_body(cid: str, kind: str, created: int, model: str, choices, outputs) -> dict:
    """The non-streaming response body of /v1/completions and /v1/chat/completions."""
    return {
        "id": cid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(outputs),
    }


def usage(outs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def text_offsets(tokenizer, token_ids, pieces: list[str]) -> list[int]:
    """Character offset of each token in the completion's text (OpenAI's `text_offset`): where
    the text decoded so far ends when the token starts. `pieces`: each token decoded alone;
    where they spell the whole text (no character split across tokens) their running lengths
    are the offsets, else each prefix is decoded."""
    if "".join(pieces) == tokenizer.decode(token_ids):
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return offsets
    return [len(tokenizer.decode(token_ids[:i])) for i in range(len(token_ids))]


def completion_logprobs(tokenizer, c):
    """/v1/completions' logprobs of one choice (None unless asked)."""
    if c.logprobs is None:
        return None
    tokens = [tokenizer.decode([t]) for t in c.token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)],
        "top_logprobs": [
            {tokenizer.decode([k]): v.logprob for k, v in e.items()} for e in c.logprobs
        ],
        "text_offset": text_offsets(tokenizer, c.token_ids, tokens),
    }


def chat_logprobs(tokenizer, c, num_top: int):
    """/v1/chat/completions' logprobs of one choice: each token with its `num_top` best, and
    the UTF-8 bytes of each (a token may hold part of a character)."""
    if c.logprobs is None:
        return None

    def item(token_id, logprob):
        return {
            "token": tokenizer.decode([token_id]),
            "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    return {
        "content": [
            {
                **item(t, e[t].logprob),
                "top_logprobs": [
                    item(k, v.logprob)
                    for k, v in sorted(e.items(), key=lambda kv: kv[1].rank)
                    if v.rank <= num_top
                ],
            }
            for t, e in zip(c.token_ids, c.logprobs, strict=True)
        ]
    }
