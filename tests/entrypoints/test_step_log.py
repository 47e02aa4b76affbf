"""`serve --step-log`: one JSON line per engine step of a served load, the data `jaxgen bench
disagg` fits its latency model to. The lines account for every prompt token and every decode
row of the requests served, and for the busy time of the steps."""

import json
import threading

import httpx
import numpy as np

from benchmarks.disagg.planner import Padding
from jaxgen import LLM
from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.server import create_app


def test_every_step_of_a_served_load_is_logged(tiny, tmp_path):
    cfg, params, tokenizer = tiny
    # The step shaped by its rows: the one `bench disagg`'s simulator pads (its instances cover
    # new shapes, which selects it).
    llm = LLM.from_parts(cfg, params, tokenizer, warmup=False, max_model_len=256, page_size=8,
                         num_kv_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
                         ragged_step=False)  # fmt: skip
    path = tmp_path / "steps.jsonl"
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 49152, n).tolist() for n in (41, 100, 17)]
    news = (6, 3, 9)
    answers = []

    def complete(url, prompt, n):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/completions", json=body, timeout=300)
        answers.append(r.json()["usage"])

    with ServerThread(create_app(llm, step_log=str(path)), free_port()) as url:
        threads = [threading.Thread(target=complete, args=(url, p, n))
                   for p, n in zip(prompts, news, strict=True)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(a["completion_tokens"] for a in answers) == sorted(news)
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    # Every prompt token is in one prefill chunk, every later token in one decode row (the
    # prefill samples the first); no step went over the budget of 64 tokens, so the
    # 100-token prompt was chunked.
    assert sum(n for s in steps for n, _ in s["chunks"]) == sum(map(len, prompts))
    assert sum(s["decode_rows"] for s in steps) == sum(n - 1 for n in news)
    assert max(s["tokens"] for s in steps) <= 64
    assert any(p > 0 for s in steps for _, p in s["chunks"])  # a chunk after earlier ones
    for s in steps:
        assert s["tokens"] == s["decode_rows"] + sum(n for n, _ in s["chunks"])
        assert s["prefill_rows"] == len(s["chunks"]) and s["seconds"] > 0
        assert s["decode_context"] >= s["decode_rows"]
    # The padded shape each step ran at is the one the simulator's padding rule gives its rows
    # (`planner.Padding`, which `jaxgen bench disagg`'s served latency model is priced with).
    ecfg = llm.engine_cfg
    pad = Padding(ecfg.token_buckets, ecfg.batch_buckets, page_size=8)
    for s in steps:
        want = pad.shape(s["chunks"], s["decode_rows"])
        got = {k: s["shape"][k] for k in ("num_decode", "prefill_rows", "prefill_len")}
        assert got == {k: want[k] for k in got}, s
        # Page tables: at least the rule's width (a sequence holds its whole prompt's pages
        # from admission, and decode rows sent as tables widen them).
        assert s["shape"]["max_pages"] >= want["max_pages"], s
        # The whole program (page-table width and decode page blocks too) is the one the
        # simulator's compile model keys the step by.
        assert (
            sum(s["decode_lens"]) == s["decode_context"]
            and len(s["decode_lens"]) == (s["decode_rows"])
        )
        program = pad.program(s["chunks"], s["prompt_lens"], s["decode_lens"])
        assert program == tuple(s["shape"].values()), s
    # Padding happened (no prompt length here is a token bucket, nor a chunk's remainder).
    assert any(
        s["shape"]["prefill_rows"] * s["shape"]["prefill_len"] > sum(n for n, _ in s["chunks"])
        for s in steps
        if s["chunks"]
    )
    assert steps[0]["compiled"] and not all(s["compiled"] for s in steps)
    # Back-to-back records add up to no more than the wall time they span (overlapping
    # records would count a whole step twice; 20 ms covers when each record's wall-clock time is
    # taken after its step's end).
    assert (
        sum(s["seconds"] for s in steps)
        <= steps[-1]["time"] - steps[0]["time"] + steps[0]["seconds"] + 0.02
    )


def test_an_unwritable_step_log_is_refused_before_loading(capsys, tmp_path):
    from jaxgen.cli.main import main

    assert main(["serve", "--step-log", str(tmp_path / "missing" / "steps.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--step-log" in err and "writable" in err


def test_the_simulator_holds_the_programs_serve_compiles_ahead_of_time(tiny):
    """`bench disagg`'s simulated instances start with the programs `jaxgen serve` compiles
    before it answers /health (`aot.serving_buckets`), keyed as the engine shapes them."""
    from benchmarks.disagg import measure as disagg
    from jaxgen.engine.runner import aot

    cfg, params, tokenizer = tiny
    llm = LLM.from_parts(cfg, params, tokenizer, warmup=False, page_size=disagg.PAGE,
                         max_model_len=disagg.MAX_MODEL_LEN, max_num_seqs=disagg.MAX_NUM_SEQS,
                         num_kv_pages=256, ragged_step=False)  # fmt: skip
    engine = llm.engine
    shapes = [engine.programs.bucket_shape(b, 1) for b in aot.parse_buckets(
        aot.serving_buckets(disagg.MAX_NUM_SEQS))]  # fmt: skip
    fields = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "decode_blocks",
              "prefill_fresh", "num_rows")  # fmt: skip
    engine_keys = {tuple(getattr(s, f) for f in fields) for s in shapes}
    assert engine_keys == disagg.ahead_of_time_programs()


def test_freeze_programs_endpoint(tiny, tmp_path):
    """POST /freeze_programs: the instance stops compiling step programs (the steps of a new
    shape run on a compiled one covering them, logged `covered`) until it is thawed; a body
    that is not {"frozen": bool} is refused and changes nothing."""
    cfg, params, tokenizer = tiny
    llm = LLM.from_parts(cfg, params, tokenizer, warmup=False, max_model_len=256,
                         max_num_seqs=4, ragged_step=False)  # fmt: skip
    path = tmp_path / "steps.jsonl"
    rng = np.random.RandomState(2)
    wide, narrow = rng.randint(3, 49152, 30).tolist(), rng.randint(3, 49152, 6).tolist()

    def complete(url, prompt):
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def steps():
        return [json.loads(line) for line in path.read_text().splitlines()]

    with ServerThread(create_app(llm, step_log=str(path)), free_port()) as url:
        root = url.removesuffix("/v1")
        complete(url, wide)
        bad = httpx.post(f"{root}/freeze_programs", json={"frozen": "yes"}, timeout=60)
        assert bad.status_code == 400 and "frozen" in bad.text
        assert llm.engine.programs.compile_new_shapes
        answer = httpx.post(f"{root}/freeze_programs", timeout=60).json()
        assert answer["frozen"] and answer["programs"] == len(llm.engine._note_program.keys)
        # Every step program, as a step's `shape` is logged (the wide prompt's 1x32 prefill).
        ran = [s["shape"] for s in steps()]
        assert sorted(map(str, answer["shapes"])) == sorted(set(map(str, ran)))
        before = len(steps())
        frozen_text = complete(url, narrow)
        new = steps()[before:]
        # The 1x16 prefill on the 1x32 program; the decode steps at the wide prompt's shape.
        assert new[0]["covered"] and new[0]["shape"]["prefill_len"] == 32
        assert len(new) == 3 and not any(s["compiled"] for s in new)
        thawed = httpx.post(f"{root}/freeze_programs", json={"frozen": False}, timeout=60)
        assert thawed.json()["frozen"] is False
        before = len(steps())
        assert complete(url, narrow) == frozen_text
        assert steps()[before]["compiled"]  # the 1x16 prefill's own program, now
