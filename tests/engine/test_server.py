"""The OpenAI-compatible server, driven by the official `openai` client on localhost."""

import asyncio
import json
import re

import httpx
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
