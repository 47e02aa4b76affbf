"""A mixed request replay against `jaxgen serve`: what a served load compiles after start-up.

    jaxgen bench replay [--model M] [--num-requests 48] [--rate 0.5] [--quick]

Starts `jaxgen serve` as its own process on a free loopback port with its default settings
(plus `--serve-args`), waits for `/health`, and replays seeded requests: prompts of real text
(wikitext-2 valid), lengths log-uniform in `--prompt-lens` (default 8-1,500 tokens), output
lengths uniform in `--output-lens` (1-128, `ignore_eos` so each request generates exactly that
many), Poisson arrivals at `--rate` requests/s, each a streamed completion. It reports
  - the step programs the server held at `/health` and at the end (`jaxgen_step_programs`),
  - the XLA programs the server compiled after `/health` (`jaxgen_xla_compiles_total`: any
    compile in the serving process, step programs and helpers alike; every one holds the
    running requests for its seconds),
  - time to first token p50/p90 and request latency measured by the clients,
  - the seconds from the server's process start to `/health`.
The same replay against the ragged step and against the older step shaped by its rows
(`--no-ragged-step`), with the ratios, is a study: `python -m benchmarks ragged-replay`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxgen.bench import harness

SEED = 0


def workload(tokenizer, num: int, prompt_range, output_range, rate: float, seed: int = SEED):
    """[(arrival s, prompt text, output tokens)]: prompts cut from consecutive wikitext-2 text
    with log-uniform token lengths, uniform output lengths, Poisson arrivals at `rate`."""
    from jaxgen.bench.decode import WIKITEXT
    from jaxgen.model.tokenizer import read_text_tokens

    rng = np.random.RandomState(seed)
    low, high = np.log(prompt_range[0]), np.log(prompt_range[1] + 1)
    lengths = np.exp(rng.uniform(low, high, num)).astype(int).clip(*prompt_range).tolist()
    outputs = rng.randint(output_range[0], output_range[1] + 1, num).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num)).tolist()
    ids = read_text_tokens(tokenizer, WIKITEXT, sum(lengths))
    starts = np.cumsum([0, *lengths]).tolist()
    texts = [tokenizer.decode(ids[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
    return list(zip(arrivals, texts, outputs, strict=True))


def _metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


class Server:
    """`jaxgen serve` in a process of its own on a free loopback port, its log in a file."""

    def __init__(self, model: str | None, extra: list[str], env: dict | None = None):
        from jaxgen.entrypoints.mooncake_local import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "jaxgen.cli", "serve", "--port", str(self.port)]
        self.cmd += (["--model", model] if model else []) + extra
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.env = None if env is None else {**os.environ, **env}

    def __enter__(self) -> Server:
        import httpx

        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env
        )
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"jaxgen serve exited: {self.log.read()[-3000:]}")
            if time.perf_counter() - t0 > 900:
                raise TimeoutError("jaxgen serve did not answer /health within 900 s")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.start_to_health_s = time.perf_counter() - t0
        return self

    def metrics(self) -> dict:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {
            "programs": _metric(text, "jaxgen_step_programs"),
            "compiles": _metric(text, "jaxgen_xla_compiles_total"),
            "compile_seconds": _metric(text, "jaxgen_xla_compile_seconds_total"),
        }

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


async def _replay(url: str, requests) -> list[dict]:
    """Sends each request at its arrival time; returns per request its TTFT, latency, tokens
    and error (None when it succeeded)."""
    import httpx

    async def one(client, arrival, prompt, max_tokens, t_start):
        await asyncio.sleep(max(0.0, t_start + arrival - time.perf_counter()))
        t0 = time.perf_counter()
        body = {
            "model": "default",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        row = {"ttft_s": None, "latency_s": None, "prompt_tokens": None, "tokens": 0, "error": None}
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and row["ttft_s"] is None:
                        row["ttft_s"] = time.perf_counter() - t0
                    if chunk.get("usage"):
                        row["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                        row["tokens"] = chunk["usage"]["completion_tokens"]
            row["latency_s"] = time.perf_counter() - t0
        except Exception as e:  # every failure is counted and reported
            row["error"] = f"{type(e).__name__}: {e}"
        return row

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        t_start = time.perf_counter()
        return await asyncio.gather(*(one(client, *r, t_start) for r in requests))


def _pct(values, q):
    return float(np.percentile(values, q)) if values else None


def run(
    model: str | None = None,
    *,
    num_requests: int = 48,
    rate: float = 0.5,
    prompt_range=(8, 1500),
    output_range=(1, 128),
    serve_args: list[str] | None = None,
) -> dict:
    from jaxgen.model.loading import load_tokenizer

    requests = workload(load_tokenizer(model), num_requests, prompt_range, output_range, rate)
    with Server(model, serve_args or []) as server:
        at_health = server.metrics()
        t0 = time.perf_counter()
        rows = asyncio.run(_replay(server.url, requests))
        seconds = time.perf_counter() - t0
        at_end = server.metrics()
    ok = [r for r in rows if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "machine": harness.machine_info(),
        "serve": " ".join(["jaxgen serve", *(serve_args or [])]),
        "requests": num_requests,
        "rate": rate,
        "prompt_range": list(prompt_range),
        "output_range": list(output_range),
        "prompt_tokens": [r["prompt_tokens"] for r in rows],
        "start_to_health_s": server.start_to_health_s,
        "programs_at_health": at_health["programs"],
        "programs_at_end": at_end["programs"],
        "compiles_after_health": at_end["compiles"] - at_health["compiles"],
        "compile_seconds_after_health": at_end["compile_seconds"] - at_health["compile_seconds"],
        "replay_seconds": seconds,
        "errors": [r["error"] for r in rows if r["error"] is not None],
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p90_s": _pct(ttfts, 90),
        "latency_p50_s": _pct([r["latency_s"] for r in ok], 50),
        "latency_p90_s": _pct([r["latency_s"] for r in ok], 90),
        "output_tokens": sum(r["tokens"] for r in ok),
    }


COLUMNS = [
    ("serve", "server"),
    ("requests", "requests"),
    ("errors", "errors"),
    ("start_to_health_s", "start to /health s"),
    ("programs_at_health", "step programs at /health"),
    ("programs_at_end", "step programs at the end"),
    ("compiles_after_health", "XLA compiles after /health"),
    ("compile_seconds_after_health", "their seconds"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p90_s", "TTFT p90 s"),
    ("latency_p90_s", "request p90 s"),
]


def to_markdown(result: dict, command: str = "jaxgen bench replay") -> str:
    """One replay's table, or one row per server of a result holding several (`runs`)."""
    runs = result.get("runs", [result])
    first = runs[0]
    m = first["machine"]
    lo, hi = first["prompt_range"]
    olo, ohi = first["output_range"]
    text = (
        f"### Mixed replay against jaxgen serve ({m['cpu']}, {m['cores']} cores)\n\n"
        f"`{command}`: each server in its own process; {first['requests']} "
        f"streamed completions, prompts of {lo}-{hi} tokens (wikitext-2, log-uniform), outputs "
        f"of {olo}-{ohi} tokens, Poisson arrivals at {first['rate']} req/s; {m['date']}.\n\n"
        + harness.markdown_table([{**r, "errors": len(r["errors"])} for r in runs], COLUMNS)
    )
    return text
