"""Load test of the OpenAI-compatible server: many concurrent streaming clients on localhost.

    python -m jaxgen.bench.serve_load [--clients 1,4,16,64] [--seconds 30]  (or jaxgen bench serve)

Starts `jaxgen serve` in-process on a free port, runs the clients with the official `openai`
client for the given time at each load level, and reports requests, errors, p50/p99 time to
first token and request latency (measured by the clients), output tokens/s, and the KV pages
left in use; `--write-docs` writes the table and a latency-against-load plot into docs/.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time

import numpy as np

from jaxgen.bench import harness
from jaxgen.entrypoints.mooncake_local import free_port


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:port in a background thread."""

    def __init__(self, app, port: int):
        import uvicorn

        self.port = port
        from jaxgen.entrypoints.http import KEEP_ALIVE_S

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on", timeout_keep_alive=KEEP_ALIVE_S)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def load(
    base_url: str, clients: int, seconds: float, max_tokens: int = 32, api_key: str = "none"
) -> dict:
    """`clients` concurrent streaming chat clients, each looping until `seconds` have passed."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    ttfts, latencies, tokens, errors, done = [], [], 0, [], 0
    stop_at = time.perf_counter() + seconds
    prompts = [
        "Tell me about the sea.",
        "Write a short poem about trees.",
        "Explain why the sky is blue.",
        "List three kinds of fruit.",
    ]

    async def one_client(i: int):
        nonlocal tokens, done
        k = 0
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            first = None
            try:
                stream = await client.chat.completions.create(
                    model="default",
                    messages=[{"role": "user", "content": prompts[(i + k) % 4]}],
                    max_tokens=max_tokens,
                    temperature=0.7,
                    seed=i * 1000 + k,
                    stream=True,
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.perf_counter() - t0
                        tokens += 1  # one content chunk per token delta (an upper bound)
                done += 1
                latencies.append(time.perf_counter() - t0)
                if first is not None:
                    ttfts.append(first)
            except Exception as e:  # every failure is counted and reported
                errors.append(f"{type(e).__name__}: {e}")
            k += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(clients)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return {
        "clients": clients,
        "seconds": elapsed,
        "requests": done,
        "errors": errors,
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
        "latency_p50_s": float(np.percentile(latencies, 50)) if latencies else None,
        "latency_p99_s": float(np.percentile(latencies, 99)) if latencies else None,
        "stream_chunks_per_s": tokens / elapsed,
    }


def sweep(levels, seconds: float, model=None, max_tokens: int = 32) -> dict:
    """Latency against load: each number of concurrent clients in turn, one server."""
    from jaxgen import LLM
    from jaxgen.entrypoints.server import create_app

    llm = LLM(model, max_num_seqs=32, max_model_len=1024)
    app = create_app(llm, max_waiting=4 * max(levels))
    rows = []
    with ServerThread(app, free_port()) as url:
        for clients in levels:
            generated = llm.engine.stats()["tokens_generated"]
            row = asyncio.run(load(url, clients, seconds, max_tokens))
            stats = llm.engine.stats()
            row["pages_used_after"] = stats["pages_used"]
            row["output_tok_s"] = (stats["tokens_generated"] - generated) / row["seconds"]
            rows.append(row)
    return {"machine": harness.machine_info(), "seconds": seconds, "levels": rows}


LEVEL_COLUMNS = [
    ("clients", "clients"),
    ("requests", "requests done"),
    ("errors", "errors"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("latency_p50_s", "request p50 s"),
    ("latency_p99_s", "request p99 s"),
    ("output_tok_s", "output tok/s"),
    ("pages_used_after", "KV pages left in use"),
]


def sweep_markdown(result: dict, plot: str | None = None) -> str:
    m = result["machine"]
    rows = [{**r, "errors": len(r["errors"])} for r in result["levels"]]
    text = (
        f"### Latency against load ({m['cpu']}, {m['cores']} cores, float32)\n\n"
        "`jaxgen bench serve`: `jaxgen serve` on localhost, N concurrent streaming chat clients "
        f"(official `openai` client, max_tokens 32, sampled) for {result['seconds']:.0f} s "
        f"per level; {m['date']}.\n\n" + harness.markdown_table(rows, LEVEL_COLUMNS)
    )
    if plot:
        text += f"\n\n![latency against load]({plot})"
    return text


def plot_sweep(result: dict, path: str) -> str | None:
    levels = result["levels"]
    x = [r["clients"] for r in levels]
    return harness.plot(
        path,
        {
            "TTFT p50": (x, [r["ttft_p50_s"] for r in levels]),
            "TTFT p99": (x, [r["ttft_p99_s"] for r in levels]),
            "request p50": (x, [r["latency_p50_s"] for r in levels]),
            "request p99": (x, [r["latency_p99_s"] for r in levels]),
        },
        xlabel="concurrent clients",
        ylabel="seconds",
        title="jaxgen serve: latency against load",
        logx=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxgen.bench.serve_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--clients", default="64", help="concurrent clients, e.g. 64 or 1,4,16,64")
    p.add_argument("--seconds", type=float, default=30, help="seconds per load level")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    result = sweep([int(c) for c in args.clients.split(",")], args.seconds)
    plot = plot_sweep(result, "latency_load.png") if args.write_docs else None
    print(sweep_markdown(result, plot))
    if args.write_docs:
        harness.write_section("serve", sweep_markdown(result, plot))
    failed = any(r["errors"] or r["pages_used_after"] for r in result["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
