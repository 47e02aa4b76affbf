"""Fault tests of a disaggregated deployment with real instance processes: a prefill and a decode
instance run as `jaxgen serve --role ... --kv-transfer` processes (the victims, SIGKILLed by
pid), beside a prefill and a decode instance in this process (the survivors, whose block
managers the test reads), a real `mooncake_master` (the transfer engines' metadata server), and
the router. Each fault ends its request with an error or re-routes it; the survivors keep
serving with the tokens a single instance gives; no page leaks."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from jaxgen import LLM
from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.disagg.local import stop_processes
from jaxgen.entrypoints.disagg.router import create_router_app, wait_healthy
from jaxgen.entrypoints.mooncake_local import LocalMooncake
from jaxgen.entrypoints.server import create_app
from jaxgen.model.loading import save_checkpoint

pytestmark = pytest.mark.slow

OPTIONS = dict(max_model_len=512, max_num_seqs=4)


def instance(model_dir, role, store_config, log_dir):
    """A `jaxgen serve --role ROLE` process on a free port: (process, base URL)."""
    port = free_port()
    sizes = ["--max-model-len", str(OPTIONS["max_model_len"]),
             "--max-num-seqs", str(OPTIONS["max_num_seqs"])]  # fmt: skip
    cmd = [sys.executable, "-m", "jaxgen.cli", "serve", "--model", model_dir, "--role", role,
           "--kv-transfer", store_config, "--port", str(port), *sizes]  # fmt: skip
    log = open(os.path.join(log_dir, f"{role}.log"), "w")  # noqa: SIM115 (the process holds it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def complete(url, prompt, max_tokens=8, **extra):  # url: http://host:port/v1
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    return httpx.post(f"{url}/completions", json=body, timeout=300)


def text(response):
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def events(lines):
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and
            line != "data: [DONE]"]  # fmt: skip


def idle(llm, timeout=30.0):
    deadline = time.monotonic() + timeout
    while llm.stats()["pages_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    llm.engine.bm.check_invariants()
    return llm.stats()["pages_used"]


def wait_for(condition, timeout=60.0, every=0.001):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def test_killed_instances_and_dropped_clients(tiny, tmp_path):
    cfg, params, tokenizer = tiny
    model_dir = str(tmp_path / "model")
    save_checkpoint(model_dir, cfg, params, tokenizer)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 49152, n).tolist() for n in (450, 61, 130, 77)]
    procs = []
    with LocalMooncake(segment_bytes=0) as store:
        store_config = str(tmp_path / "mooncake.json")
        with open(store_config, "w") as f:
            json.dump(store.config(), f)
        (victim_p, victim_p_url), (victim_d, victim_d_url) = pair = [
            instance(model_dir, role, store_config, str(tmp_path)) for role in ("prefill", "decode")
        ]
        procs += [p for p, _ in pair]
        single = LLM.from_parts(cfg, params, tokenizer, warmup=False, **OPTIONS)
        prefill = LLM.from_parts(cfg, params, tokenizer, warmup=False, kv_transfer=store.config(),
                                 kv_write_through=True, **OPTIONS)  # fmt: skip
        decode = LLM.from_parts(cfg, params, tokenizer, warmup=False, kv_transfer=store.config(),
                                **OPTIONS)  # fmt: skip
        try:
            with (
                ServerThread(create_app(single), free_port()) as single_url,
                ServerThread(create_app(prefill, role="prefill"), free_port()) as prefill_url,
                ServerThread(create_app(decode, role="decode"), free_port()) as decode_url,
            ):
                want = [text(complete(single_url, p)) for p in prompts]
                want_long = text(complete(single_url, prompts[1], 400, ignore_eos=True))
                wait_healthy([victim_p_url, victim_d_url], timeout_s=600)
                # The victim prefill instance's pages of a prompt, asked for by hand: read
                # below, after it is dead.
                orphan = rng.randint(3, 49152, 200).tolist()
                body = {"prompt": orphan, "max_tokens": 1, "temperature": 0.0,
                        "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
                r = httpx.post(f"{victim_p_url}/v1/completions", json=body, timeout=300)
                orphan_params = r.json()["kv_transfer_params"]
                assert len(orphan_params["blocks"]) == 200 // decode.engine.bm.page_size

                # 1. A prefill instance killed with a request in flight to it (before or during
                # its prefill and page writes): the router retries the prefill on the other
                # prefill instance and the answer is right. Placement without prefix lookups is
                # by load, then list order: the victim, listed first, gets the first request.
                app = create_router_app([victim_p_url, prefill_url], [decode_url],
                                        prefix_aware=False, retry_after_s=600)  # fmt: skip
                with ServerThread(app, free_port()) as url:
                    router = app.state.router
                    victim = router.instances[0]
                    answer = {}
                    thread = threading.Thread(
                        target=lambda: answer.update(r=complete(url, prompts[0]))
                    )
                    thread.start()
                    wait_for(lambda: victim.in_flight == 1)
                    victim_p.send_signal(signal.SIGKILL)
                    thread.join(timeout=300)
                    assert text(answer["r"]) == want[0]
                    assert victim.failures == 1 and router.counts["retries"] == 1
                    assert router.instances[1].requests == 1  # the survivor did the prefill
                    # The surviving instances keep serving.
                    assert [text(complete(url, p)) for p in prompts[1:]] == want[1:]
                    assert victim.requests == 1  # marked down: nothing more went to it

                # 1b. Pages to read from the dead prefill instance: the read fails, the decode
                # instance recomputes the prompt, the answer is right.
                bad = decode.stats()["kv_tiers"]["transfer_bad"]
                r = complete(decode_url, orphan, kv_transfer_params=orphan_params)
                assert text(r) == text(complete(single_url, orphan))
                assert decode.stats()["kv_tiers"]["transfer_bad"] == bad + 1

                # 2. A decode instance killed mid-stream: that stream ends with an error event;
                # a stream on the other decode instance at the same time finishes whole, and
                # later requests go to the survivor.
                app = create_router_app([prefill_url], [victim_d_url, decode_url],
                                        prefix_aware=False, retry_after_s=600)  # fmt: skip
                with ServerThread(app, free_port()) as url:
                    router = app.state.router
                    victim = router.instances[1]
                    body = {"prompt": prompts[1], "max_tokens": 400, "temperature": 0.0,
                            "stream": True, "ignore_eos": True}  # fmt: skip
                    lines = {}

                    def stream(key):
                        with httpx.stream("POST", f"{url}/completions", json=body,
                                          timeout=300) as r:  # fmt: skip
                            lines[key] = []
                            for line in r.iter_lines():
                                lines[key].append(line)

                    first = threading.Thread(target=stream, args=("victim",))
                    first.start()
                    wait_for(lambda: len(events(lines.get("victim", []))) >= 3, timeout=300)
                    assert victim.in_flight == 1  # listed first: the first stream is its
                    second = threading.Thread(target=stream, args=("survivor",))
                    second.start()
                    wait_for(lambda: len(events(lines.get("survivor", []))) >= 3, timeout=300)
                    victim_d.send_signal(signal.SIGKILL)
                    first.join(timeout=300)
                    second.join(timeout=300)
                    cut = events(lines["victim"])
                    assert "failed mid-stream" in cut[-1]["error"]["message"]
                    got = "".join(e["choices"][0]["text"] for e in cut[:-1])
                    assert len(cut) > 3 and want_long.startswith(got) and got != want_long
                    whole = events(lines["survivor"])
                    assert [line for line in lines["survivor"] if line][-1] == "data: [DONE]"
                    assert "".join(e["choices"][0]["text"] for e in whole) == want_long
                    assert router.counts["errors"] == 1 and victim.failures == 1
                    assert [text(complete(url, p)) for p in prompts] == want
                    assert all(i.in_flight == 0 for i in router.instances)

                    # 3. A client that drops its connection to the router mid-stream: the router
                    # closes its own to the decode instance, which aborts the request and frees
                    # its pages.
                    with httpx.stream("POST", f"{url}/completions", json=body, timeout=300) as r:
                        lines = r.iter_lines()
                        while len(events([next(lines)])) == 0:
                            pass
                    wait_for(lambda: router.instances[2].in_flight == 0, timeout=60)
                    assert idle(decode) == 0
                    assert text(complete(url, prompts[2])) == want[2]

                # No page leaks on the instances that lived through it all.
                for llm in (prefill, decode, single):
                    assert idle(llm) == 0
        finally:
            stop_processes(procs, timeout_s=10)
            for llm in (single, prefill, decode):
                llm.close()
    assert victim_p.returncode == -signal.SIGKILL and victim_d.returncode == -signal.SIGKILL
