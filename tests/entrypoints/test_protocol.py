"""Request bodies into SamplingParams: every spelling of an output constraint (OpenAI's
response_format, vLLM's structured_outputs and guided_*), tools and tool_choice, and a 400 that
says what to change for every bad shape."""

import pytest

from jaxgen.engine.params import SamplingParams, StructuredOutputs
from jaxgen.entrypoints import protocol
from jaxgen.entrypoints.protocol import APIError, chat_request, completion_request
from jaxgen.entrypoints.tool_calls import ToolParser

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "Hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA},
}
OTHER = {"type": "function", "function": {"name": "add"}}  # parameters may be left out


@pytest.fixture(scope="module")
def parser(default_tokenizer):
    return ToolParser(default_tokenizer)


def chat(parser, **body):
    return chat_request({"messages": MESSAGES, **body}, parser)


@pytest.mark.parametrize(
    "fields,want",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputs(json=SCHEMA),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            StructuredOutputs(json=SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=SCHEMA)),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
        ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputs(regex="[ab]+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputs(choice=("x", "y"))),
        (
            {"structured_outputs": {"grammar": "start: /a+/"}},
            StructuredOutputs(grammar="start: /a+/"),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
        ({"guided_json": '{"type": "object"}'}, StructuredOutputs(json='{"type": "object"}')),
        ({"guided_regex": "[0-9]+"}, StructuredOutputs(regex="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=("yes", "no"))),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"')),
    ],
)
def test_every_constraint_spelling_on_both_routes(parser, fields, want):
    assert chat(parser, **fields).params.structured == want
    params = completion_request({"prompt": "Hi", **fields}).params
    assert params.structured == want


BAD_CONSTRAINTS = [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "only one"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "only one"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "only one"),
    ({"response_format": "json_object"}, "must be an object with a 'type'"),
    ({"response_format": {"type": "xml"}}, "must be one of 'text', 'json_object'"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "unknown field"),
    ({"response_format": {"type": "json_schema"}}, "under 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "'schema'"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
        "JSON Schema object",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
        "unknown field",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {}, "strict": "yes"},
            }
        },
        "strict' must be a bool",
    ),
    ({"structured_outputs": "json"}, "must be an object with one of"),
    ({"structured_outputs": {"jsonschema": SCHEMA}}, "unknown fields"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"guided_json": 3}, "JSON Schema dict"),
    ({"guided_regex": ""}, "non-empty string"),
    ({"guided_choice": "yes"}, "list of strings"),
    ({"guided_choice": []}, "at least one"),
    ({"guided_grammar": 7}, "non-empty string"),
]


@pytest.mark.parametrize("fields,says", BAD_CONSTRAINTS)
def test_bad_constraints_are_400s_that_say_what_to_change(parser, fields, says):
    for parse in (
        lambda: chat(parser, **fields),
        lambda: completion_request({"prompt": "x", **fields}),
    ):
        with pytest.raises(APIError) as e:
            parse()
        assert e.value.status == 400 and says in e.value.message
        assert e.value.param in fields


def test_batch_defaults_under_a_line_constraint(parser):
    defaults = SamplingParams(max_tokens=7, temperature=0.5)
    request = chat_request({"messages": MESSAGES, "guided_regex": "a+"}, parser, defaults)
    assert request.params.structured == StructuredOutputs(regex="a+")
    assert (request.params.max_tokens, request.params.temperature) == (7, 0.5)


def test_tools_and_tool_choice(parser):
    auto = chat(parser, tools=[TOOL, OTHER])
    assert auto.tools.choice == "auto" and auto.params.structured is None
    assert auto.tool_parser is parser
    assert [f.name for f in auto.tools.functions] == ["get_weather", "add"]
    assert auto.tools.functions[1].parameters == {"type": "object", "properties": {}}
    none = chat(parser, tools=[TOOL], tool_choice="none")
    assert none.tool_parser is None and none.params.structured is None
    assert chat(parser, tool_choice="none").tools is None  # "none" needs no tools
    required = chat(parser, tools=[TOOL, OTHER], tool_choice="required")
    grammar = required.params.structured.grammar
    assert grammar == parser.grammar(required.tools.functions, parallel=True)
    assert "%json" in grammar and "fn1" in grammar
    single = chat(parser, tools=[TOOL, OTHER], tool_choice="required", parallel_tool_calls=False)
    assert single.params.structured.grammar == parser.grammar(single.tools.functions, False)
    named = chat(
        parser,
        tools=[TOOL, OTHER],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    assert named.tools.forced.name == "add"
    assert named.params.structured.grammar == parser.grammar((named.tools.forced,), False)
    # A constraint that leaves the choice to the model goes with tool_choice "auto".
    assert chat(parser, tools=[TOOL], guided_regex="a").params.structured.regex == "a"


BAD_TOOLS = [
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "needs 'tools'"),
    ({"tools": []}, "tools", "non-empty list"),
    ({"tools": TOOL}, "tools", "non-empty list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", '"type": "function"'),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools", '"type": "function"'),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, "tools", "unknown"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        "tools",
        "JSON Schema object",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools",
        "JSON Schema object",
    ),
    ({"tools": [TOOL, TOOL]}, "tools", "twice"),
    ({"tools": [TOOL], "tool_choice": "any"}, "tool_choice", '"auto", "none", "required"'),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", '"required" or'),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "add"}}},
        "tool_choice",
        "not in 'tools'",
    ),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "bool"),
    (
        {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "drop the other constraint",
    ),
    ({"messages": [{"role": "user"}]}, "messages", "content must be a string"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages", "tool_call_id"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        "messages",
        "arguments (JSON text)",
    ),
    ({"messages": []}, "messages", "non-empty list"),
]


@pytest.mark.parametrize("fields,param,says", BAD_TOOLS)
def test_bad_tools_are_400s_that_say_what_to_change(parser, fields, param, says):
    with pytest.raises(APIError) as e:
        chat_request({"messages": MESSAGES, **fields}, parser)
    assert e.value.status == 400 and e.value.param == param
    assert says in e.value.message


def test_conversation_with_earlier_calls(parser):
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    request = chat(
        parser,
        messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
    )
    assert request.messages[1]["tool_calls"] == calls
    assert request.messages[2] == {"role": "tool", "content": "done", "tool_call_id": "c1"}


def test_tool_calls_in_the_response_body(default_tokenizer, parser):
    class Choice:
        index, logprobs, finish_reason = 0, None, "stop"
        text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'

    class Output:
        outputs = [Choice()]

    (with_tools,) = protocol.chat_choices(default_tokenizer, Output(), 0, parser)
    assert with_tools["finish_reason"] == "tool_calls"
    message = with_tools["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": '{"a": 1}',
    }
    (without,) = protocol.chat_choices(default_tokenizer, Output(), 0)
    assert without["message"] == {"role": "assistant", "content": Choice.text}
    assert without["finish_reason"] == "stop"


def test_completions_as_eval_harnesses_send_them():
    """lm-eval's loglikelihood request: token ids, echo, logprobs, one token (or none)."""
    scored = completion_request({"prompt": [[1, 2, 3]], "echo": True, "logprobs": 1,
                                 "max_tokens": 1})  # fmt: skip
    assert scored.prompts == [[1, 2, 3]] and scored.echo and not scored.score_only
    assert (scored.params.prompt_logprobs, scored.params.logprobs) == (1, 1)
    only = completion_request({"prompt": ["a", [4, 5]], "echo": True, "max_tokens": 0})
    assert only.score_only and only.params.max_tokens == 1  # run one token, answer none
    assert only.params.prompt_logprobs is None  # no logprobs asked, none computed
    assert completion_request({"prompt": "a", "logprobs": 20}).params.prompt_logprobs is None


@pytest.mark.parametrize(
    "fields,param,says",
    [
        ({"suffix": "end"}, "suffix", "'suffix' is not supported"),
        ({"max_tokens": 0}, "max_tokens", "'echo': true"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"echo": "yes"}, "echo", "bool"),
        ({"prompt": [[]]}, "prompt", "token ids"),
        ({"prompt": [1.5, 2]}, "prompt", "token ids"),
        ({"prompt": [[1, True]]}, "prompt", "token ids"),
        ({"temperature": 2.5}, "temperature", "[0, 2]"),
    ],
)
def test_bad_completion_fields_name_themselves(fields, param, says):
    with pytest.raises(APIError) as e:
        completion_request({"prompt": "x", **fields})
    assert e.value.status == 400 and e.value.param == param and says in e.value.message


def test_chat_content_parts_roles_and_bounds(parser):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    request = chat(parser, messages=[{"role": "developer", "content": "Be brief."},
                                     {"role": "user", "content": parts}])  # fmt: skip
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nthere"},  # joined as vLLM joins them
    ]
    for message, says in [
        ({"role": "wizard", "content": "hi"}, "role must be one of"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "takes text only",
        ),
        ({"role": "user", "content": [{"type": "input_audio"}]}, "takes text only"),
        ({"role": "user", "content": [{"type": "text"}]}, "must be a text part"),
        ({"role": "user", "content": 3}, "list of content parts"),
    ]:
        with pytest.raises(APIError) as e:
            chat(parser, messages=[message])
        assert e.value.status == 400 and e.value.param == "messages" and says in e.value.message
    with pytest.raises(APIError) as e:
        chat(parser, temperature=5)
    assert e.value.param == "temperature"
    assert chat(parser, temperature=2).params.temperature == 2


def test_stream_options():
    assert protocol.stream_usage({}) == protocol.StreamUsage(False, False)
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert protocol.stream_usage({"stream": True, "stream_options": both}).continuous
    for body in (
        {"stream": True, "stream_options": {"usage": True}},
        {"stream_options": both},
        {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
    ):
        with pytest.raises(APIError):
            protocol.stream_usage(body)


def test_schemas_are_closed_unless_the_request_says(parser):
    from jaxgen.engine.sample.structured import closed_schema

    nested = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                       "c": {"type": "array", "items": {"$ref": "#/$defs/D"}}},
        "$defs": {"D": {"type": "object", "properties": {"e": {"type": "integer"}}}},
        "anyOf": [{"properties": {"f": {}}, "additionalProperties": True}],
    }  # fmt: skip
    closed = closed_schema(nested)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in nested  # the caller's schema is not changed
    assert closed_schema({"type": "object"}) == {"type": "object"}  # names nothing: any object
    spec = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    assert not chat(parser, response_format=spec).params.structured.additional_properties
    opened = chat(parser, response_format=spec, additional_properties=True)
    assert opened.params.structured.additional_properties
    closed_call = chat(parser, tools=[TOOL], tool_choice="required").params.structured.grammar
    open_call = chat(parser, tools=[TOOL], tool_choice="required", additional_properties=True)
    assert '"additionalProperties": false' in closed_call
    assert '"additionalProperties"' not in open_call.params.structured.grammar
