"""Structured output and tool calling end to end: the official `openai` client against the
server on a tiny random model (real tokenizer), and the same bodies in a batch job. Random
weights write arbitrary JSON: the schemas here (enums, bounded integers, every property
required) keep the outputs short, so what is tested is that the constraint holds."""

import json

import httpx
import jsonschema
import openai
import pytest

from jaxgen import LLM
from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.server import create_app

PET = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "owl"]},
        "ok": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["kind", "ok", "age"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def tiny_llm(tiny):
    cfg, params, tokenizer = tiny
    return LLM.from_parts(cfg, params, tokenizer, max_model_len=512, max_num_seqs=4, warmup=False)


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(create_app(tiny_llm(tiny), model_name="tiny"), free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 80, "temperature": 0, **kwargs}
    return client.chat.completions.create(**kwargs)


def check_calls(calls):
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_response_format_json_schema(client):
    out = chat(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": PET, "strict": True},
        },
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), PET)
    assert out.choices[0].finish_reason == "stop"
    # vLLM's spellings, on /v1/completions too.
    text = client.completions.create(
        model="tiny",
        prompt="Pick one:",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert text.choices[0].text in ("red", "green", "blue")
    guided = chat(client, extra_body={"guided_regex": "[a-c]{2,4}-[0-9]"})
    assert guided.choices[0].message.content[-2] == "-"


def test_tool_choice_named_and_required_are_enforced(client):
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    check_calls(choice.message.tool_calls)
    required = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and required.choices[0].finish_reason == "tool_calls"
    check_calls(calls)


def test_streamed_tool_call_reassembles_to_the_same_call(client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=TOOLS, tool_choice=forced).choices[0].message.tool_calls[0]
    chunks = list(chat(client, tools=TOOLS, tool_choice=forced, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # no markup leaks into the content
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert parts[0].id.startswith("call_") and parts[0].function.name == "get_weather"
    assert all(p.index == 0 for p in parts) and len(parts) > 2  # arguments come in pieces
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert json.loads(arguments) == json.loads(whole.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


BAD = [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, None),  # the grammar engine says why
    ({"guided_json": {"type": "objekt"}}, None),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
]


@pytest.mark.parametrize("fields,param", BAD)
def test_bad_constraints_and_tools_are_400s(server, client, fields, param):
    body = {"model": "tiny", "messages": MESSAGES, **fields}
    response = httpx.post(server + "/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert chat(client, max_tokens=2).choices[0].message.content is not None  # still serving


def test_batch_lines_take_the_same_bodies(tiny, tmp_path):
    def line(custom_id, **body):
        body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, **body}
        return {"custom_id": custom_id, "url": "/v1/chat/completions", "body": body}

    lines = [
        line("pet", response_format={"type": "json_schema", "json_schema": {"schema": PET}}),
        line("tool", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
        line("bad", tools=TOOLS, tool_choice="sometimes"),
        # A flat line gives SamplingParams' own field.
        {
            "id": "flat",
            "prompt": "Yes or no?",
            "max_tokens": 8,
            "structured": {"choice": ["yes", "no"]},
        },
    ]
    jobs = tmp_path / "in.jsonl"
    jobs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = tiny_llm(tiny).generate_file(str(jobs), str(tmp_path / "out.jsonl"), progress=False)
    assert summary["done"] == 3 and summary["bad_lines"] == 1
    with open(summary["errors_file"]) as f:
        assert "tool_choice" in json.loads(f.readline())["error"]
    with open(tmp_path / "out.jsonl") as f:
        got = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in map(json.loads, f)}
    jsonschema.validate(json.loads(got["pet"]["message"]["content"]), PET)
    assert got["flat"]["text"] in ("yes", "no")
    (call,) = got["tool"]["message"]["tool_calls"]
    assert got["tool"]["finish_reason"] == "tool_calls" and call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)
