"""OpenAI tool calling over a model's own call format (no HTTP here): a request's ``tools``
and ``tool_choice`` (`ToolRequest`, which `protocol` parses from the body), the conversation
rendered with them, the grammar that enforces
``tool_choice: "required"`` or a named function, and the model's text parsed back into
``tool_calls`` (whole, or chunk by chunk while it streams).

Formats (vLLM's parser names):

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call, after any text;
- ``llama3_json`` (Llama 3.1 / 3.2): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several calls separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text.

The format is picked from the chat template's text (``jaxgen serve --tool-call-parser``
overrides it). A template that renders ``tools`` itself gets them; for one that does not (the
embedded SmolLM2's), a system prompt lists the tools and shows the format.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxgen.engine.params import StructuredOutputs
from jaxgen.engine.sample.structured import closed_schema

# Arguments written as the prompt shows them (", " and ": ", no other whitespace): a model
# cannot pad a constrained call with whitespace until max_tokens (llguidance's JSON options).
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    parameters: dict
    description: str | None = None

    def spec(self) -> dict:
        """As OpenAI (and chat templates) spell a tool."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and ``tool_choice``: "auto", "none", "required", or "function"
    (the one named, `forced`); `parallel`: "required" may make several calls."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    forced: Function | None = None
    parallel: bool = True
    additional_properties: bool = False  # `StructuredOutputs.additional_properties`, for args

    @property
    def active(self) -> bool:
        """The model may call tools (they are in its prompt, its output is parsed)."""
        return self.choice != "none"

    def constraint(self, parser: ToolParser) -> StructuredOutputs | None:
        """The grammar that makes the output calls ("required", a named function)."""
        extra = self.additional_properties
        if self.forced is not None:
            return StructuredOutputs(grammar=parser.grammar((self.forced,), False, extra))
        if self.choice == "required":
            return StructuredOutputs(grammar=parser.grammar(self.functions, self.parallel, extra))
        return None


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """How one model family writes its calls. Each field is a tuple of pieces written one
    after another; when parsing, whitespace around a piece is optional.

    begin/end: around all calls; before/after: around each call; between: between calls.
    marker: the piece whose first occurrence starts the calls (the text before it is content);
    at_start: the calls may also start bare (a "{" as the output's first character).
    """

    name: str
    args_key: str
    marker: str
    begin: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    between: tuple[str, ...] = ()
    end: tuple[str, ...] = ()
    at_start: bool = False

    def call_head(self, name_json: str) -> str:
        return f'{{"name": {name_json}, "{self.args_key}": '

    def call_text(self, name_json: str, args_text: str) -> str:
        return self.call_head(name_json) + args_text + "}"

    def join(self, calls: list[str]) -> str:
        sep = "".join(self.after + self.between + self.before)
        body = sep.join(calls)
        return "".join(self.begin + self.before) + body + "".join(self.after + self.end)


FORMATS = {
    f.name: f
    for f in (
        CallFormat(
            "hermes",
            "arguments",
            "<tool_call>",
            before=("<tool_call>", "\n"),
            after=("\n", "</tool_call>"),
            between=("\n",),
        ),
        CallFormat("llama3_json", "parameters", "<|python_tag|>", between=("; ",), at_start=True),
        CallFormat(
            "mistral",
            "arguments",
            "[TOOL_CALLS]",
            begin=("[TOOL_CALLS]", "["),
            end=("]",),
            between=(", ",),
        ),
    )
}


def _pieces_regex(pieces: tuple[str, ...]) -> str:
    words = [re.escape(p.strip()) for p in pieces if p.strip()]
    return r"\s*" + r"\s*".join(words) + r"\s*" if words else r"\s*"


class _JsonEnd:
    """Where the JSON object or array that opens at `start` ends, found by a scan that resumes
    where the last one stopped (a streamed call is read once, not once per delta)."""

    def __init__(self, start: int):
        self.at, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.end: int | None = None

    def find(self, text: str) -> int | None:
        """The end in `text` (a longer text each call); None while the value is open."""
        while self.end is None and self.at < len(text):
            c = text[self.at]
            self.at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.at
        return self.end


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of a message's ``tool_calls``."""
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _template_takes_tools(template: str | None) -> bool:
    """Whether a Jinja chat template reads a ``tools`` variable (renders tools itself)."""
    if template is None:
        return False
    import jinja2
    import jinja2.meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def format_for_template(template: str | None) -> str:
    """The call format a chat template teaches its model (hermes when it shows none)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "<|eom_id|>" in text:
        return "llama3_json"
    return "hermes"


class ToolParser:
    """One model's tool calls: its format, whether its template renders tools, and which of
    the format's markers are special tokens (written as token ids in grammars, and kept in the
    text by ``skip_special_tokens=False`` so they can be parsed).

    Args:
      tokenizer: the model's tokenizer (``chat_template``, ``encode``, ``decode``).
      name: a format of `FORMATS`; None picks one from the chat template.
    """

    def __init__(self, tokenizer, name: str | None = None):
        template = getattr(tokenizer, "chat_template", None)
        name = name or format_for_template(template)
        if name not in FORMATS:
            raise ValueError(f"unknown tool-call parser {name!r}; use one of {sorted(FORMATS)}")
        self.format = FORMATS[name]
        self.template_takes_tools = _template_takes_tools(template)
        self.special_ids: dict[str, int] = {}
        fmt = self.format
        for piece in {p.strip() for p in fmt.begin + fmt.before + fmt.after + fmt.end}:
            ids = tokenizer.encode(piece, add_special_tokens=False) if piece else []
            if len(ids) == 1 and not tokenizer.decode(ids, skip_special_tokens=True):
                self.special_ids[piece] = ids[0]
        self._lead = re.compile(
            (r"\s*(?:" + re.escape(fmt.marker) + r")?" if fmt.at_start else "")
            + _pieces_regex(fmt.begin + fmt.before)
        )
        self._between = re.compile(_pieces_regex(fmt.after + fmt.between + fmt.before))
        self._trail = re.compile(_pieces_regex(fmt.after + fmt.end) + r"$")

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def keeps_special_tokens(self) -> bool:
        return bool(self.special_ids)

    # ------------------------------------------------------------------------------------------
    # Into the prompt
    # ------------------------------------------------------------------------------------------
    def render_calls(self, calls: list[dict]) -> str:
        """An assistant's earlier ``tool_calls`` as the model writes them."""
        return self.format.join(
            [
                self.format.call_text(
                    json.dumps(c["function"]["name"], ensure_ascii=False),
                    c["function"]["arguments"],
                )
                for c in calls
            ]
        )

    def instructions(self, functions: tuple[Function, ...]) -> str:
        """The system prompt of a template that does not render tools (Hermes 2 Pro's words)."""
        tools = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in functions)
        example = self.format.join([self.format.call_text("<function-name>", "<args-json-object>")])
        return (
            "You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist with "
            "the user query. Don't make assumptions about what values to plug into functions. "
            f"Here are the available tools: <tools>\n{tools}\n</tools>\n"
            "For each function call, return a JSON object with the function name and arguments "
            f"as follows:\n{example}"
        )

    # ------------------------------------------------------------------------------------------
    # Enforcing a call
    # ------------------------------------------------------------------------------------------
    def _lark(self, pieces: tuple[str, ...]) -> list[str]:
        out = []
        for piece in pieces:
            if piece.strip() in self.special_ids:
                out.append(f"<[{self.special_ids[piece.strip()]}]>")
            elif piece:
                out.append(json.dumps(piece, ensure_ascii=False))
        return out

    def grammar(
        self, functions: tuple[Function, ...], parallel: bool, additional_properties: bool = False
    ) -> str:
        """A Lark grammar (llguidance's dialect) of one call to any of `functions`, or of one
        or more calls when `parallel`; each call's arguments are ``%json`` of its parameters
        (closed to the properties they name unless `additional_properties`: `closed_schema`)."""
        fmt = self.format
        rules = []
        for i, f in enumerate(functions):
            head = json.dumps(fmt.call_head(json.dumps(f.name, ensure_ascii=False)))
            options = {**_COMPACT_JSON, **f.parameters.get("x-guidance", {})}
            parameters = f.parameters if additional_properties else closed_schema(f.parameters)
            schema = {**parameters, "x-guidance": options}
            rules.append(f'fn{i}: {head} args{i} "}}"')
            rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
        call = " ".join([*self._lark(fmt.before), f"({alternatives})", *self._lark(fmt.after)])
        more = f" ({' '.join([*self._lark(fmt.between), 'call'])})*" if parallel else ""
        start = " ".join([*self._lark(fmt.begin), "call" + more, *self._lark(fmt.end)])
        return "\n".join([f"start: {start}", f"call: {call}", *rules])

    # ------------------------------------------------------------------------------------------
    # Out of the model's text
    # ------------------------------------------------------------------------------------------
    def section_start(self, text: str) -> int | None:
        """Where the calls begin in `text` (the content ends there), if they do."""
        fmt = self.format
        if fmt.at_start:
            stripped = text.lstrip()
            if stripped.startswith(("{", fmt.marker)):
                return len(text) - len(stripped)
            return None
        at = text.find(fmt.marker)
        return None if at < 0 else at

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished output. Output that is not well-formed calls
        stays content, whole."""
        start = self.section_start(text)
        if start is None:
            return text, []
        calls, at = [], start
        lead = self._lead.match(text, at)
        if lead is None:
            return text, []
        at = lead.end()
        decoder = json.JSONDecoder()
        while True:
            try:
                obj, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return text, []
            name, args = self.name_and_args(obj)
            if name is None:
                return text, []
            calls.append(tool_call(name, json.dumps(args, ensure_ascii=False)))
            if self._trail.match(text, at):
                break
            sep = self._between.match(text, at)
            if sep is None:
                return text, []
            at = sep.end()
        content = text[:start].rstrip()
        return content or None, calls

    def name_and_args(self, obj) -> tuple[str | None, dict | None]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, None
        args = obj.get(self.format.args_key, obj.get("arguments", obj.get("parameters")))
        if not isinstance(args, dict):
            return None, None
        return obj["name"], args

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


_NAME_AT = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS_AT = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclasses.dataclass
class _Call:
    index: int
    start: int  # where its "{" is in the text
    id: str = dataclasses.field(default_factory=new_call_id)
    name: str | None = None
    name_end: int | None = None  # where its name's closing quote is, relative to `start`
    args_at: int | None = None  # where its arguments' "{" is, relative to `start`
    sent: int = 0  # characters of the arguments sent
    done: bool = False
    end: _JsonEnd = dataclasses.field(default_factory=lambda: _JsonEnd(0))
    args_end: _JsonEnd | None = None


class ToolCallStream:
    """One choice's text deltas as OpenAI chat-chunk deltas: content until the calls begin
    (held back while it could be the start of a marker), then each call's ``id`` and ``name``
    as soon as the name is complete, and its ``arguments`` as the model writes them. The
    markup itself is never sent."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # content characters sent
        self.section: int | None = None
        self.calls: list[_Call] = []
        self.scan = 0  # where to look for the next call

    @property
    def called(self) -> bool:
        return any(c.name is not None for c in self.calls)

    def feed(self, delta: str, finished: bool) -> dict:
        """The chunk's ``delta`` for this text (empty: nothing to send yet)."""
        self.text += delta
        out: dict = {}
        if self.section is None:
            self.section = self.parser.section_start(self.text)
            if self.section is None:
                cut = len(self.text) if finished else self._safe_end()
                self._content(out, cut)
                return out
            self.scan = self.section
            self._content(out, len(self.text[: self.section].rstrip()))
        calls = self._scan()
        if calls:
            out["tool_calls"] = calls
        if finished and not self.called:  # not calls after all: the text is content
            self._content(out, len(self.text))
        return out

    def _content(self, out: dict, cut: int) -> None:
        if cut > self.sent:
            out["content"] = self.text[self.sent : cut]
            self.sent = cut

    def _safe_end(self) -> int:
        """How much content can go out: not a tail that may begin a marker, nor the
        whitespace before it (the content before calls is sent right-stripped)."""
        fmt, text = self.parser.format, self.text
        if fmt.at_start:
            stripped = text.lstrip()
            if not stripped or fmt.marker.startswith(stripped):
                return 0
            return len(text)
        cut = len(text)
        for k in range(min(len(fmt.marker) - 1, len(text)), 0, -1):
            if text.endswith(fmt.marker[:k]):
                cut -= k
                break
        return len(text[:cut].rstrip())

    def _scan(self) -> list[dict]:
        out = []
        while True:
            call = self.calls[-1] if self.calls and not self.calls[-1].done else None
            if call is None:
                at = self.text.find("{", self.scan)
                if at < 0:
                    return out
                call = _Call(len(self.calls), at)
                self.calls.append(call)
            obj = self.text[call.start :]
            if call.name is None and (m := _NAME_AT.match(obj)):
                call.name_end = m.end()
                self._named(out, call, json.loads(m.group(1)))
            if call.name_end is not None and call.args_at is None:
                args = _ARGS_AT.match(obj, call.name_end)
                if args and obj[args.end() : args.end() + 1] == "{":
                    call.args_at = args.end()
                    call.args_end = _JsonEnd(call.args_at)
            if call.args_end is not None:
                end = call.args_end.find(obj)
                piece = obj[call.args_at + call.sent : len(obj) if end is None else end]
                if piece:
                    call.sent += len(piece)
                    out.append({"index": call.index, "function": {"arguments": piece}})
            end = call.end.find(obj)
            if end is None:
                return out
            call.done, self.scan = True, call.start + end
            self._finish(out, call, obj[:end])

    def _finish(self, out: list[dict], call: _Call, text: str) -> None:
        """A complete call whose name or arguments could not be streamed (keys in another
        order, arguments not an object) goes out whole."""
        try:
            name, args = self.parser.name_and_args(json.loads(text))
        except json.JSONDecodeError:
            return
        if name is None:
            return
        if call.name is None:
            self._named(out, call, name)
        if call.sent == 0:
            out.append(
                {
                    "index": call.index,
                    "function": {"arguments": json.dumps(args, ensure_ascii=False)},
                }
            )

    @staticmethod
    def _named(out: list[dict], call: _Call, name: str) -> None:
        call.name = name
        out.append(
            {
                "index": call.index,
                "id": call.id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )


# ----------------------------------------------------------------------------------------------
# The conversation as a prompt
# ----------------------------------------------------------------------------------------------
def _arguments_as_dicts(message: dict) -> dict:
    """Chat templates read a call's arguments as a dict (transformers' convention); OpenAI
    sends them as JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        try:
            args = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            args = c["function"]["arguments"]
        calls.append({**c, "function": {**c["function"], "arguments": args}})
    return {**message, "tool_calls": calls}


def _as_text(parser: ToolParser, message: dict) -> dict:
    """A message for a template that knows only roles and text: earlier calls in the model's
    format, tool results as a user turn inside <tool_response> (as Qwen 2.5's template)."""
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    if message.get("tool_calls"):
        calls = parser.render_calls(message["tool_calls"])
        content = message.get("content")
        return {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
    return {"role": message["role"], "content": message["content"]}


def chat_prompt(llm, messages: list[dict], tools: ToolRequest | None, parser: ToolParser) -> dict:
    """A conversation as a prompt ({"prompt", "prompt_token_ids"}): with the tools when the
    model may call them, rendered by the chat template when it renders tools, else listed in a
    system prompt (`ToolParser.instructions`)."""
    functions = tools.functions if tools is not None and tools.active else ()
    if not functions and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return llm.apply_chat_template(messages)
    if not parser.template_takes_tools:
        plain = [_as_text(parser, m) for m in messages]
        if functions:
            system = parser.instructions(functions)
            if plain[0]["role"] == "system":
                plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{system}"}
            else:
                plain.insert(0, {"role": "system", "content": system})
        return llm.apply_chat_template(plain)
    return llm.apply_chat_template(
        [_arguments_as_dicts(m) for m in messages], tools=[f.spec() for f in functions] or None
    )
