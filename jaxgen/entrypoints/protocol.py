"""The OpenAI API's wire format, shared by the server and batch jobs (no HTTP here): the
fields each route accepts, request bodies into prompts and `SamplingParams`, our typed errors
into OpenAI's error shape, and outputs into response bodies (`choices`, `usage`, `logprobs`,
`tool_calls`). Output constraints (``response_format``, vLLM's ``structured_outputs`` and
``guided_*``, ``tool_choice``) become `SamplingParams.structured` here, once."""

from __future__ import annotations

import dataclasses
import re

from jaxgen.engine.params import MAX_LOGPROBS, SamplingParams, StructuredOutputs
from jaxgen.entrypoints.tool_calls import Function, ToolParser, ToolRequest, chat_prompt
from jaxgen.errors import CapacityError, InvalidPrompt, InvalidSamplingParams, JaxgenError

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
    # Output constraints: OpenAI's, vLLM's, and vLLM's older spelling (at most one of them)
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    # jaxgen's: JSON Schemas of this request (output constraint, tool arguments) that name
    # their properties and do not say `additionalProperties` allow others (default: they don't)
    "additional_properties",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {
    "model",
    "prompt",
    "logprobs",
    "echo",
    "suffix",
    "kv_transfer_params",
}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "kv_transfer_params",
    "model",
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
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


def check_keys(value: dict, allowed: tuple[str, ...], where: str, param: str) -> None:
    """A nested object holds only the fields it defines (strict, as the bodies are)."""
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise APIError(
            400,
            f"{where} has unknown field(s) {', '.join(unknown)}; it takes {', '.join(allowed)}",
            param,
        )


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
    temperature = check_type(body, "temperature", num)
    if temperature is not None and not 0 <= temperature <= 2:
        raise APIError(400, f"'temperature' must be in [0, 2], got {temperature}", "temperature")
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
        temperature=temperature,
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
        structured=structured_outputs(body),
    )
    return kwargs


# The body fields that constrain the output, and the `StructuredOutputs` field each sets.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def additional_properties(body: dict) -> bool:
    """jaxgen's ``additional_properties`` field: true lets an object schema of this request
    that names its properties and does not say ``additionalProperties`` take other keys too
    (`StructuredOutputs.additional_properties`); by default it takes only those it names."""
    return bool(check_type(body, "additional_properties", (bool,)))


def structured_outputs(body: dict) -> StructuredOutputs | None:
    """The output constraint of a body: ``response_format`` (OpenAI), ``structured_outputs``
    (vLLM: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``) or one of
    vLLM's older ``guided_*`` fields; at most one of them. With ``additional_properties``
    (jaxgen's), its JSON Schema allows keys it does not name."""
    constraint = _structured_outputs(body)
    if constraint is not None and additional_properties(body):
        constraint = dataclasses.replace(constraint, additional_properties=True)
    return constraint


def _structured_outputs(body: dict) -> StructuredOutputs | None:
    given = [
        name
        for name in ("response_format", "structured_outputs", *_GUIDED)
        if body.get(name) is not None
    ]
    if len(given) > 1:
        raise APIError(
            400,
            f"{' and '.join(repr(g) for g in given)} each constrain the output; give only one",
            given[1],
        )
    if not given:
        return None
    name = given[0]
    value = body[name]
    try:
        if name == "response_format":
            return response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise APIError(
                    400,
                    "'structured_outputs' must be an object with one of json, json_object, "
                    f"regex, choice, grammar, got {type(value).__name__}",
                    name,
                )
            return StructuredOutputs.from_dict(value)
        if name == "guided_choice" and not isinstance(value, list):
            raise APIError(400, "'guided_choice' must be a list of strings", name)
        return StructuredOutputs(**{_GUIDED[name]: value})
    except InvalidSamplingParams as e:
        raise APIError(400, f"'{name}': {e}", name) from None


def response_format(value) -> StructuredOutputs | None:
    """OpenAI's ``response_format``: {"type": "text"} (no constraint), {"type":
    "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}}. The schema is enforced whether or not ``strict`` is set."""
    param = "response_format"
    kinds = ", ".join(repr(k) for k in _RESPONSE_FORMATS)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, f"'response_format' must be an object with a 'type' ({kinds})", param)
    kind = value["type"]
    if kind not in _RESPONSE_FORMATS:
        raise APIError(400, f"'response_format.type' must be one of {kinds}, got {kind!r}", param)
    check_keys(
        value, ("type", "json_schema") if kind == "json_schema" else ("type",), f"'{param}'", param
    )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(
            400,
            "'response_format.json_schema' must be an object with a JSON Schema object under "
            "'schema' (and a 'name')",
            param,
        )
    check_keys(spec, ("name", "description", "schema", "strict"), f"'{param}.json_schema'", param)
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise APIError(
                400, f"'response_format.json_schema.{key}' must be a {kind.__name__}", param
            )
    return StructuredOutputs(json=spec["schema"])


def logit_bias_by_id(bias) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias}, ids as JSON strings) keyed by int token ids;
    ValueError if it is not such a map (the values' range is SamplingParams' to check)."""
    if not isinstance(bias, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()
    ):
        raise ValueError("logit_bias must map token ids to numbers")
    return {int(k): v for k, v in bias.items()}


def kv_transfer_params(body: dict) -> dict | None:
    """`kv_transfer_params` (vLLM's field for disaggregated serving; `cache.transfer`): on a
    prefill instance {"do_remote_decode": true} asks for the answer to say where the prompt's
    pages can be read; on a decode instance that answer's {"session": ..., "blocks": [[hash,
    address, bytes], ...]} names the pages to read before decoding."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    field = "kv_transfer_params"
    if not isinstance(params, dict):
        raise APIError(400, "'kv_transfer_params' must be an object", field)
    if set(params) == {"do_remote_decode"}:
        if params["do_remote_decode"] is not True:
            raise APIError(400, "'kv_transfer_params.do_remote_decode' must be true", field)
        if body.get("stream"):
            raise APIError(400, "'kv_transfer_params.do_remote_decode' needs 'stream': false",
                           field)  # fmt: skip
        return params
    blocks = params.get("blocks")
    ok = (
        set(params) == {"session", "blocks"}
        and isinstance(params["session"], str)
        and isinstance(blocks, list)
        and all(
            isinstance(b, list)
            and len(b) == 3
            and all(type(x) is int for x in b)
            and min(b[1:]) >= 0
            for b in blocks
        )
    )
    if not ok:
        raise APIError(
            400,
            "'kv_transfer_params' must be {\"do_remote_decode\": true} or a prefill instance's "
            'answer: {"session": str, "blocks": [[hash, address, bytes], ...]}',
            field,
        )
    return params


@dataclasses.dataclass(frozen=True)
class StreamUsage:
    """`stream_options` (streaming only, as OpenAI): `include_usage`, a last chunk with the
    usage of the whole request; vLLM's `continuous_usage_stats`, usage (so far) on every
    chunk as well."""

    include: bool = False
    continuous: bool = False


_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def stream_usage(body: dict) -> StreamUsage:
    options = body.get("stream_options")
    if options is None:
        return StreamUsage()
    if not body.get("stream"):
        raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - set(_STREAM_OPTIONS):
        raise APIError(
            400,
            '\'stream_options\' must be {"include_usage": bool, "continuous_usage_stats": '
            "bool} (either may be left out)",
            "stream_options",
        )
    include = bool(check_type(options, "include_usage", (bool,)))
    continuous = bool(check_type(options, "continuous_usage_stats", (bool,)))
    return StreamUsage(include, include and continuous)


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage of one streamed choice so far (`stream_options.continuous_usage_stats`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
    return body


def params_from(kwargs: dict, defaults: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams from body kwargs (None: not given), over `defaults` when given."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    if defaults is None:
        return SamplingParams(**given)
    return SamplingParams(**{**defaults.__dict__, **given})


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A /v1/completions body, parsed. `echo`: each choice's text (and logprobs) start with its
    prompt's; `score_only`: ``max_tokens: 0`` with ``echo``, the prompt scored and nothing
    generated (the engine runs one token, which the answer leaves out, as vLLM does)."""

    prompts: list
    params: SamplingParams
    echo: bool = False
    score_only: bool = False


def _token_ids(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_request(body: dict, defaults: SamplingParams | None = None) -> CompletionRequest:
    """A /v1/completions body: its prompts (a string, token ids, or a list of either) and
    SamplingParams (over `defaults` when given)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "'prompt' is required", "prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _token_ids(p) for p in prompt)
    ):
        prompts = prompt
    else:
        raise APIError(
            400,
            "'prompt' must be a string, a non-empty list of token ids (ints), or a non-empty list "
            "of either",
            "prompt",
        )
    if body.get("suffix"):  # OpenAI's insert mode: text after the completion
        raise APIError(
            400,
            "'suffix' is not supported (this model has no fill-in-the-middle mode); leave it out",
            "suffix",
        )
    echo = bool(check_type(body, "echo", (bool,)))
    logprobs = check_type(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(
            400, f"'logprobs' must be an int in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs"
        )
    score_only = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    if score_only and not echo:
        raise APIError(
            400,
            "'max_tokens': 0 generates nothing; it scores the prompt only with 'echo': true "
            "(and 'logprobs' for its token logprobs)",
            "max_tokens",
        )
    kwargs = sampling_params({**body, "max_tokens": 1} if score_only else body, chat=False)
    if defaults is not None and "max_tokens" not in body:
        kwargs["max_tokens"] = None  # the job's default, not OpenAI's 16
    if echo and logprobs is not None:
        kwargs["prompt_logprobs"] = logprobs
    return CompletionRequest(prompts, params_from(kwargs, defaults), echo, score_only)


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
_NO_PARAMETERS = {"type": "object", "properties": {}}


def _function(i: int, tool) -> Function:
    where = f"'tools[{i}]'"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    unknown = sorted(set(tool) - {"type", "function"})
    spec = tool.get("function")
    if unknown or not isinstance(spec, dict):
        raise APIError(
            400, f'{where} must be {{"type": "function", "function": {{...}}}} only', "tools"
        )
    check_keys(spec, ("name", "description", "parameters", "strict"), f"{where}.function", "tools")
    name = spec.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise APIError(
            400,
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
            "tools",
        )
    parameters = spec.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise APIError(
            400,
            f"{where}.function.parameters must be a JSON Schema object "
            f'({{"type": "object", "properties": {{...}}}}), got {parameters!r}',
            "tools",
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.function.description must be a string", "tools")
    return Function(name, parameters, description)


def tool_request(body: dict) -> ToolRequest | None:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = check_type(body, "parallel_tool_calls", (bool,))
    if tools is None:
        if choice not in (None, "none") or parallel is not None:
            name = "tool_choice" if choice is not None else "parallel_tool_calls"
            raise APIError(400, f"'{name}' needs 'tools' (the functions the model may call)", name)
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "'tools' must be a non-empty list of functions", "tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, f"'tools' names a function twice: {names}", "tools")
    forced = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                '\'tool_choice\' must be "auto", "none", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise APIError(
                400,
                f"'tool_choice' names function {name!r}, which is not in 'tools' ({names})",
                "tool_choice",
            )
        choice, forced = "function", functions[names.index(name)]
    elif choice not in ("auto", "none", "required"):
        raise APIError(
            400,
            '\'tool_choice\' must be "auto", "none", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
            "tool_choice",
        )
    return ToolRequest(
        functions,
        choice,
        forced,
        True if parallel is None else parallel,
        additional_properties(body),
    )


# OpenAI's roles. "developer" is the newer models' name for "system", which is what chat
# templates know; "function" (the results of the retired function-calling API) is not taken.
_ROLES = ("system", "developer", "user", "assistant", "tool")
_NON_TEXT_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file",
                   "input_file", "video_url")  # fmt: skip


def message_text(content, where: str, param: str = "messages") -> str | None:
    """A message's content as text: a string, null, or a list of content parts whose text
    parts are joined with newlines (as vLLM joins them); an image, audio or file part is a 400
    (this model reads text only)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NON_TEXT_PARTS:
            raise APIError(
                400,
                f"{where}.content[{j}] is a {kind!r} part; this model takes text only (send "
                "'text' parts or a string)",
                param,
            )
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text", "refusal") or not isinstance(
            text if kind != "refusal" else part.get("refusal"), str
        ):
            raise APIError(
                400,
                f'{where}.content[{j}] must be a text part {{"type": "text", "text": "..."}}, '
                f"got {part!r}",
                param,
            )
        texts.append(text if kind != "refusal" else part["refusal"])
    return "\n".join(texts)


def _message(i: int, m) -> dict:
    """One chat message: {role, content}, an assistant's earlier {tool_calls}, or a
    {role: "tool", tool_call_id, content} result."""
    where = f"'messages[{i}]'"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, f"{where} must be an object with a string 'role'", "messages")
    role = m["role"]
    if role not in _ROLES:
        raise APIError(
            400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", "messages"
        )
    if role == "developer":
        role = "system"
    content = message_text(m.get("content"), where)
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), str)
            for c in calls
        ):
            raise APIError(
                400,
                f'{where}.tool_calls must be a list of {{id, type: "function", function: '
                "{name, arguments (JSON text)}}",
                "messages",
            )
        return {
            "role": role,
            "content": content,
            "tool_calls": [
                {
                    "id": c.get("id") or f"call_{j}",
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"],
                    },
                }
                for j, c in enumerate(calls)
            ],
        }
    if content is None:
        raise APIError(400, f"{where}.content must be a string or a list of text parts",
                       "messages")  # fmt: skip
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise APIError(
                400, f"{where} (a tool result) needs 'tool_call_id', the call's id", "messages"
            )
        return {"role": role, "content": content, "tool_call_id": m["tool_call_id"]}
    return {"role": role, "content": content}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A /v1/chat/completions body, parsed."""

    messages: list[dict]
    params: SamplingParams
    tools: ToolRequest | None
    parser: ToolParser

    @property
    def tool_parser(self) -> ToolParser | None:
        """The parser of the output's tool calls; None when the model may call no tool."""
        return self.parser if self.tools is not None and self.tools.active else None

    def prompt(self, llm) -> dict:
        """The conversation (with its tools) through the model's chat template."""
        return chat_prompt(llm, self.messages, self.tools, self.parser)


def chat_request(
    body: dict, parser: ToolParser, defaults: SamplingParams | None = None
) -> ChatRequest:
    """A /v1/chat/completions body; `parser`: the model's tool-call format."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content}", "messages")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    kwargs = sampling_params(body, chat=True)
    if kwargs["max_tokens"] is None and defaults is None:
        kwargs["max_tokens"] = 256
    tools = tool_request(body)
    constraint = None if tools is None else tools.constraint(parser)
    if constraint is not None:
        if kwargs["structured"] is not None:
            raise APIError(
                400,
                f"'tool_choice': {body['tool_choice']!r} constrains the output to tool calls; "
                "drop the other constraint (response_format, structured_outputs, guided_*) "
                'or use tool_choice "auto"',
                "tool_choice",
            )
        kwargs["structured"] = constraint
    if tools is not None and tools.active and parser.keeps_special_tokens:
        if kwargs["skip_special_tokens"] is None:  # the calls' markers are special tokens
            kwargs["skip_special_tokens"] = False
    return ChatRequest(messages, params_from(kwargs, defaults), tools, parser)


def completion_choices(tokenizer, outputs, n: int, echo: bool = False) -> list[dict]:
    """The choices of a completion; with `echo`, each starts with its prompt's text, tokens
    and logprobs (the first prompt token's null: nothing comes before it)."""
    return [
        {
            "index": i * n + c.index,
            "text": prompt_text(tokenizer, out) + c.text if echo else c.text,
            "logprobs": completion_logprobs(tokenizer, c, out if echo else None),
            "finish_reason": c.finish_reason,
        }
        for i, out in enumerate(outputs)
        for c in out.outputs
    ]


def prompt_text(tokenizer, out) -> str:
    """The prompt as the client sent it (its tokens decoded when it sent token ids)."""
    return out.prompt if isinstance(out.prompt, str) else tokenizer.decode(out.prompt_token_ids)


def scored_only(outputs) -> list:
    """The outputs of a score-only request (``max_tokens: 0``): the token the engine generated
    taken out, so the choices and usage hold the prompt alone."""
    return [
        dataclasses.replace(
            out,
            outputs=[
                dataclasses.replace(
                    c,
                    text="",
                    token_ids=[],
                    logprobs=None if c.logprobs is None else [],
                    cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
                    finish_reason="length",
                    stop_reason=None,
                )
                for c in out.outputs
            ],
        )
        for out in outputs
    ]


def chat_choices(tokenizer, output, num_top: int, tool_parser: ToolParser | None = None):
    """The choices of a chat completion; with `tool_parser`, calls in the text become the
    message's ``tool_calls`` (finish_reason "tool_calls")."""
    choices = []
    for c in output.outputs:
        message = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if tool_parser is not None:
            content, calls = tool_parser.extract(c.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(tokenizer, c, num_top),
                "finish_reason": finish,
            }
        )
    return choices


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


def completion_logprobs(tokenizer, c, echoed=None):
    """/v1/completions' logprobs of one choice (None unless asked); `echoed`: the request's
    output when its prompt is echoed, whose prompt logprobs come first."""
    if c.logprobs is None:
        return None
    ids, entries = list(c.token_ids), list(c.logprobs)
    if echoed is not None:
        ids = echoed.prompt_token_ids + ids
        entries = (echoed.prompt_logprobs or [None] * len(echoed.prompt_token_ids)) + entries
    tokens = [tokenizer.decode([t]) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if e is None else e[t].logprob for t, e in zip(ids, entries, strict=True)
        ],
        "top_logprobs": [
            None if e is None else {tokenizer.decode([k]): v.logprob for k, v in e.items()}
            for e in entries
        ],
        "text_offset": text_offsets(tokenizer, ids, tokens),
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
