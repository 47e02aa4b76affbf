"""Disaggregated serving end to end on loopback: a prefill instance and a decode instance (each
`create_app` over its own engine) sharing a real Mooncake Store, behind the router
(`entrypoints.disagg.router`). Greedy answers equal a single instance's; the decode instance
loads the prompts' pages from the store instead of computing them; dead instances are skipped
or reported; a client that goes away frees its pages; no page leaks."""

import asyncio
import contextlib
import json
import threading
import time

import httpx
import numpy as np
import pytest

from jaxgen import LLM
from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.disagg.router import PREFILL_HEADER, RouterError, create_router_app
from jaxgen.entrypoints.mooncake_local import LocalMooncake
from jaxgen.entrypoints.server import create_app

PAGE = 8


def tiny_llm(tiny, **kwargs):
    cfg, params, tokenizer = tiny
    return LLM.from_parts(
        cfg, params, tokenizer, warmup=False, max_model_len=256, page_size=PAGE,
        num_kv_pages=64, max_num_seqs=4, **kwargs,
    )  # fmt: skip


def prompts():
    rng = np.random.RandomState(3)
    return [rng.randint(3, 49152, n).tolist() for n in (41, 64, 90, 57)]


def complete(url, prompt, stream=False, max_tokens=8, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
            **extra}  # fmt: skip
    r = httpx.post(f"{url}/completions", json=body, timeout=300)
    if not stream:
        return r
    text = ""
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


def same_answers(url, single_url):
    """Every prompt through `url` gets a single instance's greedy text and usage (and none of
    the instances' own fields)."""
    for p in prompts():
        want = complete(single_url, p)
        got = complete(url, p)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        assert got.json()["usage"] == want.json()["usage"]
        assert "kv_transfer_params" not in got.json()  # between the router and instances only


def idle(llm, timeout=30.0):
    """Waits until the engine holds no pages (its worker thread frees them)."""
    deadline = time.monotonic() + timeout
    while llm.stats()["pages_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return llm.stats()


@contextlib.contextmanager
def instances(tiny, **kv):
    """Serving on loopback: a single instance, and a prefill and a decode instance whose pages
    move by `kv` (kv_mooncake= or kv_transfer=): ((LLMs), (URLs))."""
    single = tiny_llm(tiny)
    prefill = tiny_llm(tiny, kv_write_through=True, **kv)
    decode = tiny_llm(tiny, **kv)
    with (
        ServerThread(create_app(single), free_port()) as single_url,
        ServerThread(create_app(prefill, role="prefill"), free_port()) as prefill_url,
        ServerThread(create_app(decode, role="decode"), free_port()) as decode_url,
    ):
        yield (single, prefill, decode), (single_url, prefill_url, decode_url)
    prefill.close()
    decode.close()


def test_prefill_and_decode_instances_through_the_router(tiny):
    dead = f"http://127.0.0.1:{free_port()}"  # an instance that never started
    with LocalMooncake(segment_bytes=16 << 20) as store:
        with instances(tiny, kv_mooncake=store.config()) as (
            (single, prefill, decode),
            (single_url, prefill_url, decode_url),
        ):
            app = create_router_app([prefill_url], [dead, decode_url], retry_after_s=60)
            with ServerThread(app, free_port()) as url:
                same_answers(url, single_url)
                # Streaming through the router: the same text.
                p = prompts()[2]
                want = complete(single_url, p).json()["choices"][0]["text"]
                assert complete(url, p, stream=True) == want
                tiers = decode.stats()["kv_tiers"]
                # Every full prompt page but the last came from the store (the last prompt
                # token is always computed): 5 + 7 + 11 + 7 pages; the third prompt's second
                # run found its pages still in the decode instance's pool.
                assert tiers["mooncake_hits"] == 5 + 7 + 11 + 7
                assert decode.stats()["prefix_hit_tokens"] == PAGE * (5 + 7 + 11 + 7 + 11)
                assert prefill.stats()["kv_tiers"]["mooncake_puts"] >= 5 + 8 + 11 + 7
                router = app.state.router
                assert router.counts["retries"] >= 1  # the dead decode URL, skipped
                metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
                assert "jaxgen_router_requests_total 5.0" in metrics
                # Each instance's series carry its role (per-role dashboards).
                own = httpx.get(decode_url.removesuffix("/v1") + "/metrics").text
                hits = float(tiers["mooncake_hits"])
                assert f'jaxgen_kv_tier_hits_total{{tier="mooncake",role="decode"}} {hits}' in own
                assert 'jaxgen_num_requests_waiting{role="decode"}' in own
                assert (
                    'role="prefill"' in httpx.get(prefill_url.removesuffix("/v1") + "/metrics").text
                )
                # A client that goes away mid-stream: the decode instance frees the pages.
                body = {"prompt": prompts()[1], "max_tokens": 200, "temperature": 0.0,
                        "stream": True, "ignore_eos": True}  # fmt: skip
                with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as r:
                    next(r.iter_lines())
                stats = idle(decode)
                assert stats["pages_used"] == 0
                for llm in (prefill, decode):
                    assert idle(llm)["pages_used"] == 0
                    llm.engine.bm.check_invariants()
            # The prefill instance gone: the router says so (503) instead of hanging.
            app = create_router_app([dead], [decode_url])
            with ServerThread(app, free_port()) as url:
                r = complete(url, prompts()[0])
                assert r.status_code == 503 and "no prefill instance" in r.text
                assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503


def test_decode_reads_the_pages_from_the_prefill_instance(tiny):
    """--kv-transfer: no store between the instances. The prefill instance's answer says where
    its transfer engine holds the prompt's pages; the decode instance reads them from there
    into its own pool (Mooncake's transfer engine over TCP on loopback) and computes only the
    last page; a transfer that cannot happen is a recomputation, never a wrong token."""
    with LocalMooncake(segment_bytes=0) as master:  # the transfer engines' metadata server
        with instances(tiny, kv_transfer=master.config()) as (
            (single, prefill, decode),
            (single_url, prefill_url, decode_url),
        ):
            app = create_router_app([prefill_url], [decode_url])
            with ServerThread(app, free_port()) as url:
                same_answers(url, single_url)
                tiers = decode.stats()["kv_tiers"]
                # Every full prompt page but the last was read from the prefill instance.
                assert tiers["transfer_pulls"] == 4 and tiers["transfer_hits"] == 5 + 7 + 11 + 7
                assert decode.stats()["prefix_hit_tokens"] == PAGE * (5 + 7 + 11 + 7)
                assert tiers["transfer_pulled_bytes"] > 0 and tiers["transfer_bad"] == 0
                assert prefill.stats()["kv_tiers"]["transfer_puts"] >= 5 + 8 + 11 + 7
                assert app.state.router.counts["transfers"] == 4
                # Several prompts in one request: every prompt's pages are read (3 + 5).
                rng = np.random.RandomState(9)
                two = [rng.randint(3, 49152, n).tolist() for n in (30, 41)]
                want = complete(single_url, two).json()["choices"]
                assert complete(url, two).json()["choices"] == want
                assert decode.stats()["kv_tiers"]["transfer_hits"] == 30 + 3 + 5
                own = httpx.get(decode_url.removesuffix("/v1") + "/metrics").text
                assert 'jaxgen_kv_transfer_pulled_bytes_total{role="decode"}' in own
            # The prefill instance's answer, by hand, for a prompt the decode instance never saw:
            # where each page is.
            p = np.random.RandomState(8).randint(3, 49152, 75).tolist()
            body = {"prompt": p, "max_tokens": 1, "temperature": 0.0,
                    "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
            answer = httpx.post(f"{prefill_url}/completions", json=body).json()
            params = answer["kv_transfer_params"]
            assert params["session"] == prefill.engine.kv_transfer.session
            assert len(params["blocks"]) == len(p) // PAGE
            # Stale or foreign addresses: each read fails or its blocks are rejected, and the
            # decode instance recomputes the prompt: the same answer, no cached token used.
            want = complete(single_url, p).json()["choices"][0]["text"]
            hits = decode.stats()["prefix_hit_tokens"]
            for i, bad in enumerate((
                {"session": "127.0.0.1:1", "blocks": params["blocks"]},  # no such engine
                {"session": params["session"], "blocks": [[b[0] + 1, *b[1:]] for b in
                                                          params["blocks"]]},  # fmt: skip
            )):  # fmt: skip
                r = complete(decode_url, p, kv_transfer_params=bad)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
                assert decode.stats()["kv_tiers"]["transfer_bad"] == i + 1
                assert decode.stats()["prefix_hit_tokens"] == hits
                decode.engine.reset_prefix_cache()
            # The right addresses: read, then used.
            r = complete(decode_url, p, kv_transfer_params=params)
            assert r.json()["choices"][0]["text"] == want
            assert decode.stats()["prefix_hit_tokens"] == hits + PAGE * (len(p) // PAGE)
            # A malformed field, and blocks sent to an instance without a transfer engine.
            r = complete(decode_url, p, kv_transfer_params={"session": 1})
            assert r.status_code == 400 and "kv_transfer_params" in r.text
            r = complete(single_url, p, kv_transfer_params=params)
            assert r.status_code == 400 and "--kv-transfer" in r.text
            for llm in (prefill, decode, single):
                assert idle(llm)["pages_used"] == 0
                llm.engine.bm.check_invariants()


def test_colocated_instances_are_routed_by_cached_prefix_and_load(tiny):
    """`--role router --instance A B`: a request goes to the instance holding its prompt's
    prefix (it computes only the rest), a prompt nobody holds to the least-loaded one, and a
    busy instance loses the request when load outweighs its cached tokens."""
    a, b = tiny_llm(tiny), tiny_llm(tiny)
    rng = np.random.RandomState(11)
    doc = rng.randint(3, 49152, 96).tolist()
    q = [doc + rng.randint(3, 49152, 24).tolist() for _ in range(3)]
    with (
        ServerThread(create_app(a), free_port()) as a_url,
        ServerThread(create_app(b), free_port()) as b_url,
    ):
        want = complete(a_url, q[1]).json()["choices"][0]["text"]  # a computes q[1] alone
        a.engine.reset_prefix_cache()
        assert complete(b_url, q[0]).status_code == 200  # b now holds the document's pages
        lookup = httpx.post(f"{b_url}/completions/kv_lookup", json={"prompt": q[1]}).json()
        assert lookup == {"prompt_tokens": [120], "cached_tokens": [96], "pending_tokens": 0}
        bad = httpx.post(f"{b_url}/completions/kv_lookup", json={"prompt": q[1], "n": 0})
        assert bad.status_code == 400
        app = create_router_app([], [], instances=[a_url, b_url])
        with ServerThread(app, free_port()) as url:
            router = app.state.router
            before = b.stats()["prefix_hit_tokens"]
            r = complete(url, q[1])
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            assert b.stats()["prefix_hit_tokens"] - before == 96
            assert [i.requests for i in router.instances] == [0, 1]
            assert router.counts["prefix_routed"] == 1 and router.counts["cached_tokens"] == 96
            # A prompt neither holds: the instance with fewer requests so far.
            assert complete(url, rng.randint(3, 49152, 40).tolist()).status_code == 200
            assert [i.requests for i in router.instances] == [1, 1]
            metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
            assert "jaxgen_router_cached_tokens_total 96.0" in metrics
        # b with a request queued (its engine held before the step that would run it): with
        # load weighing 10 per queued token, its 96 cached tokens no longer win.
        gate, step = threading.Event(), b.engine.step
        b.engine.step = lambda: (gate.wait(60), step())[1]
        busy = threading.Thread(target=complete, args=(b_url, rng.randint(3, 49152, 16).tolist()))
        busy.start()
        heavy = create_router_app([], [], instances=[a_url, b_url], load_weight=10.0)
        with ServerThread(heavy, free_port()) as url:
            deadline = time.monotonic() + 30
            while not b.engine.scheduler.waiting and time.monotonic() < deadline:
                time.sleep(0.05)
            answer = httpx.post(f"{b_url}/completions/kv_lookup", json={"prompt": q[2]}).json()
            assert answer["cached_tokens"] == [96] and answer["pending_tokens"] == 16
            assert complete(url, q[2]).status_code == 200
            assert [i.requests for i in heavy.state.router.instances] == [1, 0]
        gate.set()
        busy.join(60)
        b.engine.step = step
        for llm in (a, b):
            assert idle(llm)["pages_used"] == 0
            llm.engine.bm.check_invariants()


def test_router_and_role_errors(tiny):
    with pytest.raises(RouterError, match="at least one --prefill and one --decode"):
        create_router_app([], ["http://127.0.0.1:1"])
    with pytest.raises(RouterError, match="not both"):
        create_router_app(["http://127.0.0.1:1"], [], instances=["http://127.0.0.1:2"])
    with pytest.raises(RouterError, match="must start with http"):
        create_router_app(["127.0.0.1:1"], ["http://127.0.0.1:2"])
    from jaxgen.errors import JaxgenError

    with pytest.raises(JaxgenError, match="kv_write_through writes finished prompts"):
        tiny_llm(tiny, kv_write_through=True)


def dying_instance(after_chunks: int):
    """A stand-in decode instance that streams `after_chunks` chunks, then dies mid-answer
    (the connection breaks without the end of the chunked body)."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        async def events():
            for i in range(after_chunks):
                yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'
            raise ConnectionError("killed")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def ok(request):
        from starlette.responses import JSONResponse

        await asyncio.sleep(0.05)  # a prefill that takes 50 ms
        return JSONResponse({"choices": [{"index": 0, "text": "x"}]})

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/prefill/v1/completions", ok, methods=["POST"]),
    ])  # fmt: skip


def test_a_decode_instance_dying_mid_stream_ends_the_stream_with_an_error():
    with ServerThread(dying_instance(2), free_port()) as stub:
        base = stub.removesuffix("/v1")
        # The stub's /prefill/v1/completions answers as a prefill instance would.
        app = create_router_app([base + "/prefill"], [base])
        with ServerThread(app, free_port()) as url:
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            r = httpx.post(f"{url}/completions", json=body, timeout=60)
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ")]  # fmt: skip
            assert [e["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
            assert "failed mid-stream" in events[-1]["error"]["message"]
            # The answer says how long its prefill hop took (the stub's 50 ms and the hop).
            assert 0.05 <= float(r.headers[PREFILL_HEADER]) < 5.0
            router = app.state.router
            assert router.counts["errors"] == 1
            assert all(i.in_flight == 0 for i in router.instances)


def test_serve_roles_command_line(capsys):
    from jaxgen.cli.main import main
    from jaxgen.entrypoints.disagg.local import instance_argv, parse_layout

    assert main(["serve", "--role", "prefill"]) == 2
    assert "--role prefill needs --kv-transfer CONFIG.json" in capsys.readouterr().err
    assert main(["serve", "--decode", "http://127.0.0.1:1"]) == 2
    assert "add --role router" in capsys.readouterr().err
    assert main(["serve", "--disaggregated", "1P"]) == 2
    assert "xPyD" in capsys.readouterr().err
    assert parse_layout("2p1d") == (2, 1)
    argv = [
        "serve",
        "--model",
        "m",
        "--disaggregated",
        "1P1D",
        "--port",
        "9000",
        "--max-num-seqs",
        "4",
        "--host=0.0.0.0",
        "--prefill",
        "a",
        "b",
        "--dtype",
        "float32",
    ]
    assert instance_argv(argv) == ["--model", "m", "--max-num-seqs", "4", "--dtype", "float32"]
