"""OpenAI's Responses API (POST /v1/responses) over the chat machinery, stateless (no HTTP here).

A Responses body becomes a chat body (`chat_body`): ``input`` (a string, or a list of message,
``function_call`` and ``function_call_output`` items) and ``instructions`` become messages,
``text.format`` becomes ``response_format``, function ``tools`` and ``tool_choice`` the chat
route's; the chat route's parsing, template and constraints then apply unchanged. The model's
text goes back out through `ResponseBuilder`, which turns text deltas into the typed events of
a streamed response (``response.output_text.delta``, ``response.function_call_arguments.delta``,
...) and keeps the output items they describe, so a streamed response and a whole one are built
the same way. Nothing is stored: ``store`` is accepted and ``previous_response_id`` is a 400.
"""

from __future__ import annotations

import copy
import uuid

from jaxgen.entrypoints.protocol import APIError, check_keys, check_type, message_text

RESPONSES_FIELDS = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "store",
    "metadata",
    "user",
    "previous_response_id",
    "truncation",
    # vLLM's extra sampling fields, and jaxgen's `additional_properties` (`protocol`)
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "additional_properties",
}
# Fields that mean the same on both routes and go to the chat body as they are.
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p",
         "repetition_penalty", "seed", "additional_properties")  # fmt: skip
_ROLES = ("user", "system", "developer", "assistant")


def chat_body(body: dict) -> dict:
    """The /v1/chat/completions body that asks what a /v1/responses body asks (400s for what
    this stateless server does not do)."""
    if body.get("previous_response_id") is not None:
        raise APIError(
            400,
            "'previous_response_id' needs stored responses, and this server stores none (it is "
            "stateless); send the earlier turns in 'input' instead",
            "previous_response_id",
        )
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(
            400,
            "'truncation' must be \"disabled\" (an input over the context is a 400)",
            "truncation",
        )
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise APIError(400, "'metadata' must be an object of strings", "metadata")
    check_type(body, "store", (bool,))
    chat = {k: body[k] for k in _SAME if k in body}
    messages = []
    instructions = check_type(body, "instructions", (str,))
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    chat["messages"] = messages
    max_tokens = check_type(body, "max_output_tokens", (int,))
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    response_format = text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("tools") is not None:
        chat["tools"] = [function_tool(i, t) for i, t in enumerate(_list(body, "tools"))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                400,
                '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", '
                '"name": ...}',
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _list(body: dict, name: str) -> list:
    value = body[name]
    if not isinstance(value, list):
        raise APIError(400, f"'{name}' must be a list", name)
    return value


def input_messages(value) -> list[dict]:
    """``input``: a string (one user message) or a list of items: messages ({role, content}
    with a string or input_text parts), the model's earlier ``function_call`` items and their
    ``function_call_output`` results."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, "'input' must be a string or a non-empty list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"'input[{i}]'"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            check_keys(item, ("type", "role", "content", "id", "status"), where, "input")
            content = message_text(item.get("content"), where, "input")
            if content is None:
                raise APIError(400, f"{where}.content must be a string or text parts", "input")
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            check_keys(item, ("type", "call_id", "name", "arguments", "id", "status"), where,
                       "input")  # fmt: skip
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(
                    400, f"{where} (a function_call) needs string call_id, name and arguments",
                    "input",
                )  # fmt: skip
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            check_keys(item, ("type", "call_id", "output", "id", "status"), where, "input")
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise APIError(
                    400, f"{where} (a function_call_output) needs string call_id and output",
                    "input",
                )  # fmt: skip
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:
            raise APIError(
                400,
                f"{where} must be a message ({{role: {', '.join(_ROLES)}, content}}), a "
                f"function_call or a function_call_output item, got {item!r}"[:300],
                "input",
            )
    return messages


def text_format(text) -> dict | None:
    """``text: {"format": ...}`` as the chat route's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise APIError(400, "'text' must be {\"format\": {...}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(
            400, '\'text.format.type\' must be "text", "json_object" or "json_schema"', "text"
        )
    if fmt["type"] != "json_schema":
        check_keys(fmt, ("type",), "'text.format'", "text")
        return {"type": fmt["type"]}
    check_keys(fmt, ("type", "name", "schema", "strict", "description"), "'text.format'", "text")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def function_tool(i: int, tool) -> dict:
    """A Responses function tool ({type, name, parameters, ...}, flat) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(
            400,
            f"'tools[{i}]' is {kind!r}; this server runs function tools only "
            '({"type": "function", "name", "parameters"})',
            "tools",
        )
    check_keys(tool, ("type", "name", "description", "parameters", "strict"), f"'tools[{i}]'",
               "tools")  # fmt: skip
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def echo_fields(body: dict) -> dict:
    """The request's settings a response repeats (OpenAI's response object carries them)."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    tools = body.get("tools") or []
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "store": bool(body.get("store", False)),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": fmt},
        "tool_choice": body.get("tool_choice", "auto" if tools else "none"),
        "tools": tools,
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }


class ResponseBuilder:
    """One response's output items, built from chat-chunk deltas (``content``, ``tool_calls``
    as `tool_calls.ToolCallStream` makes them), with the typed events of a streamed response
    for each step (`events` of each call)."""

    def __init__(self, model: str, fields: dict, created_at: int):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at, self.started = created_at, False
        self.model, self.fields = model, fields
        self.output: list[dict] = []
        self.open_message: dict | None = None  # the message item text goes into, if open
        self.calls: dict[int, dict] = {}  # tool call index -> its function_call item
        self.sequence = 0
        self.status, self.incomplete, self.usage = "in_progress", None, None

    def _event(self, kind: str, **fields) -> dict:
        # A copy: the event is sent after later deltas have changed the builder's items.
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event

    def response(self) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": None,
            "incomplete_details": self.incomplete,
            "model": self.model,
            "output": self.output,
            "usage": self.usage,
            **self.fields,
        }

    def start(self) -> list[dict]:
        """The opening events (once; later calls: none)."""
        if self.started:
            return []
        self.started = True
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, delta: dict) -> list[dict]:
        """Events of one chat delta ({"content": text} and/or {"tool_calls": [...]})."""
        events = self.start()
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        return events

    def _text(self, text: str) -> list[dict]:
        events = []
        item = self.open_message
        if item is None:
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            self.open_message = item
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.output)
                                      - 1, item=item))  # fmt: skip
            item["content"].append({"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []})  # fmt: skip
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0,
                                      part=item["content"][0]))  # fmt: skip
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self.output.index(item), content_index=0,
                                  delta=text, logprobs=[]))  # fmt: skip
        return events

    def _close_message(self) -> list[dict]:
        item = self.open_message
        if item is None:
            return []
        self.open_message = None
        item["status"] = "completed"
        index, part = self.output.index(item), item["content"][0]
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def _call(self, call: dict) -> list[dict]:
        events = self._close_message()  # calls come after the text
        item = self.calls.get(call["index"])
        if item is None:
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                    "status": "in_progress", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": ""}  # fmt: skip
            self.calls[call["index"]] = item
            self.output.append(item)
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item=item,
                )
            )
        piece = call["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.output.index(item),
                                      delta=piece))  # fmt: skip
        return events

    def finish(self, finish_reason: str | None, usage: dict, cached_tokens: int) -> list[dict]:
        """The closing events, with the finished response (`usage`: the chat route's;
        `cached_tokens`: prompt tokens served from the prefix cache). A response cut short by
        ``max_output_tokens`` ends "incomplete", with ``response.incomplete``, as OpenAI's."""
        events = self.start() + self._close_message()
        for item in self.calls.values():
            index = self.output.index(item)
            item["status"] = "completed"
            events += [
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item),
            ]  # fmt: skip
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response())]
