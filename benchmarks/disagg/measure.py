"""`python -m benchmarks disagg` (also `python -m benchmarks.disagg`): measured goodput of a
disaggregated deployment against colocated instances on the same cores, and the simulator's
prediction of both (issue 25's measurements; the projection to GPUs is `benchmarks disagg-sim`).

Deployments, each instance a `jaxgen serve` process pinned to its own core (`taskset`), the
default model in f32, requests through the router (`entrypoints.disagg.router`) in this process:
- disaggregated 1P1D: a prefill instance (core 0) and a decode instance (core 1); the decode
  instance reads the prompts' KV pages out of the prefill instance's memory with Mooncake's
  transfer engine (`--kv-transfer`, TCP on loopback; a `mooncake_master` as metadata server).
- colocated 2x: two instances (cores 0 and 1), chunked prefill, the router's cache-aware
  placement (random prompts: no prefix hits, so it balances queued tokens).

Traces: the two of `benchmarks.disagg.traces` with every length divided by `scale` (CPU-sized,
documented in the output), Poisson arrivals at rates chosen around the simulated goodput, the
same requests in the same order at every rate, every prompt of the run on text of its own.
Each request streams; TTFT is the time to the first text chunk at the client, TPOT (last -
first chunk) / (tokens - 1). Goodput: the highest rate with >= 90% of requests within both
SLOs (linear between measured rates).

The simulator (`benchmarks.disagg.simulator`) runs the same requests with two latency models:
- isolated: profiled on one core in a process of its own (`sim.profile_engine`), with
  the transfer engine's read time per byte measured here (`measure_transfer`);
- served: fitted (`planner.fit_steps`, with its term for prefill rows that read cached
  context) to the steps the deployment's own instances logged
  (`serve --step-log`) during the warm-up replays (one per rate, on other text, then the
  highest rates' again) before the replays it predicts, plus the client-side time outside the
  engines (HTTP hops, tokenizing,
  the router: the clients' TTFT minus the instances' own TTFT and transfer reads) in the
  warm-up at the lowest rate.
Each step is priced as the program that ran it (`planner.Padding.program`, the engine's padded
shape: its own, or a larger compiled one covering it). Before each measured replay the
simulated instances hold the programs the deployment's instances held as it began (those
`jaxgen serve` compiles ahead of time, and every one their step logs show they had run); the
"chained" side instead simulates the instances' programs from the deployment's start (its
warm-ups, then the replays), which the exact timing of every earlier step decides. The
measured replays run on the programs the warm-ups compiled (`FREEZE_REPLAYS`: a step of a new
shape runs on a compiled program covering it), and so do the simulated ones.
KV transfer: the decode instance's bytes read over its seconds reading them, against a host
copy measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import study_env
from jaxgen.bench import harness

SCALE = 8  # CPU-sized traces: the GPU traces' lengths / 8
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 1024
BUDGET = 512  # max_num_batched_tokens (LLM's default): the colocated instances' chunk budget
PAGE = 16
# Requests per rate. With 30 the attainment moved in steps of 3.3%: the 2026-12-05 21:24 run's
# colocated summarization met the 90% target with exactly 27 of 30 at its 4th rate, and one
# request more or less moved that goodput by 17%; the simulated colocated goodputs moved by
# 0-88% with the router's tie-break alone (which instance a long prompt lands on decides which
# short answers its chunks stall). 60 halves the step (the text holds 274k tokens; a run needs
# 245k).
REQUESTS = 60
# Rates: these x the mean of the two deployments' goodputs simulated with the isolated model.
# The run of 2026-12-05 18:28 measured the goodputs at 0.5-0.6x that mean on summarization and
# 0.2-0.27x on chat, where the served model put chat colocated above the highest rate (0.34x).
# The 2026-12-05 23:48 run's chat disaggregated goodput sat between 0.3x and 0.45x (measured)
# and at or above 0.45x (simulated): chat got rates between and above.
RATE_FACTORS = {"summarization": (0.15, 0.22, 0.32, 0.45, 0.6),
                "chat": (0.08, 0.13, 0.2, 0.3, 0.38, 0.47, 0.6)}  # fmt: skip
OVERLAP = True  # jaxgen serve's engines run the overlapped loop (a step planned as the last starts)
# The instances compile their programs themselves (`serve --no-compilation-cache`). With JAX's
# persistent cache on, a program an earlier run had compiled loaded in 0.3-0.7 s and a new one
# compiled in 2.5-3.7 s (the 2026-12-05 21:32 run's replays: 8 of 14 compiled steps one way, 6
# the other), so a compile's cost hung on what earlier runs left on disk: pricing every compile
# at 2.7 s moved the three runs' simulated goodput errors of that day by up to 48 points.
COMPILATION_CACHE = False
# SLOs from the isolated latency model. TTFT: x the trace's longest prompt's prefill alone, so
# that every request can meet it when the deployment is idle (the measured replays at the lowest
# rate take up to 2.6x the isolated model's time there). With a TTFT SLO of 4x the *median*
# prompt's prefill (until 2026-12-05), 2-3 of 30 requests missed it alone: the attainment sat on
# the 90% target at every low rate, and one request more or less moved the goodput across the
# whole rate range.
SLO_TTFT_X = 4.0
SLO_TPOT_X = 3.0  # TPOT SLO: x one decode step at batch 1, median context
WARMUP_REPEATS = 2  # the highest rates' warm-ups run again (new step programs compile there)
# The instances run a step whose program has not compiled yet on a compiled one covering it
# within this factor of its work (`serve --cover-new-shapes`), and compile only when none does;
# the simulator's instances do the same (`simulator.Programs(cover=...)`). A compile stalls an
# instance 1.3-3.8 s here against 0.1-1 s for a step: with 2 (until 2026-12-05 18:28) the
# replays still compiled 0-6 programs per rate, which the simulation mostly did not.
COVER = 4.0
# ... and a step that no compiled program covers within COVER runs on one that covers it at all
# while its own program compiles on a thread beside the loop (`serve --compile-in-background`;
# `simulator.Programs(background=True)`). Without it the 23:48 run's chat disaggregated replay
# at its top rate stalled twice for 2.4-2.5 s compiles on a saturated decode instance: 0.27
# attainment, where the simulation (no compile there) gave 0.90.
COMPILE_IN_BACKGROUND = True
# The measured replays run on the programs the warm-ups compiled (`POST /freeze_programs`,
# `Engine.freeze_programs`; `simulator.Programs.frozen`): a step whose own program has not
# compiled runs on the least-work compiled one covering it and compiles nothing, as a
# CUDA-graph engine pads to a captured size. With compiles in the replays (background, 03:16
# run of 2026-12-06) the simulator's shapes met other programs than the instances' did: chat
# colocated compiled 5 programs at 1.08 req/s where the simulation compiled none (110% off).
FREEZE_REPLAYS = True


def slos(model, lengths):
    """The TTFT and TPOT SLOs of a trace's requests (see SLO_TTFT_X)."""
    from benchmarks.disagg import search

    prompts = [p for p, _ in lengths]
    return search.SLO(
        ttft=SLO_TTFT_X * model.prefill_seconds([(max(prompts), 0)]),
        tpot=SLO_TPOT_X * model.decode_seconds(1, int(np.median(prompts))),
    )


def cpu_traces(scale: int = SCALE) -> dict:
    """The GPU traces with lengths divided by `scale` (answers at least 2 tokens: a TPOT)."""
    from benchmarks.disagg import traces

    def shrink(d, low=1):
        return traces.LogNormal(d.median / scale, d.sigma, max(low, d.low // scale),
                                max(low, d.high // scale))  # fmt: skip

    return {
        name: dataclasses.replace(
            spec,
            prompt=shrink(spec.prompt),
            output=shrink(spec.output, 2),
            description=f"{spec.description}, lengths / {scale}",
        )
        for name, spec in traces.TRACES.items()
    }


# ----------------------------------------------------------------------------------------------
# Latency models (one core, and the served steps) and the transfer engine's read time
# ----------------------------------------------------------------------------------------------
def profile_here(path: str) -> None:
    """Runs in the pinned profiling process: step times of the default model, fitted."""
    from benchmarks.disagg.sim import profile_engine
    from jaxgen import LLM

    llm = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=BUDGET, warmup=False)  # fmt: skip
    prof = profile_engine(
        llm,
        prefill=((1, 16), (1, 64), (1, 256), (1, 512), (2, 128)),
        decode_batches=(1, 4, 8),
        decode_prompt=64,
        decode_tokens=16,
    )
    stats = llm.stats()
    prof["pages_total"] = stats["pages_used"] + stats["pages_free"]
    with open(path, "w") as f:
        json.dump(prof, f)


def profile_pinned(core: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "profile.json")
        cmd = ["taskset", "-c", str(core), sys.executable, "-m", "benchmarks.disagg",
               "--profile-only", path]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=study_env())
        with open(path) as f:
            return json.load(f)


def measure_transfer(config: dict, page_bytes: int, pages=(1, 8, 32), repeats: int = 3) -> dict:
    """Seconds for one engine to read n pages out of another's registered memory with the
    transfer engine (`TransferTier.pull` on loopback: checked blocks, as a decode instance
    reads them), fitted as a + bytes x s_per_byte: the transfer model."""
    from benchmarks.disagg import planner
    from jaxgen.cache.transfer import TransferTier

    capacity = 2 * max(pages) * (page_bytes + 4096)
    sender, receiver = (TransferTier(config, "b" * 24, capacity) for _ in range(2))
    block = (np.ones(page_bytes // 4, np.float32),)
    samples, key = [], 1 << 40
    try:
        for n in pages:
            times = []
            for _ in range(repeats):
                keys = list(range(key, key + n))
                key += n
                for k in keys:
                    sender.put(k, block)
                where = sender.locate(keys)
                t0 = time.perf_counter()
                got = receiver.pull(sender.session, where)
                times.append(time.perf_counter() - t0)
                assert len(got) == n, f"{len(got)} of {n} blocks read back"
            samples.append((n * page_bytes, float(np.median(times))))
    finally:
        sender.close()
        receiver.close()
    fit = planner.fit_transfer(samples)
    return dict(samples=[dict(bytes=b, seconds=s) for b, s in samples], fit=fit.to_dict(),
                gbps=1 / fit.coef[1] / 1e9 if fit.coef[1] > 0 else None)  # fmt: skip


def latency_model(prof: dict, transfer: dict):
    from benchmarks.disagg.planner import LatencyModel

    return LatencyModel(
        prefill=tuple(max(c, 0.0) for c in prof["prefill_fit"]["coef"].values()),
        decode=tuple(max(c, 0.0) for c in prof["decode_fit"]["coef"].values()),
        transfer=tuple(max(c, 0.0) for c in transfer["fit"]["coef"].values()),
        kv_bytes_per_token=prof["kv_bytes_per_token"],
        max_kv_tokens=prof["pages_total"] * PAGE,
        max_num_seqs=MAX_NUM_SEQS,
        max_batched_tokens=BUDGET,
    )


HANDOFF_SIZES = (40, 120, 250, 400, 600)  # prompt tokens the handoff probe sends, one at a time
HANDOFF_COUNTERS = {
    "ttft": "jaxgen_time_to_first_token_seconds_sum",
    "io": "jaxgen_kv_io_seconds_total",
    "pull": "jaxgen_kv_transfer_pull_seconds_total",
}


def probe_handoff(url: str, roles: dict, windows, rounds: int = 2) -> list[dict]:
    """The engines' own time on a handed-off prompt, measured in the disaggregated deployment
    before its warm-ups: prompts of `HANDOFF_SIZES` tokens sent one at a time (an unrecorded
    round first, for the programs to compile), per request the instances' counters moved:
    the prefill instance's TTFT and its page writes (`io`), the decode instance's TTFT (from
    its request to its first token: the read, the checks, loading the pages, the tail step)
    and its transfer reads. `handoff_fits` turns them into the models' `handoff`."""
    from benchmarks.disagg.simulator import Request

    records = []
    for r in range(rounds + 1):
        for n in HANDOFF_SIZES:
            before = {role: {k: metric(u, c) for k, c in HANDOFF_COUNTERS.items()}
                      for role, u in roles.items()}  # fmt: skip
            (res,) = asyncio.run(replay(url, [Request(0.0, n, 2)], [windows(n)]))
            if "error" in res:
                raise RuntimeError(f"handoff probe: a {n}-token prompt failed: {res['error']}")
            moved = {role: {k: metric(u, c) - before[role][k] for k, c in HANDOFF_COUNTERS.items()}
                     for role, u in roles.items()}  # fmt: skip
            if r:
                flat = {f"{role}_{k}": v for role, d in moved.items() for k, v in d.items()}
                records.append(dict(tokens=n, client_ttft=res["ttft"], **flat))
    return records


def handoff_fits(records: list[dict], decode_model) -> dict:
    """`probe_handoff`'s records as (a, b per token moved) of each side, least squares: the
    prefill instance's page writes; the decode instance's TTFT less its transfer reads (the
    link's, simulated apart) and the tail step as `decode_model` prices it."""
    from benchmarks.disagg import planner

    samples = {"prefill": [], "decode": []}
    for r in records:
        n = r["tokens"]
        tail = (n - 1) % PAGE + 1
        samples["prefill"].append((n - tail, r["prefill_io"]))
        own = r["decode_ttft"] - r["decode_pull"] - decode_model.prefill_seconds([(tail, n - tail)])
        samples["decode"].append((n - tail, own))
    out = {}
    for side, pts in samples.items():
        if min(y for _, y in pts) <= 0:  # the fit weights by 1/y: keep it to positive samples
            pts = [(x, y) for x, y in pts if y > 0] or [(0, 1e-6)] * 2
        fit = planner.fit_least_squares([(1.0, x) for x, _ in pts], [y for _, y in pts],
                                        ("a", "per_token"))  # fmt: skip
        out[side] = fit.to_dict()
    return out


# ----------------------------------------------------------------------------------------------
# Deployments
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def deployment(kind: str, transfer_config_path: str, log_dir: str):
    """Yields (router URL, {role: instance URL} (disaggregated), [instance URLs], [instance
    log paths], [instance step-log paths]) of a started deployment; stops it after."""
    from jaxgen.bench.serve_load import ServerThread
    from jaxgen.entrypoints.disagg.local import stop_processes
    from jaxgen.entrypoints.disagg.router import create_router_app, wait_healthy
    from jaxgen.entrypoints.mooncake_local import free_port

    roles = ("prefill", "decode") if kind == "disaggregated" else ("both", "both")
    procs, urls, logs, step_logs = [], [], [], []
    try:
        for core, role in enumerate(roles):
            port = free_port()
            logs.append(os.path.join(log_dir, f"{kind}-{role}-{core}.log"))
            step_logs.append(os.path.join(log_dir, f"{kind}-{role}-{core}.steps.jsonl"))
            cmd = ["taskset", "-c", str(core), sys.executable, "-m", "jaxgen.cli", "serve",
                   "--port", str(port), "--dtype", "float32", "--max-model-len",
                   str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
                   "--step-log", step_logs[-1], "--cover-new-shapes", str(COVER)]  # fmt: skip
            if not COMPILATION_CACHE:
                cmd.append("--no-compilation-cache")
            if COMPILE_IN_BACKGROUND:
                cmd.append("--compile-in-background")
            if role != "both":
                cmd += ["--role", role, "--kv-transfer", transfer_config_path]
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(urls, 1800)
        if kind == "disaggregated":
            app = create_router_app([urls[0]], [urls[1]])
        else:
            app = create_router_app([], [], instances=urls)
        with ServerThread(app, free_port()) as url:
            by_role = dict(zip(roles, urls, strict=True)) if kind == "disaggregated" else {}
            yield url, by_role, urls, logs, step_logs
    finally:
        stop_processes(procs)


async def replay(url: str, requests, prompts) -> list[dict]:
    """Sends each request at its arrival time (streaming); per request: ttft, tpot, error,
    when it was sent (wall clock) and the router's prefill hop (disaggregated)."""
    import httpx

    from jaxgen.entrypoints.disagg.router import PREFILL_HEADER

    async def one(client, req, prompt, t_start):
        await asyncio.sleep(max(0.0, t_start + req.arrival - time.perf_counter()))
        t0, sent = time.perf_counter(), time.time()
        body = {"prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        first = last = hop = None
        tokens = 0
        try:
            async with client.stream("POST", f"{url}/completions", json=body) as r:
                if PREFILL_HEADER in r.headers:  # a disaggregated router's prefill hop
                    hop = float(r.headers[PREFILL_HEADER])
                if r.status_code != 200:
                    body = (await r.aread())[:200]
                    return {"error": f"HTTP {r.status_code}: {body!r}", "sent": sent}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return {"error": event["error"]["message"], "sent": sent}
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and event["choices"][0].get("text"):
                        last = time.perf_counter()
                        first = first or last
        except httpx.HTTPError as e:
            return {"error": repr(e), "sent": sent}
        if first is None or tokens < 2:
            return {"error": f"{tokens} tokens streamed", "sent": sent}
        return {
            "ttft": first - t0,
            "tpot": (last - first) / (tokens - 1),
            "tokens": tokens,
            "sent": sent,
            "prefill": hop,
        }

    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=None)) as c:
        t_start = time.perf_counter() + 0.5
        return await asyncio.gather(
            *(one(c, r, p, t_start) for r, p in zip(requests, prompts, strict=True))
        )


def attainment_of(results, slo) -> float:
    ok = sum(1 for r in results if "error" not in r and r["ttft"] <= slo.ttft
             and r["tpot"] <= slo.tpot)  # fmt: skip
    return ok / len(results)


def crossing(rates, attainments, target: float = 0.9) -> dict:
    """The highest rate with attainment >= target, linear between the last measured rate that
    meets it and the next: {"rps", "bound"} where bound is "=" (a crossing), ">=" (the
    highest rate met it) or "<" (none did). A dip below the target at a lower rate (a step
    shape compiling there) does not hide a higher rate that meets it."""
    pts = sorted(zip(rates, attainments, strict=True))
    met = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not met:
        return {"rps": pts[0][0], "bound": "<"}
    k = met[-1]
    if k == len(pts) - 1:
        return {"rps": pts[-1][0], "bound": ">="}
    (r0, a0), (r1, a1) = pts[k], pts[k + 1]
    return {"rps": r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "bound": "="}


def freeze_programs(urls, frozen: bool) -> list[dict]:
    """Freezes (or thaws) the instances' step programs; per instance its answer: the programs
    it has compiled ("programs") and its step programs' shapes ("shapes")."""
    import httpx

    out = []
    for u in urls:
        answer = httpx.post(u + "/freeze_programs", json={"frozen": frozen}, timeout=60)
        answer.raise_for_status()
        out.append(answer.json())
    return out


def frozen_programs(answers: list[dict]) -> dict:
    """What a warm-up records of `freeze_programs`' answers: the programs each instance held
    ("programs") and its step programs as `Padding.program` keys ("held")."""
    pad = padding()
    return dict(
        programs=[a["programs"] for a in answers],
        held=[sorted(pad.key_of(shape) for shape in a["shapes"]) for a in answers],
    )


def metric(url: str, name: str, *labels: str) -> float:
    """A sample of the instance's /metrics: the series `name` holding every label given."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        series = line.rsplit(" ", 1)[0]
        if series.split("{", 1)[0] == name and all(label in series for label in labels):
            return float(line.split()[-1])
    return 0.0


# ----------------------------------------------------------------------------------------------
def run(scale: int = SCALE, num_requests: int = REQUESTS, seed: int = 0, out=None,
        profile: str | None = None) -> dict:  # fmt: skip
    """`profile`: a latency profile saved by an earlier run (`--profile`) instead of a new one."""
    from benchmarks.disagg import traces
    from benchmarks.disagg.planner import PlanningError
    from benchmarks.disagg.sim import measure_host_copy
    from jaxgen.entrypoints.mooncake_local import LocalMooncake
    from jaxgen.model.loading import load_tokenizer, resolve_source

    result = {"machine": harness.machine_info(), "scale": scale, "requests": num_requests,
              "max_num_seqs": MAX_NUM_SEQS, "budget": BUDGET,
              "cover_new_shapes": COVER, "compilation_cache": COMPILATION_CACHE,
              "compile_in_background": COMPILE_IN_BACKGROUND,
              "freeze_replays": FREEZE_REPLAYS,
              # frozen engines leave prefill rows to the next step rather than compile
              # (`simulator.Programs.defer`: 2, a row is deferred once; 1 in the 16:03 run)
              "defer_prefills": 2}  # fmt: skip
    if profile and os.path.exists(profile):
        with open(profile) as f:
            prof = json.load(f)
    else:
        prof = profile_pinned(0)
        if profile:
            harness.dump_json(prof, profile)
    result["profile"] = prof
    page_bytes = prof["kv_bytes_per_token"] * PAGE
    path = os.path.join(os.path.dirname(__file__), "../../../shared/data/wikitext-2/valid.txt")
    with open(path) as f:
        windows = text_windows(load_tokenizer(resolve_source(None)).encode(f.read()))
    specs = cpu_traces(scale)
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(LocalMooncake(segment_bytes=0))  # metadata server only
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxgen-disagg-"))
        config_path = os.path.join(log_dir, "mooncake.json")
        with open(config_path, "w") as f:
            json.dump(master.config(), f)
        result["transfer_model"] = measure_transfer(master.config(), page_bytes)
        result["host_copy"] = measure_host_copy(page_bytes)
        model = latency_model(prof, result["transfer_model"])
        result["model"] = model.to_dict()
        work = {}
        for name, spec in specs.items():
            lengths = traces.sample_lengths(spec, num_requests, seed)
            gaps = traces.unit_gaps(num_requests, seed)
            slo = slos(model, lengths)
            sim_goodput = {k: simulated_goodput(k, lengths, gaps, slo, model)
                           for k in ("colocated", "disaggregated")}  # fmt: skip
            finite = [g for g in sim_goodput.values() if g is not None]
            if not finite:
                raise PlanningError(
                    f"{name}: the SLOs hold at any rate with {num_requests} requests in the "
                    "simulator: use more requests"
                )
            mid = float(np.mean(finite))
            rates = [round(f * mid, 4) for f in RATE_FACTORS[name]]
            # One set per measured replay and per warm-up, each prompt text no other prompt
            # of the run shares (no prefix is cached anywhere).
            sets = 2 * len(rates) + WARMUP_REPEATS
            prompts = [[windows(p) for p, _ in lengths] for _ in range(sets)]
            work[name] = dict(lengths=lengths, gaps=gaps, slo=slo, rates=rates, prompts=prompts)
            result.setdefault("traces", {})[name] = dict(
                description=spec.description,
                prompt=dataclasses.asdict(spec.prompt),
                output=dataclasses.asdict(spec.output),
                mean_prompt=float(np.mean([p for p, _ in lengths])),
                mean_output=float(np.mean([o for _, o in lengths])),
                slo=dict(ttft=slo.ttft, tpot=slo.tpot, target=slo.target),
                rates=rates,
                simulated_goodput=sim_goodput,
                runs={},
                warmup={},
            )
        served_steps, replay_steps = {}, {}
        for kind in ("colocated", "disaggregated"):
            with deployment(kind, config_path, log_dir) as (url, roles, urls, logs, step_logs):
                if kind == "disaggregated":
                    result["handoff_probe"] = probe_handoff(url, roles, windows)
                steps = served_steps[kind] = [[] for _ in step_logs]
                marks = [0 for _ in step_logs]  # the handoff probe's steps count as warm-ups
                for name, w in work.items():
                    row = result["traces"][name]
                    # Warm-ups: a replay at every rate on other text, so the step shapes of
                    # the same lengths and arrivals compile here (the rest are counted in each
                    # measured replay); the served steps and the client time outside them.
                    warm_runs, overheads = [], []
                    for j, rate in enumerate(w["rates"]):
                        warm = dict(w, prompts=w["prompts"][len(w["rates"]) + j])
                        before = served_counters(urls)
                        warm_runs.append(measure_rate(kind, url, roles, warm, rate, logs))
                        overheads.append(
                            client_overhead(warm_runs[-1]["ttft_s"], before, served_counters(urls))
                        )
                    # The highest rates once more, on text of their own: the step programs
                    # of the busiest batches (the most of them) compile here too.
                    repeats = []
                    for j, rate in enumerate(w["rates"][-WARMUP_REPEATS:]):
                        warm = dict(w, prompts=w["prompts"][2 * len(w["rates"]) + j])
                        repeats.append(measure_rate(kind, url, roles, warm, rate, logs))
                    # The simulator's overhead: the lowest rate's (the path's own cost; queueing
                    # at higher rates is the simulator's to predict).
                    row["warmup"][kind] = dict(
                        attainment=[r["attainment"] for r in warm_runs],
                        compiles=[r["compiles"] for r in warm_runs],
                        repeated_rates=[r["rate"] for r in repeats],
                        repeat_compiles=[r["compiles"] for r in repeats],
                        overhead_per_rate_s=overheads,
                        overhead_s=overheads[0],
                    )
                    for i, path in enumerate(step_logs):
                        steps[i] += read_steps(path, marks[i])
                    if FREEZE_REPLAYS:
                        row["warmup"][kind].update(frozen_programs(freeze_programs(urls, True)))
                    runs, per_rate = [], replay_steps.setdefault(kind, {}).setdefault(name, [])
                    for i, rate in enumerate(w["rates"]):
                        run_w = dict(w, prompts=w["prompts"][i])  # its own text: no prefix hits
                        marks = [line_count(p) for p in step_logs]
                        runs.append(measure_rate(kind, url, roles, run_w, rate, logs))
                        per_rate.append([read_steps(p, marks[k]) for k, p in enumerate(step_logs)])
                        runs[-1]["covered"] = sum(
                            bool(s.get("covered")) for g in per_rate[-1] for s in g
                        )  # fmt: skip
                        runs[-1]["deferred"] = sum(
                            s.get("deferred", 0) for g in per_rate[-1] for s in g
                        )  # fmt: skip
                        brief = {k: v for k, v in runs[-1].items() if not isinstance(v, list)}
                        print({kind: name, **brief}, flush=True)
                        if out:
                            row["runs"][kind] = runs
                            harness.dump_json(result, out)
                    row["runs"][kind] = runs
                    if FREEZE_REPLAYS:  # the next trace's warm-ups compile its shapes
                        freeze_programs(urls, False)
                    marks = [line_count(p) for p in step_logs]  # the next trace's warm-ups
                result.setdefault("step_logs", {})[kind] = [step_summary(p) for p in step_logs]
                result.setdefault("background_compile_s", {})[kind] = [
                    background_compile_seconds(p) for p in logs
                ]
        steps = {"warmup": served_steps, "replays": replay_steps}
        if out:  # the served steps themselves: `--resimulate` refits the served models to them
            save_steps(steps, steps_path(out))
        result["served"] = served_models(served_steps, model, result.get("handoff_probe"))
    resimulate(result, seed, steps)
    if out:
        harness.dump_json(result, out)
    return result


def text_windows(ids: list[int]):
    """A function giving consecutive windows of `ids` of the lengths asked: texts that share no
    prefix. PlanningError once the text runs out."""
    from benchmarks.disagg.planner import PlanningError

    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        if pos + n > len(ids):
            raise PlanningError(f"the text holds {len(ids)} tokens: too few for the prompts")
        pos += n
        return ids[pos - n : pos]

    return take


def line_count(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def read_steps(path: str, skip: int) -> list[dict]:
    """The steps an instance logged after its first `skip` lines (`compiled`: the step
    compiled or loaded its program first; `compiling`: background compiles ran beside it;
    `time`: the wall clock when it was logged; `deferred`: prefill rows it left to the next
    step, frozen)."""
    with open(path) as f:
        lines = f.readlines()[skip:]
    keep = ("time", "seconds", "chunks", "decode_rows", "decode_context", "shape", "compiled",
            "covered", "compiling", "deferred", *HOST_FIELDS)  # fmt: skip
    return [{k: s.get(k) for k in keep} for s in map(json.loads, lines)]


# What an instance logs of its host beside each step (`engine.core.HostClock`; absent from
# logs written before it): CPU seconds of the process, GC pauses, JAX traces and compiles on
# the engine's thread.
HOST_FIELDS = ("cpu_seconds", "gc_seconds", "trace_seconds", "compile_seconds", "jax_compiles",
               "compiled_functions")  # fmt: skip
LONG_STEP_S = 2.0  # `stalls` lists the host beside steps this long that compiled nothing


def plain_steps(steps: list[dict]) -> list[dict]:
    """The steps that ran their own program, compiled before (not compiling it, not on a
    larger one covering them: `COVER`), with the host to themselves (no background compile
    beside them)."""
    return [
        s
        for s in steps
        if not s.get("compiled") and not s.get("covered") and not s.get("compiling")
    ]


def steps_path(out: str) -> str:
    return os.path.splitext(out)[0] + "_steps.json.gz"


def save_steps(served_steps: dict, path: str) -> None:
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump(served_steps, f, separators=(",", ":"))


def load_steps(path: str) -> dict:
    """{"warmup": {deployment: [steps per instance]}, "replays": {deployment: {trace: [[steps
    per instance] per rate]}}} (a file from before the replays were kept: warm-ups only)."""
    import gzip

    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data if "warmup" in data else {"warmup": data, "replays": {}}


def padding():
    """The step shapes of the deployments' engines (`planner.Padding` of their buckets)."""
    from benchmarks.disagg.planner import Padding
    from jaxgen.engine.config import EngineConfig

    ecfg = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
    return Padding(ecfg.token_buckets, ecfg.batch_buckets, PAGE)


def ahead_of_time_programs(pad=None) -> set:
    """The programs (`Padding.program` keys) each instance compiles before it answers /health:
    `jaxgen serve`'s `aot.serving_buckets` (prefill buckets: one fresh prompt of that length;
    decode buckets: that many rows at that context)."""
    from jaxgen.engine.runner import aot

    pad = pad or padding()
    return {
        pad.program([(b.size, 0)], [b.size], []) if b.kind == "prefill"
        else pad.program([], [], [b.context] * b.size)
        for b in aot.parse_buckets(aot.serving_buckets(MAX_NUM_SEQS))
    }  # fmt: skip


def deployed_programs(steps: dict, kind: str, before: float) -> dict[int, set]:
    """Per instance of deployment `kind`, the programs its step logs show it had run before
    wall-clock time `before` (warm-ups and earlier replays; a covered step's is the larger
    program it ran on): with `ahead_of_time_programs`, the programs it held then."""
    pad = padding()
    groups = [list(g) for g in steps["warmup"][kind]]
    for per_rate in steps["replays"].get(kind, {}).values():
        for per_instance in per_rate:
            for i, g in enumerate(per_instance):
                groups[i] += g
    return {
        i: {pad.key_of(s["shape"], s["chunks"], s["decode_rows"]) for s in g
            if s.get("shape") and s["time"] < before}
        for i, g in enumerate(groups)
    }  # fmt: skip


def shape_agreement(steps, pad) -> float:
    """The share of logged steps whose padded shape (the engine's own, logged) is the one
    `pad` gives for their rows: how faithfully the simulator's padding follows the engine's."""
    keys = ("num_decode", "prefill_rows", "prefill_len")  # the page-table width: see Padding
    logged = [s for s in steps if s.get("shape")]
    same = 0
    for s in logged:
        want = pad.shape(s["chunks"], s["decode_rows"])
        same += all(want[k] == s["shape"][k] for k in keys)
    return same / len(logged) if logged else 0.0


def step_summary(path: str) -> dict:
    """An instance's whole step log: how many steps compiled (or loaded) a program, and the
    median seconds of those and of the others."""
    with open(path) as f:
        steps = [json.loads(line) for line in f]
    compiled = [s["seconds"] for s in steps if s["compiled"]]
    other = [s["seconds"] for s in steps if not s["compiled"]]
    return dict(steps=len(steps), compiled=len(compiled),
                compiled_median_s=float(np.median(compiled)) if compiled else None,
                other_median_s=float(np.median(other)) if other else None)  # fmt: skip


def served_counters(urls) -> dict:
    """Summed over the instances: their own TTFT (sum, count) and transfer reads."""
    out = dict(ttft_sum=0.0, ttft_count=0.0, pulls=0.0, pull_seconds=0.0, pulled_bytes=0.0)
    for u in urls:
        out["ttft_sum"] += metric(u, "jaxgen_time_to_first_token_seconds_sum")
        out["ttft_count"] += metric(u, "jaxgen_time_to_first_token_seconds_count")
        out["pulls"] += metric(u, "jaxgen_kv_transfer_pulls_total")
        out["pull_seconds"] += metric(u, "jaxgen_kv_transfer_pull_seconds_total")
        out["pulled_bytes"] += metric(u, "jaxgen_kv_transfer_pulled_bytes_total")
    return out


def client_overhead(ttfts, before: dict, after: dict) -> float:
    """Mean client TTFT minus what the instances account for: their own mean TTFT (queue and
    steps; a disaggregated request has one at each instance, so it is summed per request) and
    the mean transfer read, which happens between the two. Not below 0."""
    d = {k: after[k] - before[k] for k in after}
    done = [t for t in ttfts if t is not None]
    if not done or not d["ttft_count"]:
        return 0.0
    per_instance = d["ttft_sum"] / d["ttft_count"]
    hops = d["ttft_count"] / len(ttfts)  # 1 colocated, 2 disaggregated (prefill and decode)
    pull = d["pull_seconds"] / len(ttfts)
    return max(0.0, float(np.mean(done)) - hops * per_instance - pull)


def served_models(served_steps: dict, model, handoff_probe: list | None = None) -> dict:
    """Per deployment, the latency model fitted to its instances' logged steps (colocated: both
    instances' steps; disaggregated: the prefill and the decode instance's each) as the engines
    padded them (`padding`), with the isolated model's transfer and sizes; its compile model
    fitted to the steps that compiled their program (with at least 5 of them). Also the fit of
    the rows as they are (`fits_unpadded`, for comparison) and the padding rule's agreement
    with the logged shapes. With `handoff_probe` (`probe_handoff`'s records), the
    disaggregated instances' models get their `handoff` (`handoff_fits`)."""
    from benchmarks.disagg import planner
    from benchmarks.disagg.planner import LatencyModel

    pad = padding()
    skip = ("prefill", "decode", "compile", "handoff", "cached_pair")  # the fit's own terms
    sizes = {k: v for k, v in model.to_dict().items() if k not in skip}
    sizes["padding"] = pad
    out = {}
    for kind, per_instance in served_steps.items():
        if kind == "colocated":
            groups = ([s for steps in per_instance for s in steps],)
        else:
            groups = per_instance  # (prefill, decode)
        plain = [plain_steps(g) for g in groups]
        compiled = [[s for s in g if s.get("compiled")] for g in groups]
        fits = [planner.fit_steps(g, pad, cached=True) for g in plain]
        compile_fits = [planner.fit_steps(c, pad) if len(c) >= 5 else None for c in compiled]
        models = [
            LatencyModel.from_steps(f, **sizes, compile=c.coef if c else ())
            for f, c in zip(fits, compile_fits, strict=True)
        ]
        # The share of the core a step kept beside a background compile, fitted per instance
        # group to its steps that ran beside one (with at least 5; else the fair share).
        shares = [planner.fit_background_share(g, m) for g, m in zip(groups, models, strict=True)]
        models = [m if f is None else dataclasses.replace(m, background_share=f)
                  for m, f in zip(models, shares, strict=True)]  # fmt: skip
        handoff = None
        if kind == "disaggregated" and handoff_probe:
            handoff = handoff_fits(handoff_probe, models[1])
            models = [dataclasses.replace(m, handoff=tuple(handoff[side]["coef"].values()))
                      for m, side in zip(models, ("prefill", "decode"), strict=True)]  # fmt: skip
        out[kind] = dict(
            handoff_fits=handoff,
            fits=[f.to_dict() for f in fits],
            fits_unpadded=[planner.fit_steps(g).to_dict() for g in plain],
            compile_fits=[c.to_dict() if c else None for c in compile_fits],
            models=[m.to_dict() for m in models],
            steps=[len(g) for g in plain],
            compiled_steps=[len(c) for c in compiled],
            background_shares=shares,
            compiling_steps=[sum(bool(s.get("compiling")) for s in g) for g in groups],
            shape_agreement=[shape_agreement(g, pad) for g in plain],
        )
    return out


def simulate(kind: str, requests, models, overhead: float = 0.0, programs=None):
    """The simulator's run of the deployment: 2 colocated instances, or 1P1D where the decode
    instance computes each prompt's last partial page (as jaxgen's instances do). `models`:
    one latency model, or the (prefill, decode) instances' models. `programs`: the instances'
    compiled programs (`simulator.Programs`, carried over and updated; None: none yet)."""
    from benchmarks.disagg import simulator

    models = (models,) if not isinstance(models, (tuple, list)) else models
    if kind == "colocated":
        return simulator.simulate_colocated(
            requests, models[0], 2, overhead, programs, overlap=OVERLAP
        )  # fmt: skip
    return simulator.simulate_disaggregated(
        requests, models[0], models[-1], tail_page=PAGE, overhead=overhead,
        chunked_prefill=True, programs=programs, overlap=OVERLAP,
    )  # fmt: skip


def simulated_goodput(kind: str, lengths, gaps, slo, models, overhead: float = 0.0,
                      programs=None):  # fmt: skip
    """The simulator's goodput (req/s); None when the SLOs hold at any rate (few requests).
    `programs`: compiled before every rate tried (each starts from a copy)."""
    from benchmarks.disagg import search, simulator, traces
    from benchmarks.disagg.planner import PlanningError

    def attainment(rate: float) -> float:
        reqs = traces.poisson_requests(lengths, rate, gaps)
        known = programs.copy() if programs is not None else None
        outs = simulate(kind, reqs, models, overhead, known)
        return simulator.attainment(outs, slo.ttft, slo.tpot)

    try:
        return search.max_rate(attainment, slo.target, start=2.0)
    except PlanningError:
        return None


def measure_rate(kind: str, url: str, roles: dict, w: dict, rate: float, logs) -> dict:
    """One replay of a trace at `rate` through the deployment; `compiles`: step shapes the
    instances compiled during the replay (their logs). The simulated side: `resimulate`."""
    from benchmarks.disagg import traces

    reqs = traces.poisson_requests(w["lengths"], rate, w["gaps"])
    compiled = compile_count(logs)
    before = transfer_counters(roles)
    t0 = time.perf_counter()
    results = asyncio.run(replay(url, reqs, w["prompts"]))
    wall = time.perf_counter() - t0
    settle_compiles(logs)
    after = transfer_counters(roles)
    compiled = compile_count(logs) - compiled
    ok = [r for r in results if "error" not in r]
    return dict(
        rate=rate,
        wall_s=wall,
        compiles=compiled,
        attainment=attainment_of(results, w["slo"]),
        errors=[r["error"] for r in results if "error" in r],
        ttft_p50_s=float(np.median([r["ttft"] for r in ok])) if ok else None,
        tpot_p50_s=float(np.median([r["tpot"] for r in ok])) if ok else None,
        ttft_s=[r.get("ttft") for r in results],
        tpot_s=[r.get("tpot") for r in results],
        sent=[r["sent"] for r in results],  # wall clock, as the instances' step logs stamp steps
        prefill_s=[r.get("prefill") for r in results],  # disaggregated: the router's prefill hop
        transfer={k: after[k] - before[k] for k in after},
    )


def settle_compiles(logs, timeout: float = 120.0) -> None:
    """Returns once every background compile the instances' logs show started has ended (the
    simulator takes those of one replay as ended before the next)."""
    from jaxgen.engine.runner.programs import BACKGROUND_COMPILE_ENDED, BACKGROUND_COMPILE_STARTED

    deadline = time.monotonic() + timeout
    while True:
        started = ended = 0
        for path in logs:
            with open(path, errors="replace") as f:
                for line in f:
                    started += BACKGROUND_COMPILE_STARTED in line
                    ended += any(e in line for e in BACKGROUND_COMPILE_ENDED)
        if ended >= started:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{started - ended} background compiles still running after "
                               f"{timeout:.0f} s: see {logs}")  # fmt: skip
        time.sleep(0.2)


def background_compile_seconds(log: str) -> list[float]:
    """The wall seconds of each background compile an instance's log shows ended (the compile
    thread's own clock: stretched where steps shared the core)."""
    from jaxgen.engine.runner.programs import BACKGROUND_COMPILE_ENDED

    with open(log, errors="replace") as f:
        return [float(m.group(1)) for line in f if BACKGROUND_COMPILE_ENDED[0] in line
                for m in [re.search(r" in ([0-9.]+) s", line)] if m]  # fmt: skip


def compile_count(logs) -> int:
    n = 0
    for path in logs:
        with open(path, errors="replace") as f:
            n += sum(1 for line in f if "jaxgen: compiling" in line)
    return n


# The simulated sides: the isolated model; the served models; those at each replay's speed;
# and the served models with the instances' programs simulated from the deployment's start
# instead of read from its step logs ("chained").
SIMULATIONS = ("isolated", "served", "speed", "chained")


def instance_groups(kind: str, per_instance: list) -> list:
    """The instances' steps grouped as the served models are fitted: colocated, both instances
    together; disaggregated, (prefill, decode)."""
    return [[s for g in per_instance for s in g]] if kind == "colocated" else list(per_instance)


def speed_of(steps: list[dict], model) -> float:
    """How much slower than `model` these steps ran: the median of measured / predicted over
    those that ran a compiled program (1.0 without any). This host's speed drifts 1.5-2.7x
    within minutes, so a replay is compared with the model at its own speed too."""
    ratios = [s["seconds"] / model.record_seconds(s) for s in plain_steps(steps)]
    return float(np.median(ratios)) if ratios else 1.0


def stalls(run: dict, reqs, slo, per_instance: list) -> dict:
    """What a measured replay's requests that missed an SLO had in flight: per request its
    life (sent until its last token: TTFT + TPOT x the answer's other tokens) against the
    replay's steps on every instance. "misses" (a request that failed too, as `attainment`
    counts it); "during_compile": misses alive while a step compiled (it stalls its
    instance; a failed request's life is unknown); "longest_covered_s": the longest step run
    on a larger program (frozen programs pad a step up to any of them); "long_steps": each step
    of `LONG_STEP_S` or more that compiled nothing, longest first (20 at most), as [seconds,
    and its `HOST_FIELDS` where logged]. A step's `time` is when it was logged, as it landed."""
    steps = [s for group in per_instance for s in group]
    compiles = [(s["time"] - s["seconds"], s["time"]) for s in steps if s.get("compiled")]
    out = {"misses": 0, "during_compile": 0}
    for sent, t, p, req in zip(run["sent"], run["ttft_s"], run["tpot_s"], reqs, strict=True):
        if t is None:
            out["misses"] += 1
            continue
        if not (t > slo.ttft or (p is not None and p > slo.tpot)):
            continue
        end = sent + t + (p or 0.0) * max(req.output_len - 1, 0)
        out["misses"] += 1
        out["during_compile"] += any(a < end and b > sent for a, b in compiles)
    covered = [s["seconds"] for s in steps if s.get("covered")]
    out["longest_covered_s"] = max(covered, default=0.0)
    long = [s for s in steps if s["seconds"] >= LONG_STEP_S and not s.get("compiled")]
    long.sort(key=lambda s: -s["seconds"])
    out["long_steps"] = [[s["seconds"], *(s.get(k) for k in HOST_FIELDS)] for s in long[:20]]
    return out


def resimulate(result: dict, seed: int = 0, steps: dict | None = None, sweep: bool = True) -> None:
    """The simulated side of a measured result, with the simulator as it is now (the same
    requests: the traces are seeded). Per run, with the isolated model; with the served models
    plus the measured client overhead; and (with the replays' saved `steps`) with the served
    models at the speed each replay's own steps ran (`speed_of`). The served models price a
    step that compiles (`simulator.Programs`): with the saved warm-up and replay steps, each
    replay starts from the programs its instances held (`deployed_programs`), and the
    "chained" side simulates each deployment's life as it ran instead (per trace its warm-ups,
    then the measured replays, the programs carried from one to the next); without them, the
    served side is that chain. `sweep`: also the goodputs with both SLOs scaled
    (`slo_sweep`)."""
    from benchmarks.disagg import search, simulator, traces
    from benchmarks.disagg.planner import LatencyModel

    isolated = LatencyModel.from_dict(result["model"])
    specs = cpu_traces(result["scale"])
    replays = (steps or {}).get("replays", {})
    kinds = list(dict.fromkeys(k for row in result["traces"].values() for k in row["runs"]))
    for row in result["traces"].values():
        row["simulated"] = {}
    for kind in kinds:
        served = [LatencyModel.from_dict(m) for m in result["served"][kind]["models"]]
        cover = result.get("cover_new_shapes", 0.0)
        aot = ahead_of_time_programs()
        background = result.get("compile_in_background", False)
        defer = int(result.get("defer_prefills", 0))  # 0: an engine that had no deferring
        programs = {
            sim: simulator.Programs(cover, aot, background, defer=defer) for sim in SIMULATIONS
        }  # fmt: skip
        for name, row in result["traces"].items():
            runs = row["runs"].get(kind)
            if not runs:
                continue
            lengths = traces.sample_lengths(specs[name], result["requests"], seed)
            gaps = traces.unit_gaps(result["requests"], seed)
            slo = search.SLO(**row["slo"])
            overhead = row["warmup"][kind]["overhead_s"]
            extra = {"isolated": 0.0, "served": overhead, "speed": overhead, "chained": overhead}
            measured_steps = replays.get(kind, {}).get(name)
            # The warm-ups: the same requests, before the measured replays (then the highest
            # rates' again, in runs that repeated them).
            warm_rates = [r["rate"] for r in runs] + row["warmup"][kind].get("repeated_rates", [])
            for rate in warm_rates:
                reqs = traces.poisson_requests(lengths, rate, gaps)
                for sim in ("served", "speed", "chained"):
                    simulate(kind, reqs, served, overhead, programs[sim])
            frozen = result.get("freeze_replays", False)  # the measured replays' programs
            for known in programs.values():
                known.frozen = frozen
            row["simulated"][kind] = {
                "warmup_compiles": programs["served"].compiles,  # this trace's and earlier ones'
                "isolated": simulated_goodput(kind, lengths, gaps, slo, isolated),
                "served": simulated_goodput(
                    kind, lengths, gaps, slo, served, overhead, programs["served"]
                ),  # fmt: skip
            }
            for j, r in enumerate(runs):
                reqs = traces.poisson_requests(lengths, r["rate"], gaps)
                models = {"isolated": isolated, "served": served}
                if measured_steps is not None:
                    groups = instance_groups(kind, measured_steps[j])
                    r["speed"] = [speed_of(g, m) for g, m in zip(groups, served, strict=True)]
                    if r.get("sent"):
                        r["stalls"] = stalls(r, reqs, slo, measured_steps[j])
                    models["speed"] = [m.scaled(f) for m, f in zip(served, r["speed"], strict=True)]
                held = None  # the programs the instances held as this replay began
                if measured_steps is not None and "warmup" in steps and r.get("sent"):
                    held = deployed_programs(steps, kind, min(r["sent"]))
                    # With the instances' own list as they froze, the programs compiled in
                    # the background that no logged step ran too.
                    for i, keys in enumerate(row["warmup"][kind].get("held", [])):
                        held.setdefault(i, set()).update(map(tuple, keys))
                    models["chained"] = served
                for sim, model in models.items():
                    known = programs[sim]
                    if held is not None and sim != "chained":
                        known = simulator.Programs(cover, aot, background, frozen, defer)
                        for i, keys in held.items():
                            known.known[i] |= keys
                    before = (known.compiles, known.covered, known.background_compiles,
                              known.deferred)  # fmt: skip
                    outs = simulate(kind, reqs, model, extra[sim], known)
                    r[f"{sim}_compiles"] = known.compiles - before[0]
                    r[f"{sim}_covered"] = known.covered - before[1]
                    r[f"{sim}_background_compiles"] = known.background_compiles - before[2]
                    r[f"{sim}_deferred"] = known.deferred - before[3]
                    r[f"{sim}_attainment"] = simulator.attainment(outs, slo.ttft, slo.tpot)
                    r[f"{sim}_ttft_p50_s"] = float(np.median([o.ttft for o in outs]))
                    r[f"{sim}_tpot_p50_s"] = float(np.median([o.tpot for o in outs]))
                    r[f"{sim}_ttft_s"] = [o.ttft for o in outs]
                    r[f"{sim}_prefill_s"] = [o.prefill for o in outs]
            for known in programs.values():  # the next trace's warm-ups compile
                known.frozen = False
    summarize(result)
    if sweep:
        result["slo_scales"] = slo_sweep(result, seed, steps)


# DistServe's other axis: goodput as both SLOs are scaled (x the run's own SLOs).
SLO_SCALES = (0.75, 1.0, 1.5, 2.0)


def slo_sweep(result: dict, seed: int = 0, steps: dict | None = None,
              scales=SLO_SCALES) -> dict:  # fmt: skip
    """Goodput with both SLOs scaled, from the same replays: the measured attainment recounted
    from each request's TTFT and TPOT, the simulated side rerun (`resimulate`). {scale: {trace:
    {deployment: goodput}}}; scale 1 is the run's own. With n requests a rate, attainment moves
    in steps of 1/n; where requests miss even alone (a prompt longer than the TTFT SLO allows),
    the curve can sit on the 90% target over many rates, and one request more or less moves
    the goodput across them: the sweep shows how much the comparison hangs on that."""
    from benchmarks.disagg import search

    out = {}
    for scale in scales:
        scaled = copy.deepcopy({k: v for k, v in result.items() if k != "slo_scales"})
        for row in scaled["traces"].values():
            row["slo"]["ttft"] *= scale
            row["slo"]["tpot"] *= scale
            slo = search.SLO(**row["slo"])
            for runs in row["runs"].values():
                for r in runs:
                    r["attainment"] = attainment_of(request_results(r), slo)
        resimulate(scaled, seed, steps, sweep=False)
        out[f"{scale:g}"] = {name: row["goodput"] for name, row in scaled["traces"].items()}
    return out


def request_results(run: dict) -> list[dict]:
    """A measured run's requests as `replay` returned them (TTFT and TPOT, or an error)."""
    return [{"error": "failed"} if t is None else {"ttft": t, "tpot": p}
            for t, p in zip(run["ttft_s"], run["tpot_s"], strict=True)]  # fmt: skip


def transfer_counters(roles: dict) -> dict:
    """The decode instance's reads from the prefill instance's memory (disaggregated)."""
    if not roles:
        return {}
    d = roles["decode"]
    return {
        "pulls": metric(d, "jaxgen_kv_transfer_pulls_total"),
        "pulled_bytes": metric(d, "jaxgen_kv_transfer_pulled_bytes_total"),
        "pull_seconds": metric(d, "jaxgen_kv_transfer_pull_seconds_total"),
        "loaded_pages": metric(d, "jaxgen_kv_loaded_blocks_total"),
    }


def summarize(result: dict) -> None:
    """Goodput per trace and deployment (measured, and simulated with either model at the
    measured rates), their ratio, the simulators' errors, transfer GB/s and its share of
    TTFT."""
    for row in result["traces"].values():
        good = {}
        for kind, runs in row["runs"].items():
            rates = [r["rate"] for r in runs]
            m = crossing(rates, [r["attainment"] for r in runs])
            good[kind] = dict(measured=m)
            for sim in [x for x in SIMULATIONS if f"{x}_attainment" in runs[0]]:
                s = crossing(rates, [r[f"{sim}_attainment"] for r in runs])
                good[kind][sim] = s
                good[kind][f"{sim}_error"] = (
                    abs(s["rps"] - m["rps"]) / m["rps"] if m["bound"] == s["bound"] == "=" else None
                )
        row["goodput"] = good
        if {"colocated", "disaggregated"} <= good.keys():
            row["goodput_ratio"] = (
                good["disaggregated"]["measured"]["rps"] / good["colocated"]["measured"]["rps"]
            )
        moved = [r for r in row["runs"].get("disaggregated", []) if r["transfer"]]
        read = sum(r["transfer"]["pulled_bytes"] for r in moved)
        secs = sum(r["transfer"]["pull_seconds"] for r in moved)
        ttft = sum(sum(t for t in r["ttft_s"] if t is not None) for r in moved)
        row["transfer"] = dict(
            bytes_read=read,
            read_seconds=secs,
            pulls=sum(r["transfer"]["pulls"] for r in moved),
            gbps=read / secs / 1e9 if secs else None,
            share_of_ttft=secs / ttft if ttft else None,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=SCALE)
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--out", default="docs/cpu/disagg.json")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--profile", default=None, help="latency profile JSON: reused if it exists, "
                   "else measured and saved there")  # fmt: skip
    p.add_argument("--resimulate", action="store_true",
                   help="only recompute the simulated side of --out's measurements (and "
                   "refit the served models to the steps saved beside it)")  # fmt: skip
    p.add_argument("--profile-only", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile_only:
        profile_here(args.profile_only)
        return 0
    if args.resimulate:
        with open(args.out) as f:
            result = json.load(f)
        steps = None
        if os.path.exists(steps_path(args.out)):  # the served models refitted as they are now
            from benchmarks.disagg.planner import LatencyModel

            steps = load_steps(steps_path(args.out))
            isolated = LatencyModel.from_dict(result["model"])
            result["served"] = served_models(steps["warmup"], isolated, result.get("handoff_probe"))
        resimulate(result, steps=steps)
        harness.dump_json(result, args.out)
    else:
        result = run(args.scale, args.requests, out=args.out, profile=args.profile)
    for name, row in result["traces"].items():
        print(name, json.dumps(row["goodput"]), "ratio", row.get("goodput_ratio"), flush=True)
    if args.write_docs:
        result["plots"] = plot(result)
        harness.write_section("disagg", to_markdown(result))
    return 0


def plot(result: dict) -> list[str]:
    paths = []
    for name, row in result["traces"].items():
        series = {}
        for kind, runs in row["runs"].items():
            rates = [r["rate"] for r in runs]
            series[f"{kind} (measured)"] = (rates, [r["attainment"] for r in runs])
            for sim in _sims(runs):
                series[f"{kind} (simulated, {SIM_LABELS[sim]})"] = (
                    rates, [r[f"{sim}_attainment"] for r in runs]
                )  # fmt: skip
        path = harness.plot(
            f"disagg_{name}.png", series, xlabel="requests/s (2 cores)",
            ylabel="SLO attainment", title=f"{name}: SLO attainment vs rate",
        )  # fmt: skip
        if path:
            paths.append(path)
    return paths


def _rps(g: dict) -> str:
    return f"{g['bound'] if g['bound'] != '=' else ''}{g['rps']:.3f}"


SIM_LABELS = {
    "served": "served model",
    "speed": "served model at the replay's speed",
    "isolated": "isolated model",
    "chained": "served model, programs simulated from the deployment's start",
}


def _sims(runs: list) -> list[str]:
    """The simulated sides a result's runs have (an older result has no `speed`)."""
    return [s for s in SIMULATIONS if f"{s}_attainment" in runs[0]]


def _error(g: dict, sim: str) -> str:
    e = g.get(f"{sim}_error")
    return f"{100 * e:.0f}%" if e is not None else "–"


def background_shares(result: dict) -> list[float | None]:
    """The served models' fitted `background_share` per instance group, deployment by
    deployment (None: fewer than 5 steps beside a compile, the model keeps the fair share)."""
    return [x for v in result.get("served", {}).values() for x in v.get("background_shares", [])]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    curves, goodputs = [], []
    for name, row in result["traces"].items():
        for kind, g in row.get("goodput", {}).items():
            runs = row["runs"][kind]
            sims = _sims(runs)
            speeds = [" / ".join(f"{x:.2f}" for x in r["speed"]) for r in runs if "speed" in r]
            curves.append({
                "trace": name, "deployment": kind,
                "rates": ", ".join(f"{r['rate']:.3g}" for r in runs),
                "attainment": ", ".join(f"{r['attainment']:.2f}" for r in runs),
                **{f"{sim}_att": ", ".join(f"{r[f'{sim}_attainment']:.2f}" for r in runs)
                   for sim in sims},
                "compiles": ", ".join(str(r.get("compiles", "-")) for r in runs),
                "sim_compiles": ", ".join(str(r.get("served_compiles", "-")) for r in runs),
                "covered": ", ".join(str(r.get("covered", "-")) for r in runs),
                "sim_covered": ", ".join(str(r.get("served_covered", "-")) for r in runs),
                "speed": ", ".join(speeds) if speeds else None,
            })  # fmt: skip
            goodputs.append({
                "trace": name, "deployment": kind, "measured": _rps(g["measured"]),
                **{sim: f"{_rps(g[sim])} ({_error(g, sim)})" for sim in sims},
            })  # fmt: skip
    curve_table = harness.markdown_table(
        curves,
        [
            ("trace", "trace"),
            ("deployment", "deployment (2 cores)"),
            ("rates", "rates (req/s)"),
            ("attainment", "SLO attainment: measured"),
            ("served_att", "simulated: served model"),
            ("speed_att", "at the replay's speed"),
            ("isolated_att", "isolated model"),
            ("chained_att", "served, programs simulated"),
            ("compiles", "programs compiled: measured"),
            ("sim_compiles", "simulated"),
            ("covered", "steps on a covering program: measured"),
            ("sim_covered", "simulated"),
            ("speed", "replay speed (x the served model)"),
        ],
    )
    goodput_table = harness.markdown_table(
        goodputs,
        [("trace", "trace"), ("deployment", "deployment"), ("measured", "goodput req/s: measured")]
        + [(sim, f"simulated, {SIM_LABELS[sim]} (error)") for sim in SIMULATIONS],
    )
    fits = []
    for kind, served in result["served"].items():
        who = ("both instances",) if kind == "colocated" else ("prefill", "decode")
        unpadded = served.get("fits_unpadded", [None] * len(who))
        agree = served.get("shape_agreement", [None] * len(who))
        compiled = served.get("compile_fits", [None] * len(who))
        for w, fit, raw, same, n, mod, compile_fit in zip(
            who, served["fits"], unpadded, agree, served["steps"], served["models"], compiled,
            strict=True,
        ):  # fmt: skip
            pa, pb, pc = mod["prefill"]
            _, db, dc = mod["decode"]
            fits.append(
                f"{kind} {w}: {n} steps, a = {pa * 1e3:.1f} ms, {pb * 1e6:.0f} us per prompt "
                f"token computed (padded), {db * 1e3:.2f} ms per decode row (padded), "
                f"{dc * 1e6:.2f} us per context token (rms {100 * fit['rel_rms']:.0f}%"
                + (f"; the rows as they are: {100 * raw['rel_rms']:.0f}%" if raw else "")
                + (
                    ""
                    if same is None
                    else f"; the padding rule gave {100 * same:.0f}% of the logged shapes"
                )  # fmt: skip
                + ")"
                + (
                    f"; {compile_fit['num_samples']} steps that compiled, a = "
                    f"{compile_fit['coef']['a']:.2f} s (rms {100 * compile_fit['rel_rms']:.0f}%)"
                    if compile_fit
                    else "; too few steps that compiled to price them"
                )
            )
    iso = result["model"]
    lines = []
    for name, row in result["traces"].items():
        ratio = row.get("goodput_ratio")
        upper = row["goodput"].get("disaggregated", {}).get("measured", {}).get("bound") == "<"
        over = ", ".join(f"{k} {1e3 * w['overhead_s']:.0f} ms" for k, w in row["warmup"].items())
        over += " at the lowest rate"
        lines.append(
            f"- **{name}** ({row['description']}; mean prompt {row['mean_prompt']:.0f}, answer "
            f"{row['mean_output']:.0f} tokens; SLOs TTFT {row['slo']['ttft']:.2f} s, TPOT "
            f"{row['slo']['tpot'] * 1e3:.0f} ms; rates {row['rates']} req/s): goodput "
            "disaggregated / colocated = "
            + (f"**{'< ' if upper else ''}{ratio:.2f}x**" if ratio else "-")
            + f"; client time outside the instances (warm-ups): {over}"
        )
        t = row["transfer"]
        if t["gbps"]:
            lines[-1] += (
                f"; KV read by the decode instance from the prefill instance's memory: "
                f"{t['bytes_read'] / 1e6:.0f} MB in {t['pulls']:.0f} reads at "
                f"{t['gbps']:.2f} GB/s (host copy here {result['host_copy']['gbps']:.1f} "
                f"GB/s), {100 * t['share_of_ttft']:.1f}% of TTFT"
            )
        split = phase_split(row["runs"].get("disaggregated", []))
        if split:
            lines[-1] += (
                "; a disaggregated TTFT's parts, medians per rate, measured / served model: "
                "the prefill hop (the router's wait for the prefill instance) "
                + ", ".join(f"{x['hop']:.2f} / {x['sim_hop']:.2f}" for x in split)
                + " s; the rest (transfer, decode instance, HTTP) "
                + ", ".join(f"{x['rest']:.2f} / {x['sim_rest']:.2f}" for x in split)
                + " s"
            )
    images = "\n".join(f"![{p}]({p})" for p in result.get("plots", []))
    tm = result["transfer_model"]
    warm = [w for row in result["traces"].values() for w in row["warmup"].values()]
    n_rep = max([len(w.get("repeated_rates", [])) for w in warm] + [0])
    repeated = f" (the highest {n_rep} rates' twice)" if n_rep else ""
    cover = result.get("cover_new_shapes", 0.0)
    cover_text = (
        f", unless a program it has compiled covers the step within {cover:g}x its work: the "
        f"step then runs on that one, padded further, as the instances do (`serve "
        f"--cover-new-shapes {cover:g}`; such steps are left out of the fits too)"
        if cover else ""
    )  # fmt: skip
    if result.get("compile_in_background"):
        shares = [f"{x:.2f}" if x is not None else "0.5 (fewer than 5 steps)"
                  for x in background_shares(result)]  # fmt: skip
        cover_text += (
            "; a step that none covers within that but one covers at all runs on that one while"
            " its own program compiles on a thread beside the loop (`serve"
            " --compile-in-background`), sharing the core: the simulator's instances give a step"
            " the share of the core the served steps beside a compile kept (measured / the"
            f" served model's time: {', '.join(shares)} per instance group), the compile the"
            " rest, and the program serves once compiled; the bench waits for every compile"
            " after a replay. Only a step that nothing covers compiles inline"
        )
        walls = [x for per in result.get("background_compile_s", {}).values() for g in per
                 for x in g]  # fmt: skip
        if walls:
            cover_text += (
                f" (a background compile took {np.median(walls):.1f} s of wall time, median of"
                f" {len(walls)}, {min(walls):.1f}-{max(walls):.1f} s)"
            )
    if result.get("freeze_replays"):
        held = ", ".join(
            f"{n} {k} " + "/".join(str(x) for x in w["programs"])
            for n, row in result["traces"].items() for k, w in row["warmup"].items()
            if w.get("programs")
        )  # fmt: skip
        cover_text += (
            ". The measured replays ran on the programs the warm-ups had compiled: the bench"
            " froze the instances' programs after each trace's warm-ups and thawed them after"
            " its replays (`POST /freeze_programs`, `Engine.freeze_programs`), so a step whose"
            " own program had not compiled ran on the least-work compiled program covering it,"
            " at any padding"
            + (
                ", a step that nothing covered left its last prefill rows to the next step"
                " until one did"
                if result.get("defer_prefills")
                else ""
            )
            + ", and only a step that nothing covered compiled (inline); the"
            " simulated replays do the same (`simulator.Programs(frozen=True)`)"
            + (f". Programs each instance held as it froze: {held}" if held else "")
        )
    own_compiles = result.get("compilation_cache") is False
    compile_parts = (
        "XLA compiling it" if own_compiles
        else "XLA compiling it, or loading it from the persistent cache"
    )  # fmt: skip
    cache_text = (
        " The instances compiled every program themselves (`serve --no-compilation-cache`)."
        if own_compiles
        else " JAX's persistent compilation cache was on (as `jaxgen serve` runs by default): a"
        " program an earlier run had compiled loaded from disk in a fraction of a compile's"
        " time, which the compile model cannot tell from a compile."
    )  # fmt: skip
    return f"""### Disaggregated prefill/decode, measured (`python -m benchmarks disagg`)

SmolLM2-135M f32 on {m["cpu"]} ({m["cores"]} cores), {m["date"]}, one run. Every instance is a
`jaxgen serve` process pinned to one core: disaggregated = 1 prefill (core 0) + 1 decode
(core 1), the decode instance reading each prompt's KV pages out of the prefill instance's
memory with Mooncake's transfer engine (TCP on loopback); colocated = 2 instances (one per core)
with chunked prefill behind the cache-aware router. {result["requests"]} requests per rate
(Poisson arrivals; the same lengths in the same order at every rate; every prompt of the run on
text of its own, so no prefix is cached), after a warm-up replay of each rate on other
text{repeated}; the GPU traces' lengths divided by {result["scale"]}; SLOs: TTFT
{SLO_TTFT_X:g}x the trace's longest prompt's prefill alone (every request can meet it on an idle
deployment), TPOT {SLO_TPOT_X:g}x one decode step (both
from the isolated latency model); goodput = the highest rate with >= 90% of requests within both
(linear between measured rates; < / >=: outside the measured range).

The simulator runs the same requests, its instances looping as jaxgen's engines do (overlapped:
a busy instance plans its next step when the one before starts, so a request reaching it
mid-step joins the step after the next), with three latency models. **Isolated**: profiled on one
core in a process of its own (prefill fit rms {100 * iso_fit(result, "prefill"):.0f}%, decode
{100 * iso_fit(result, "decode"):.0f}%), with the transfer engine's reads measured alone
({tm["gbps"]:.2f} GB/s, {1e3 * tm["fit"]["coef"]["a"]:.2f} ms a read). **Served**: fitted to the
steps each deployment's instances logged (`serve --step-log`) during its warm-up replays
(steps that compiled left out), each step priced as the program that ran it (`planner.Padding`:
prefill rows to a power of two at the token bucket of the longest chunk, page tables to a power
of two, decode rows to a batch bucket reading their page blocks or padded tables, the padding
computed too; the simulator packs its steps by the same rule), plus the client time outside the
instances measured in the warm-up at the lowest rate (the clients' TTFT minus the instances'
own TTFT and transfer reads: HTTP hops, tokenizing, the router). A step whose program
(`Padding.program`: the shape the engine compiles) its instance has not run yet costs the
compile model's time, fitted to the warm-ups' steps that compiled ({compile_parts}, then the
step){cover_text}.{cache_text} Before each measured
replay the
simulated instances hold the programs the deployment's instances held as it began: the ones
`jaxgen serve` compiles ahead of time and every one their step logs show they had run.
**Programs simulated** (the last column): the same served model, but each instance's programs
simulated from the deployment's start (its warm-ups, then the replays) instead of read from
its logs; which programs an instance compiles, and so covers later steps with, follows the
exact timing of every earlier step. **At the replay's speed**: the served
model times the median measured / predicted time of the replay's own steps (this host's speed drifts
1.5-2.7x within minutes; the factor is in the table), so the queueing is compared at the speed
the steps actually ran.{handoff_text(result)}

{curve_table}

{goodput_table}
{sweep_text(result)}
Served models: {"; ".join(fits)}. Isolated: a = {1e3 * iso["prefill"][0]:.1f} ms, {
        1e6 * iso["prefill"][1]:.0f} us per prompt token, {
        1e3 * iso["decode"][1]:.2f} ms per decode row.

{chr(10).join(lines)}

{images}

{findings(result)}
"""


def phase_split(runs: list, sim: str = "served") -> list[dict] | None:
    """Where a disaggregated TTFT goes, per run: the medians over its requests of the router's
    prefill hop (queue, prefill, page writes) and of the rest (transfer, the decode
    instance, the HTTP hops), measured and simulated; None for a result without the hops."""
    out = []
    for r in runs:
        hops, sims = r.get("prefill_s"), r.get(f"{sim}_prefill_s")
        if not hops or not sims:
            return None
        both = [(t, h, st, sh) for t, h, st, sh in zip(r["ttft_s"], hops, r[f"{sim}_ttft_s"], sims,
                                                       strict=True)
                if t is not None and h is not None and sh is not None]  # fmt: skip
        if not both:
            return None
        t, h, st, sh = (np.array(x) for x in zip(*both, strict=True))
        out.append(
            dict(rate=r["rate"], hop=float(np.median(h)), sim_hop=float(np.median(sh)),
                 rest=float(np.median(t - h)), sim_rest=float(np.median(st - sh)))
        )  # fmt: skip
    return out


def sweep_text(result: dict) -> str:
    """The goodputs with both SLOs scaled (`slo_sweep`): measured / served model (error)."""
    sweep = result.get("slo_scales")
    if not sweep:
        return ""
    rows = []
    for name, row in result["traces"].items():
        for kind in row["runs"]:
            cells = {}
            for scale, per_trace in sweep.items():
                g = per_trace[name][kind]
                cells[scale] = (
                    f"{_rps(g['measured'])} / {_rps(g['served'])} ({_error(g, 'served')})"
                )
            rows.append({"trace": name, "deployment": kind, **cells})
    table = harness.markdown_table(
        rows,
        [("trace", "trace"), ("deployment", "deployment")]
        + [(scale, f"SLOs x{scale}: measured / served model (error)") for scale in sweep],
    )
    return f"""
Goodput as both SLOs are scaled (DistServe's SLO scale), from the same replays: the measured
attainment recounted from each request's TTFT and TPOT, the simulated side rerun. With
{result["requests"]} requests a rate, attainment moves in steps of {100 / result["requests"]:.1f}%,
and a request that misses even alone (a prompt longer than the TTFT SLO allows) keeps the curve
near the 90% target over many rates, where one request more or less moves the goodput across
them.

{table}
"""


def handoff_text(result: dict) -> str:
    """The disaggregated models' handoff and where it was measured."""
    fits = result["served"].get("disaggregated", {}).get("handoff_fits")
    if not fits:
        return ""
    when = (
        "in a deployment of its own right after the run (this result predates the probe)"
        if result.get("handoff_probe_after_run")
        else "in the disaggregated deployment before its warm-ups"
    )
    sides = "; ".join(
        f"{side}: {1e3 * f['coef']['a']:.0f} ms + {1e3 * f['coef']['per_token']:.2f} ms per "
        f"token moved (rms {100 * f['rel_rms']:.0f}%)"
        for side, f in fits.items()
    )
    return f"""
**Handoff** (the disaggregated models): the engines' own time on a handed-off prompt,
measured {when} with one prompt at a time of {", ".join(map(str, HANDOFF_SIZES))} tokens: the
prefill instance's page writes (before it answers; the instance is busy), and the decode
instance's TTFT less its transfer read and the tail step (reading, checking and loading the
pages into its pool). {sides}."""


def findings(result: dict) -> str:
    """What the run shows, from its own figures."""
    iso = result["model"]["prefill"][1]
    # The instances that run the prompts: colocated, and the disaggregated prefill instance;
    # per prompt token as it is (the isolated profile ran bucket-sized prompts).
    per_token = [v.get("fits_unpadded", v["fits"])[0]["coef"]["b_per_token"] / iso
                 for v in result["served"].values()]  # fmt: skip
    errs = {(n, k): g for n, row in result["traces"].items() for k, g in row["goodput"].items()}

    def errors(sim: str) -> str:
        got = [f"{n} {k} {100 * g[f'{sim}_error']:.0f}%" for (n, k), g in errs.items()
               if g.get(f"{sim}_error") is not None]  # fmt: skip
        missing = [f"{n} {k}" for (n, k), g in errs.items() if g.get(f"{sim}_error") is None]
        return ("; ".join(got) or "none") + (
            f" (not comparable: {', '.join(missing)}: the measured or the simulated attainment "
            "does not cross 90% inside the measured rates)" if missing else ""
        )  # fmt: skip

    all_runs = [r for row in result["traces"].values() for runs in row["runs"].values()
                for r in runs]  # fmt: skip
    compiles = sum(r["compiles"] for r in all_runs)
    simulated = sum(r.get("served_compiles", 0) for r in all_runs)
    covered = sum(r.get("covered", 0) for r in all_runs)
    sim_covered = sum(r.get("served_covered", 0) for r in all_runs)
    frozen = (
        ", on the programs frozen after the warm-ups (only a step nothing compiled covers"
        " compiles),"
        if result.get("freeze_replays") else ""
    )  # fmt: skip
    deferred = ""
    if any("deferred" in r for r in all_runs):  # runs from 2026-12-06 16:00 on
        deferred = (
            " Prefill rows a frozen instance left to its next step, as nothing it held covered"
            f" their step: {sum(r.get('deferred', 0) for r in all_runs)} measured,"
            f" {sum(r.get('served_deferred', 0) for r in all_runs)} simulated."
        )
    speeds = [x for r in all_runs for x in r.get("speed", [])]
    overheads = "; ".join(
        f"{n} {k} " + ", ".join(f"{1e3 * x:.0f}" for x in w.get("overhead_per_rate_s", []))
        for n, row in result["traces"].items() for k, w in row["warmup"].items()
    )  # fmt: skip
    stall = " Each stalls its instance and every request queued behind it."
    if result.get("compile_in_background") and not result.get("freeze_replays"):
        background = sum(r.get("served_background_compiles", 0) for r in all_runs)
        shares = [x for x in background_shares(result) if x is not None]
        stall = (
            f" Of the simulator's, {background} compiled in the background. One that compiles"
            " inline (nothing covers its step) stalls its instance and every request queued"
            " behind it; one in the background leaves the instance's steps"
            + (f" {min(shares):.2f}-{max(shares):.2f}" if shares else " part")
            + " of the core while it runs (the served steps beside a compile), which every"
            " running request's TPOT feels."
        )
    logs = [s for v in result.get("step_logs", {}).values() for s in v if s["compiled"]]
    if logs:
        inline = " inline" if result.get("compile_in_background") else ""
        stall += (f" A step that compiled{inline} took a median "
                 + ", ".join(f"{s['compiled_median_s']:.2f} s" for s in logs)
                 + " per instance, the others "
                 + ", ".join(f"{s['other_median_s']:.2f} s" for s in logs) + ".")  # fmt: skip
    stalled = stall_text(result)
    speed_line = (
        f"- The replays ran at {min(speeds):.2f}-{max(speeds):.2f}x the served models' times "
        "(the warm-ups they were fitted to ran minutes earlier)."
        if speeds else ""
    )  # fmt: skip
    pays = disaggregation_text(result)
    or_loaded = "" if result.get("compilation_cache") is False else "(or loaded) "
    return f"""What this run shows, on this host:
- The isolated model is optimistic: the served prefill steps cost
  {" and ".join(f"{x:.1f}x" for x in per_token)} its per-prompt-token time (colocated,
  disaggregated prefill). A served chunk is padded to its token bucket (the isolated profile ran
  bucket-sized prompts) and shares its core with the instance's HTTP work.
- Simulator error on goodput where both cross 90% inside the measured rates. Served model:
  {errors("served")}. At the replay's speed: {errors("speed")}. Served model with the
  instances' programs simulated rather than read from their logs: {errors("chained")}.
- Compiles while serving: after a warm-up replay of each rate the measured replays{frozen} still
  ran {compiles} steps that compiled {or_loaded}a new program; the simulator, from the programs
  the instances held before each replay, compiled {simulated}. Steps run on a larger compiled
  program: {covered} measured, {sim_covered} simulated.{deferred}{stall}{stalled}
{speed_line}
- The client time outside the instances grows with the load (per warm-up rate, ms):
  {overheads}. The simulator takes the lowest rate's; the rest is queueing in the HTTP
  servers, the router and the clients, which share the two cores with the instances.
- {pays}
"""


def stall_text(result: dict) -> str:
    """The measured misses alive while an instance compiled, per trace and deployment
    (`stalls`), and the longest step on a larger program; empty without them."""
    parts = []
    for n, row in result["traces"].items():
        for k, runs in row["runs"].items():
            got = [r["stalls"] for r in runs if "stalls" in r]
            if got:
                missed = sum(g["misses"] for g in got)
                during = sum(g["during_compile"] for g in got)
                longest = max(g["longest_covered_s"] for g in got)
                parts.append(f"{n} {k} {during} of {missed} (longest step on a larger "
                             f"program {longest:.2f} s)")  # fmt: skip
    if not parts:
        return ""
    return (
        "\n  Measured requests that missed an SLO, all rates, and of them those alive while an"
        " instance ran a step that compiled: " + "; ".join(parts) + "."
    )


def misses(result: dict) -> dict:
    """Per deployment, the measured requests (every rate, both traces) that missed the TTFT
    SLO and those that missed the TPOT SLO (a request can miss both)."""
    out = {}
    for row in result["traces"].values():
        slo = row["slo"]
        for kind, runs in row["runs"].items():
            got = out.setdefault(kind, {"ttft": 0, "tpot": 0})
            for r in runs:
                for t, p in zip(r["ttft_s"], r["tpot_s"], strict=True):
                    got["ttft"] += t is not None and t > slo["ttft"]
                    got["tpot"] += p is not None and p > slo["tpot"]
    return out


def disaggregation_text(result: dict) -> str:
    """Whether disaggregation paid in this run, and what its requests missed."""
    ratios = {n: row.get("goodput_ratio") for n, row in result["traces"].items()}
    ratio = ", ".join(f"{n} {r:.2f}x" if r is not None else f"{n} -" for n, r in ratios.items())
    missed = "; ".join(f"{k}: {m['ttft']} over the TTFT SLO, {m['tpot']} over the TPOT SLO"
                       for k, m in misses(result).items())  # fmt: skip
    cost = ("Each disaggregated request makes two HTTP hops, and its pages are written to the "
            "prefill instance's transfer memory, read, checked and loaded, on the same cores "
            "that compute; the transfer itself is a small share of TTFT (above).")  # fmt: skip
    interference = ("A colocated instance runs its decode rows in the steps that prefill "
                    "512-token chunks, and the disaggregated decode instance never does "
                    "(DistServe's interference).")  # fmt: skip
    if all(r is not None and r > 1 for r in ratios.values()):
        return (f"Disaggregation pays here (goodput disaggregated / colocated: {ratio}). "
                f"{interference} Requests that missed, all rates: {missed}. {cost}")  # fmt: skip
    paid = [n for n, r in ratios.items() if r is not None and r > 1]
    if paid:
        rest = [n for n in ratios if n not in paid]
        return (f"Disaggregation pays on {', '.join(paid)} and not on {', '.join(rest)} "
                f"(goodput disaggregated / colocated: {ratio}). {interference} {cost} "
                "With two cores 1P1D has half the prefill capacity of two colocated "
                f"instances. Requests that missed, all rates: {missed}.")  # fmt: skip
    return (f"Disaggregation does not pay on two cores (goodput disaggregated / colocated: "
            f"{ratio}). {cost} DistServe's gain needs prefill and decode on devices of their "
            f"own with a fast KV link. Requests that missed, all rates: {missed}.")  # fmt: skip


def iso_fit(result: dict, phase: str) -> float:
    return result["profile"][f"{phase}_fit"]["rel_rms"]


if __name__ == "__main__":
    raise SystemExit(main())
