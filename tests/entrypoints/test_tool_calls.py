"""Tool-call formats: each parses what its models write (one call, several, after text), leaves
malformed output as content, streams the same calls chunk by chunk without leaking markup, and
builds a grammar whose calls' arguments must match the tools' schemas."""

import copy
import json

import pytest

from jaxgen.engine.params import StructuredOutputs
from jaxgen.engine.processor import Processor
from jaxgen.engine.sample.structured import GrammarCompiler
from jaxgen.entrypoints.tool_calls import (
    FORMATS,
    Function,
    ToolParser,
    ToolRequest,
    chat_prompt,
    format_for_template,
)

WEATHER = Function(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
    "Current weather in a city",
)
ADD = Function(
    "add",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
)
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": {"x": '}"'}})]

# What each family's models write (their chat templates' examples, and vLLM's parser tests).
WRITTEN = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"x": "}\\""}}}\n</tool_call>'
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": {"x": "}\\""}}}'
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "c"}}, {"name": "add", "arguments": {"a": 1, "b": {"x": "}\\""}}}]'
    ),
}
CONTENT = {"hermes": "Let me check.", "llama3_json": None, "mistral": "Let me check."}


@pytest.fixture(scope="module")
def parsers(default_tokenizer):
    return {name: ToolParser(default_tokenizer, name) for name in FORMATS}


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_parses_several_calls_after_content(parsers, name):
    content, calls = parsers[name].extract(WRITTEN[name])
    assert content == CONTENT[name]
    assert calls_of(calls) == CALLS
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rendered_calls_parse_back(parsers, name):
    parser = parsers[name]
    message = [{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in CALLS]
    assert calls_of(parser.extract(parser.render_calls(message))[1]) == CALLS


def test_llama_calls_without_the_python_tag_and_plain_json_answers(parsers):
    parser = parsers["llama3_json"]
    assert calls_of(parser.extract('{"name": "add", "arguments": {"a": 2}}')[1]) == [
        ("add", {"a": 2})
    ]
    # JSON that is not a call, and text that merely mentions braces, stay content.
    for text in ['{"answer": 42}', "The set {1, 2} has two elements."]:
        assert parser.extract(text) == (text, [])


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", "Hello, no tools needed."),
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'),  # no }
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'),  # cut short
        ("hermes", '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call> and then?'),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}} {"name": "add"}'),
        ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}'),  # no ]
        ("mistral", "[TOOL_CALLS] I would call add"),
    ],
)
def test_malformed_calls_stay_content_whole(parsers, name, text):
    assert parsers[name].extract(text) == (text, [])


def stream(parser, text, step):
    """The chunk deltas of `text` fed `step` characters at a time, the last one finishing."""
    s = parser.stream()
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    deltas = [s.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return [d for d in deltas if d], s.called


def reassemble(deltas):
    """What OpenAI's client does with the chunks: content concatenated, each call's id and name
    from its first chunk, its arguments concatenated."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or c.get("id")
            call["name"] = call["name"] or c.get("function", {}).get("name")
            call["arguments"] += c["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streamed_calls_reassemble_to_the_parsed_ones(parsers, name, step):
    text = WRITTEN[name]
    deltas, called = stream(parsers[name], text, step)
    content, calls = reassemble(deltas)
    assert called
    assert content == (CONTENT[name] or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    assert all(c["id"].startswith("call_") for c in calls)
    markers = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "tool_call")
    assert not any(m in content for m in markers)
    if step == 1:  # the name comes before the arguments, and the arguments in pieces
        first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
        assert first["function"] == {"name": "get_weather", "arguments": ""}
        assert sum("tool_calls" in d for d in deltas) > 10


@pytest.mark.parametrize("step", [1, 4])
def test_streamed_plain_text_is_all_content(parsers, step):
    for name, text in [
        ("hermes", "Use the <tool> tag, or <tool_c... never mind.\n"),
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),  # malformed: content after all
        ("llama3_json", "  <|py... plain words"),
        ("mistral", "Arrays look like [1, 2]."),
    ]:
        deltas, called = stream(parsers[name], text, step)
        assert not called and reassemble(deltas) == (text, [])


def test_streamed_keys_in_another_order_come_whole(parsers):
    text = '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>'
    deltas, called = stream(parsers["hermes"], text, 2)
    assert called
    assert [(c["name"], json.loads(c["arguments"])) for c in reassemble(deltas)[1]] == [
        ("add", {"a": 1})
    ]


def test_format_from_the_chat_template():
    assert format_for_template(None) == "hermes"
    assert format_for_template("{{ '<tool_call>' }}") == "hermes"
    assert format_for_template("{{- '<|python_tag|>' }}{{ '<|eom_id|>' }}") == "llama3_json"
    assert format_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    with pytest.raises(ValueError, match="llama3_json"):
        ToolParser(object(), "qwen")


@pytest.fixture(scope="module")
def grammars(default_tokenizer):
    return GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size, {2})


def accepts(grammars, tokenizer, grammar, text) -> bool:
    matcher = grammars.matcher(StructuredOutputs(grammar=grammar))
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammar_takes_calls_whose_arguments_match_the_schema(
    parsers, grammars, default_tokenizer, name
):
    parser = parsers[name]

    def text(*calls):
        return parser.render_calls(
            [{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls]
        )

    paris, two = ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})
    one_of_both = parser.grammar((WEATHER, ADD), parallel=False)
    several = parser.grammar((WEATHER, ADD), parallel=True)
    named = parser.grammar((WEATHER,), parallel=False)
    assert accepts(grammars, default_tokenizer, one_of_both, text(paris))
    assert accepts(grammars, default_tokenizer, one_of_both, text(two))
    assert not accepts(grammars, default_tokenizer, one_of_both, text(paris, two))
    assert accepts(grammars, default_tokenizer, several, text(paris, two, paris))
    assert not accepts(grammars, default_tokenizer, named, text(two))
    for bad in [
        {"unit": "c"},  # "city" is required
        {"city": 3},  # not a string
        {"city": "Paris", "unit": "k"},  # not in the enum
    ]:
        assert not accepts(grammars, default_tokenizer, named, text(("get_weather", bad)))
    assert not accepts(grammars, default_tokenizer, named, "Sure! " + text(paris))


def test_special_token_markers_are_token_ids_in_the_grammar(default_tokenizer):
    """A model whose "[TOOL_CALLS]" is one special token: the grammar names its id (the text
    would spell it with ordinary tokens), and the parser asks to keep it in the text."""
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.backend.add_special_tokens(["[TOOL_CALLS]"])
    token = tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert len(token) == 1
    parser = ToolParser(tokenizer, "mistral")
    assert parser.keeps_special_tokens
    assert parser.grammar((ADD,), parallel=False).startswith(f'start: <[{token[0]}]> "["')
    assert not ToolParser(default_tokenizer, "mistral").keeps_special_tokens


def prompter(tokenizer) -> Processor:
    """What `chat_prompt` uses of an LLM: its `apply_chat_template` (the engine's processor)."""
    return Processor(tokenizer, tokenizer.vocab_size, 4096, eos_ids=[2])


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_prompt_lists_the_tools_when_the_template_does_not(default_tokenizer):
    parser = ToolParser(default_tokenizer)
    assert not parser.template_takes_tools  # SmolLM2's template knows roles and text only
    llm = prompter(default_tokenizer)
    prompt = chat_prompt(llm, CONVERSATION, ToolRequest((WEATHER, ADD)), parser)["prompt"]
    assert prompt.count('"name": "get_weather"') == 2  # listed, and the earlier call
    assert "<tools>" in prompt and "Current weather in a city" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "You are a helpful AI assistant named SmolLM" not in prompt  # ours replaces it
    # tool_choice "none": the tools stay out; a plain conversation renders as before.
    none = chat_prompt(llm, CONVERSATION[:1], ToolRequest((WEATHER,), "none"), parser)
    assert none == llm.apply_chat_template(CONVERSATION[:1])
    system = [{"role": "system", "content": "Be brief."}, CONVERSATION[0]]
    prompt = chat_prompt(llm, system, ToolRequest((WEATHER,)), parser)["prompt"]
    assert "Be brief.\n\nYou are a function calling AI model" in prompt


def test_prompt_through_a_template_that_renders_tools(default_tokenizer):
    tokenizer = copy.copy(default_tokenizer)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}\n{% endfor %}"
    )
    parser = ToolParser(tokenizer)
    assert parser.template_takes_tools
    prompt = chat_prompt(prompter(tokenizer), CONVERSATION, ToolRequest((WEATHER, ADD)), parser)
    assert prompt["prompt"].startswith("TOOLS:get_weather;add;")
    assert "CALL get_weather Paris" in prompt["prompt"]  # arguments reach it as a dict
    assert "tool: 18 C, sunny" in prompt["prompt"]
    assert prompt["prompt_token_ids"] == tokenizer.encode(
        prompt["prompt"], add_special_tokens=False
    )
