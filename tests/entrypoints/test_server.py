"""The OpenAI-compatible server, driven by the official `openai` client on localhost."""

import asyncio
import json
import re

import httpx
import numpy as np
import openai
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.bench.serve_load import ServerThread, free_port, load
from jaxgen.entrypoints.server import create_app

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    served = LLM(max_num_seqs=8, max_model_len=1024)
    app = create_app(served, api_key=KEY, model_name="default", max_waiting=64)
    with ServerThread(app, free_port()) as url:
        yield url, served, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key=KEY, max_retries=0)


def raw(server, method, path, **kwargs):
    base = server[0].rsplit("/v1", 1)[0]
    headers = kwargs.pop("headers", {"Authorization": f"Bearer {KEY}"})
    return httpx.request(method, base + path, headers=headers, timeout=120, **kwargs)


def pages_used(server) -> float:
    text = raw(server, "GET", "/metrics").text
    return float(re.search(r"^jaxgen_kv_pages_used (\S+)$", text, re.M).group(1))


def test_completion_equals_llm_generate(client, llm):
    prompt = "The three primary colours are"
    got = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    want = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)


def test_chat_equals_llm_chat(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    got = client.chat.completions.create(
        model="default", messages=messages, max_tokens=32, temperature=0
    )
    want = llm.chat(messages, SamplingParams(max_tokens=32, temperature=0))[0].outputs[0]
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"


def test_streaming_concatenates_to_the_full_text(client):
    messages = [{"role": "user", "content": "Name three rivers."}]
    full = (
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=30, temperature=0
        )
        .choices[0]
        .message.content
    )
    chunks = list(
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=30, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="default", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
        )
    )
    assert (
        text
        == client.completions.create(
            model="default", prompt="Once upon a time", max_tokens=12, temperature=0
        )
        .choices[0]
        .text
    )


def test_n_stop_logprobs(client):
    out = client.completions.create(
        model="default", prompt="My favourite animal is", n=3, max_tokens=8, temperature=1.0, seed=4
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    stopped = client.completions.create(
        model="default", prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[","]
    )
    assert stopped.choices[0].finish_reason == "stop" and "," not in stopped.choices[0].text
    lp = client.completions.create(
        model="default", prompt="Hello", max_tokens=4, temperature=0, logprobs=2
    )
    assert len(lp.choices[0].logprobs.token_logprobs) == lp.usage.completion_tokens
    assert all(x <= 0 for x in lp.choices[0].logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model="default",
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_openai_fields_clients_send(client, llm):
    """stream_options.include_usage, logit_bias, text_offset, bytes, vLLM's extensions through
    extra_body, seed, user and max_completion_tokens."""
    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(
        model="default", messages=messages, max_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.choices for c in chunks[:-1])
    streamed = list(
        client.completions.create(
            model="default",
            prompt="One, two,",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 4
    # logit_bias: +100 forces a token; -100 bans the greedy choice.
    forced = client.completions.create(
        model="default", prompt="Hello", max_tokens=3, temperature=0, logit_bias={"42": 100}
    )
    assert forced.choices[0].text == llm.tokenizer.decode([42, 42, 42])
    greedy = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0))[0]
    top = greedy.outputs[0].token_ids[0]
    banned = llm.generate(
        ["Hello"], SamplingParams(max_tokens=1, temperature=0, logit_bias={top: -100})
    )[0]
    served = client.completions.create(
        model="default", prompt="Hello", max_tokens=1, temperature=0, logit_bias={str(top): -100}
    )
    assert banned.outputs[0].token_ids[0] != top
    assert served.choices[0].text == banned.outputs[0].text
    # text_offset: where each token starts in the completion's text.
    text = client.completions.create(
        model="default",
        prompt="The sky is",
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    ).choices[0]
    offsets = text.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == 6
    assert "".join(text.logprobs.tokens) == text.text
    assert all(
        text.text[o:].startswith(t) for o, t in zip(offsets, text.logprobs.tokens, strict=True)
    )
    # bytes: the UTF-8 bytes of each token (and of its alternatives).
    chat = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        seed=3,
        user="readme",
        max_completion_tokens=5,
        extra_body={"top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens <= 5
    assert b"".join(bytes(c.bytes) for c in content).decode() == chat.choices[0].message.content
    assert all(c.top_logprobs[0].bytes is not None for c in content)


def test_bad_logit_bias_and_stream_options(server):
    for body, param in [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, None),
        ({"logit_bias": {"99999999": 1}}, None),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"usage": True}}, "stream_options"),
    ]:
        r = raw(server, "POST", "/v1/completions", json={"prompt": "Hi", **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
        if param:
            assert r.json()["error"]["param"] == param


def test_models_health_metrics_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["default"]
    assert raw(server, "GET", "/health").text == "ok"
    metrics = raw(server, "GET", "/metrics").text
    for name in (
        "jaxgen_requests_total",
        "jaxgen_time_to_first_token_seconds_bucket",
        "jaxgen_num_requests_running",
        "jaxgen_kv_pages_used",
        "jaxgen_prefix_cache_hit_rate",
        "jaxgen_mbu",
        "jaxgen_step_programs",
        "jaxgen_xla_compiles_total",
    ):
        assert name in metrics
    # Every *_total series is a counter (Prometheus' naming rule), and each is typed once.
    types = dict(line.split()[2:4] for line in metrics.splitlines() if line.startswith("# TYPE "))
    assert {"jaxgen_preemptions_total", "jaxgen_generation_tokens_total"} <= set(types)
    assert all(kind == "counter" for name, kind in types.items() if name.endswith("_total"))
    denied = raw(server, "GET", "/v1/models", headers={})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    wrong = raw(server, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


BAD = [
    (b"{not json", 400),
    (b"\xff\xfe\x00garbage", 400),
    (json.dumps({"model": "default", "prompt": "hi", "max_tokens": -3}).encode(), 400),
    (json.dumps({"model": "default", "prompt": "hi", "max_tokens": "ten"}).encode(), 400),
    (json.dumps({"model": "default", "prompt": "hi", "temperature": -1}).encode(), 400),
    (json.dumps({"model": "default", "prompt": "hi", "bogus_field": 1}).encode(), 400),
    (json.dumps({"model": "default", "prompt": "hi " * 3000}).encode(), 400),
    (json.dumps({"model": "default"}).encode(), 400),
    (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404),
    (json.dumps([1, 2, 3]).encode(), 400),
]


@pytest.mark.parametrize("body,status", BAD)
def test_bad_requests_get_json_errors_and_server_survives(server, client, body, status):
    response = raw(
        server,
        "POST",
        "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    ok = client.completions.create(model="default", prompt="Hi", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


def test_huge_prompt_says_context_length(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "word " * 3000}]}
    response = raw(server, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_disconnect_mid_stream_frees_pages(server):
    base = server[0].rsplit("/v1", 1)[0]
    body = {
        "model": "default",
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert pages_used(server) > 0
    for _ in range(100):  # the server notices the disconnect within a poll interval
        if pages_used(server) == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert pages_used(server) == 0


def test_back_pressure_answers_503(server, client):
    worker = server[2].state.worker
    old = worker.max_waiting
    worker.max_waiting = 0
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="default", prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        worker.max_waiting = old
    assert client.completions.create(model="default", prompt="Hi", max_tokens=2).choices


@pytest.mark.slow
def test_bounded_load(server):
    result = asyncio.run(load(server[0], clients=32, seconds=10, max_tokens=16, api_key=KEY))
    assert result["errors"] == [] and result["requests"] >= 32
    assert pages_used(server) == 0


def test_echo_scores_the_prompt_as_transformers_does(server, client, hf_default_model):
    """lm-eval's loglikelihood request (token ids, echo, logprobs, one token) and the score-only
    max_tokens 0: the prompt's logprobs equal transformers' on the same tokens (f32)."""
    import torch

    tokenizer = server[1].tokenizer
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].numpy()
    got = client.completions.create(
        model="default", prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0
    ).choices[0]
    lp = got.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt's, then the generated token's
    np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want, atol=1e-4)
    assert got.text.startswith(tokenizer.decode(ids)) and "".join(lp.tokens) == got.text
    for token, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) in (1, 2) and max(top.values()) >= token  # the best one, and this one
    scored = client.completions.create(
        model="default", prompt=[ids, ids[:5]], max_tokens=0, logprobs=0, echo=True
    )
    first, second = scored.choices
    assert first.text == tokenizer.decode(ids) and first.finish_reason == "length"
    assert first.logprobs.token_logprobs[0] is None  # batched with another prompt: not bitwise
    np.testing.assert_allclose(first.logprobs.token_logprobs[1:], want, atol=1e-4)
    assert len(second.logprobs.token_logprobs) == 5
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(ids) + 5
    streamed = list(
        client.completions.create(
            model="default", prompt="Hello there", max_tokens=3, echo=True, stream=True,
            temperature=0,
        )
    )  # fmt: skip
    whole = client.completions.create(
        model="default", prompt="Hello there", max_tokens=3, echo=True, temperature=0
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.choices[0].text.startswith("Hello there")


def test_chat_content_parts_and_continuous_usage(client, llm):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of Spain?"}]
    got = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    joined = [{"role": "user", "content": "What is the capital\nof Spain?"}]
    want = llm.chat(joined, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert got.choices[0].message.content == want.text
    options = {"include_usage": True, "continuous_usage_stats": True}
    for chunks in (
        list(client.chat.completions.create(model="default", messages=joined, max_tokens=5,
                                            temperature=0, stream=True, stream_options=options)),
        list(client.completions.create(model="default", prompt="One, two,", max_tokens=5,
                                       temperature=0, stream=True, stream_options=options)),
    ):  # fmt: skip
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0


def test_model_lookup_and_utility_routes(server, client):
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    missing = raw(server, "GET", "/v1/models/nope").json()["error"]
    assert missing["code"] == "model_not_found" and missing["param"] == "model"
    tokens = raw(server, "POST", "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == server[1].tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    chat = raw(server, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.json()["count"] > 3  # the chat template's markup too
    text = raw(server, "POST", "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    assert raw(server, "POST", "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert raw(server, "GET", "/version").json()["version"]


def test_openai_bounds(server):
    for body in (
        {"messages": [{"role": "user", "content": "Hi"}], "temperature": 5},
        {"messages": [{"role": "wizard", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": "x"}}]}]},
    ):  # fmt: skip
        r = raw(server, "POST", "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("temperature", "messages")
    suffix = raw(server, "POST", "/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert suffix.status_code == 400 and suffix.json()["error"]["param"] == "suffix"


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
}  # no additionalProperties: the server closes it (the key it names only)


def test_responses_create_text_json_schema_and_tools(client, llm):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip
    got = client.responses.create(
        model="default", instructions="Answer briefly.", input="What is the capital of France?",
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    want = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert got.output_text == want.text and got.object == "response"
    assert got.usage.output_tokens == len(want.token_ids)
    assert got.status == ("incomplete" if want.finish_reason == "length" else "completed")
    items = client.responses.create(
        model="default",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a city."}]}],
        max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(items.output_text)) == {"city"}
    tool = {"type": "function", "name": "get_weather", "parameters": CITY,
            "description": "The weather in a city"}  # fmt: skip
    called = client.responses.create(
        model="default", input="What is the weather in Paris?", tools=[tool],
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=60, temperature=0,
    )  # fmt: skip
    calls = [o for o in called.output if o.type == "function_call"]
    assert (
        calls and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    )
    # The call and its result go back as input items (stateless: the whole conversation).
    again = client.responses.create(
        model="default", tools=[tool], max_output_tokens=8, temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
        ],
    )  # fmt: skip
    assert again.usage.input_tokens > called.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", previous_response_id="resp_1")
    assert "stateless" in str(e.value)


def test_responses_stream_events(client):
    kinds = []
    with client.responses.stream(
        model="default", input="Say hello.", max_output_tokens=48, temperature=0
    ) as stream:
        text = "".join(e.delta for e in stream if kinds.append(e.type) or
                       e.type == "response.output_text.delta")  # fmt: skip
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert final.output_text == text and final.usage.output_tokens > 0
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    with client.responses.stream(
        model="default",
        input="Weather in Rome?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    call = final.output[-1]
    assert call.type == "function_call" and done[0].arguments == call.arguments
    assert set(json.loads(call.arguments)) == {"city"}
