"""LoRA adapters on the OpenAI server: the official `openai` client against `jaxgen serve
--lora-modules ...` (the command's own wiring, on the tiny model), a request's `model` naming an
adapter, /v1/models, and adapters loaded and unloaded at run time."""

import httpx
import openai
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.server import create_app

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
GREEDY = dict(max_tokens=8, temperature=0)


def tiny_llm(tiny, **kwargs):
    cfg, params, tokenizer = tiny
    kwargs = dict(max_model_len=128, num_kv_pages=64, warmup=False, **kwargs)
    return LLM.from_parts(cfg, params, tokenizer, **kwargs)


@pytest.fixture(scope="module")
def served(tiny, tiny_adapters):
    """(base URL, the LLM it serves): `jaxgen serve --served-model-name tiny --lora-modules
    NAME=PATH ...`, its engine built on the tiny model instead of the default one."""
    import jaxgen.entrypoints.server as server
    from jaxgen.cli import main as cli
    from jaxgen.cli import serve as command
    from jaxgen.cli.options import engine_config

    built = {}

    def make_llm(args, **overrides):  # the command's whole config, on the tiny model
        config = engine_config(
            args, max_model_len=128, num_kv_pages=64, warmup=False, executable_cache=False,
            **overrides,
        )  # fmt: skip
        built["llm"] = LLM.from_parts(*tiny, config=config)
        return built["llm"]

    argv = ["serve", "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-lora-rank", "8"]
    argv += ["--lora-modules", *[f"{name}={path}" for name, path in tiny_adapters.items()]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(command, "make_llm", make_llm)
        patch.setattr(
            server, "serve", lambda llm, host, port, **kw: built.update(app=create_app(llm, **kw))
        )
        assert cli.main(argv) == 0
    with ServerThread(built["app"], free_port()) as url:
        yield url, built["llm"]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0], api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny, tiny_adapters):
    """An engine of the same adapters beside the server's (which its own thread owns)."""
    llm = tiny_llm(tiny, max_num_seqs=4, enable_lora=True, max_lora_rank=8)
    for name, path in tiny_adapters.items():
        llm.load_lora(name, path)
    return llm


def post(served, path, body):
    return httpx.post(served[0].rsplit("/v1", 1)[0] + path, json=body, timeout=60)


def test_models_lists_the_base_and_its_adapters(served, client, tiny_adapters):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", *tiny_adapters]
    for name, path in tiny_adapters.items():
        assert (models[name].root, models[name].parent) == (path, "tiny")
    assert served[1].list_loras() == list(tiny_adapters)


def test_model_names_the_adapter(client, reference, tiny_adapters):
    params = SamplingParams(**GREEDY)
    texts = set()
    for name in ["tiny", *tiny_adapters]:
        lora = None if name == "tiny" else name
        got = client.completions.create(model=name, prompt=PROMPT, **GREEDY)
        want = reference.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text
        assert (got.model, got.choices[0].text) == (name, want)
        texts.add(want)
        chat = client.chat.completions.create(model=name, messages=MESSAGES, **GREEDY)
        want = reference.chat(MESSAGES, params, lora_request=lora)[0].outputs[0].text
        assert (chat.model, chat.choices[0].message.content) == (name, want)
    assert len(texts) == 1 + len(tiny_adapters)  # each adapter changes the text

    name = list(tiny_adapters)[1]
    chunks = list(client.completions.create(model=name, prompt=PROMPT, stream=True, **GREEDY))
    assert {c.model for c in chunks} == {name}
    full = client.completions.create(model=name, prompt=PROMPT, **GREEDY).choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == full


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, **GREEDY)
    assert e.value.code == "model_not_found" and "'tiny'" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, **GREEDY)


def test_load_and_unload_at_run_time(served, client, tiny_adapters):
    first, path = next(iter(tiny_adapters.items()))
    answer = post(served, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": path})
    assert (answer.status_code, answer.text) == (
        200,
        "Success: LoRA adapter 'extra' added successfully.",
    )
    assert "extra" in [m.id for m in client.models.list().data]
    same = [
        client.completions.create(model=m, prompt=PROMPT, **GREEDY).choices[0].text
        for m in ("extra", first)
    ]
    assert same[0] == same[1]

    again = post(served, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": path})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = post(served, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "not a PEFT adapter" in bad.json()["error"]["message"]
    missing = post(served, "/v1/load_lora_adapter", {"lora_name": "bad"})
    assert missing.status_code == 400

    answer = post(served, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert (answer.status_code, answer.text) == (
        200,
        "Success: LoRA adapter 'extra' removed successfully.",
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt=PROMPT, **GREEDY)
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404
    assert client.completions.create(model=first, prompt=PROMPT, **GREEDY).choices[0].text


def test_lora_modules_spec_is_checked_before_loading():
    from jaxgen.cli import main as cli

    assert cli.main(["serve", "--lora-modules", "no-equals-sign"]) == 2
