"""Load test of the OpenAI-compatible server: many concurrent streaming clients on localhost.

    python -m bench.serve_load [--clients 64] [--seconds 30]

Starts `jaxgen serve` in-process on a free port, runs the clients with the official `openai`
client for the given time, and reports requests, errors, p50/p99 time to first token (measured
by the clients) and output tokens/s; `--write-docs` adds the row to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time

import numpy as np

from bench import harness


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:port in a background thread."""

    def __init__(self, app, port: int):
        import uvicorn

        self.port = port
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
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
    ttfts, tokens, errors, done = [], 0, [], 0
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
        "stream_chunks_per_s": tokens / elapsed,
    }


def run(clients: int, seconds: float, model=None) -> dict:
    from engine import LLM
    from engine.server import create_app

    llm = LLM(model, max_num_seqs=32, max_model_len=1024)
    app = create_app(llm, max_waiting=4 * clients)
    with ServerThread(app, free_port()) as url:
        result = asyncio.run(load(url, clients, seconds))
    stats = llm.engine.stats()
    result.update(
        machine=harness.machine_info(),
        pages_used_after=stats["pages_used"],
        tokens_generated=stats["tokens_generated"],
    )
    result["output_tok_s"] = stats["tokens_generated"] / result["seconds"]
    return result


def to_markdown(r: dict) -> str:
    m = r["machine"]
    row = {
        k: r[k]
        for k in (
            "clients",
            "requests",
            "ttft_p50_s",
            "ttft_p99_s",
            "output_tok_s",
            "pages_used_after",
        )
    }
    row["errors"] = len(r["errors"])
    return (
        f"### Server under load ({m['cpu']}, {m['cores']} cores, float32)\n\n"
        f"`python -m bench.serve_load`: {r['clients']} concurrent streaming chat clients "
        f"(official `openai` client, max_tokens 32) for {r['seconds']:.0f} s against "
        f"`jaxgen serve` on localhost; {m['date']}.\n\n"
        + harness.markdown_table(
            [row],
            [
                ("clients", "clients"),
                ("requests", "requests done"),
                ("errors", "errors"),
                ("ttft_p50_s", "TTFT p50 s"),
                ("ttft_p99_s", "TTFT p99 s"),
                ("output_tok_s", "output tok/s"),
                ("pages_used_after", "KV pages left in use"),
            ],
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    result = run(args.clients, args.seconds)
    print(to_markdown(result))
    if args.write_docs:
        harness.write_section("serve-load", to_markdown(result))
    return 1 if result["errors"] or result["pages_used_after"] else 0


if __name__ == "__main__":
    sys.exit(main())
