"""The OpenAI API's wire format: the fields each route accepts, request bodies into
`SamplingParams` arguments, our typed errors into OpenAI's error shape, and outputs into the
response bodies' `usage` and `logprobs`."""

from __future__ import annotations

import json

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

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

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


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
    )
    return kwargs


def error_from(e: JaxgenError) -> APIError:
    """Our typed input errors as OpenAI errors (400; prompts over the context say so)."""
    code = None
    if isinstance(e, InvalidPrompt) and "max_model_len" in str(e):
        code = "context_length_exceeded"
    elif isinstance(e, CapacityError):
        code = "capacity_exceeded"
    return APIError(400, str(e), code=code)


async def json_body(request: HTTPRequest, allowed: set[str]) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if body.get("echo") or body.get("suffix"):
        raise APIError(400, "'echo' and 'suffix' are not supported", "echo")
    return body


def usage(outs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


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
        "text_offset": [],
    }


def chat_logprobs(tokenizer, c, num_top: int):
    """/v1/chat/completions' logprobs of one choice: each token with its `num_top` best."""
    if c.logprobs is None:
        return None
    return {
        "content": [
            {
                "token": tokenizer.decode([t]),
                "logprob": e[t].logprob,
                "top_logprobs": [
                    {"token": tokenizer.decode([k]), "logprob": v.logprob}
                    for k, v in sorted(e.items(), key=lambda kv: kv[1].rank)
                    if v.rank <= num_top
                ],
            }
            for t, e in zip(c.token_ids, c.logprobs, strict=True)
        ]
    }
