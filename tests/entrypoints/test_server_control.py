"""The server's controls for a training loop in another process (`server.control`): weights
from an orbax checkpoint or a safetensors directory, pause and resume (requests queue), sleep
and wake-up, on the tiny model."""

import threading
import time

import httpx
import jax
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.server import create_app
from jaxgen.model import load_model, save_checkpoint
from tests.helpers import tiny_hf_model

PROMPT = "The capital of France is"
OPTIONS = dict(max_model_len=128, num_kv_pages=64, max_num_seqs=4, warmup=False)


def perturbed(params, seed):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    return jax.tree.map(
        lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), params
    )


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory):
    """{"orbax": checkpoint dir, "safetensors": HF dir} of two other weights for the tiny model,
    and the greedy tokens a fresh engine gives with each."""
    cfg, params, tok = tiny
    root = tmp_path_factory.mktemp("weights")
    save_checkpoint(str(root / "orbax"), cfg, perturbed(params, 1))
    tiny_hf_model(
        str(root / "hf"),
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    paths = {"orbax": str(root / "orbax"), "safetensors": str(root / "hf")}
    want = {}
    for kind, path in paths.items():
        _, p = load_model(path, show_progress=False)
        llm = LLM.from_parts(cfg, p, tok, **OPTIONS)
        want[kind] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
        want[kind] = want[kind].outputs[0].text
    return paths, want


@pytest.fixture(scope="module")
def served(tiny):
    cfg, params, tok = tiny
    llm = LLM.from_parts(cfg, params, tok, **OPTIONS)
    with ServerThread(create_app(llm, model_name="tiny"), free_port()) as url:
        yield url.rsplit("/v1", 1)[0], llm


def call(served, method, path, **kwargs):
    return httpx.request(method, served[0] + path, timeout=120, **kwargs)


def complete(served):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return call(served, "POST", "/v1/completions", json=body)


def test_update_weights_from_orbax_and_safetensors(served, sources):
    paths, want = sources
    version = call(served, "GET", "/weights_version").json()["weights_version"]
    for kind in ("orbax", "safetensors"):
        got = call(served, "POST", "/update_weights", json={"path": paths[kind]})
        assert got.status_code == 200, got.text
        version += 1
        assert got.json()["weights_version"] == version
        assert call(served, "GET", "/weights_version").json() == {"weights_version": version}
        assert complete(served).json()["choices"][0]["text"] == want[kind]
    bad = call(served, "POST", "/update_weights", json={"path": "/no/such/dir"})
    assert bad.status_code == 400 and "no such file" in bad.json()["error"]["message"]
    assert call(served, "POST", "/update_weights", json={"paths": "x"}).status_code == 400
    assert call(served, "GET", "/weights_version").json() == {"weights_version": version}


def wait_for(condition):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_pause_queues_requests_and_resume_runs_them(served, sources):
    engine = served[1].engine
    want = complete(served).json()["choices"][0]["text"]
    assert call(served, "POST", "/pause", json={"mode": "keep"}).json()["paused"] == "keep"
    answers = []
    worker = threading.Thread(target=lambda: answers.append(complete(served)))
    worker.start()
    wait_for(lambda: len(engine.scheduler.waiting) == 1)  # queued, not run
    assert not answers
    assert call(served, "POST", "/resume").json() == {"paused": None}
    worker.join(120)
    assert answers[0].json()["choices"][0]["text"] == want
    # abort: requests are refused until resume.
    assert call(served, "POST", "/pause", json={"mode": "abort"}).status_code == 200
    refused = complete(served)
    assert refused.status_code == 400 and "abort" in refused.json()["error"]["message"]
    assert call(served, "POST", "/pause", json={"mode": "later"}).status_code == 400
    call(served, "POST", "/resume")
    assert complete(served).json()["choices"][0]["text"] == want


def test_sleep_and_wake_up(served, sources):
    paths, want = sources
    assert call(served, "GET", "/is_sleeping").json() == {"is_sleeping": False, "level": 0}
    report = call(served, "POST", "/sleep", json={"level": 2}).json()
    assert report["device_bytes_after"] < report["device_bytes_before"]
    assert call(served, "GET", "/is_sleeping").json() == {"is_sleeping": True, "level": 2}
    refused = call(served, "POST", "/wake_up")
    assert refused.status_code == 400 and "update_weights" in refused.json()["error"]["message"]
    assert call(served, "POST", "/update_weights", json={"path": paths["orbax"]}).status_code == 200
    assert call(served, "POST", "/wake_up").status_code == 200
    assert call(served, "GET", "/is_sleeping").json()["is_sleeping"] is False
    assert complete(served).json()["choices"][0]["text"] == want["orbax"]
