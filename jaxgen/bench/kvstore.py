"""`jaxgen bench kvstore` (also `python -m jaxgen.bench.kvstore`): TTFT of prompts whose long
prefix was computed before but evicted from a device pool too small to keep it, with the KV
host tier off (the prefix is recomputed) and on (it is loaded from host RAM).

Workload "shared-document QA": one document of `--doc-tokens` tokens (wikitext-2 valid text)
and several questions about it, one request at a time; between two questions an unrelated
prompt of the same length runs, which evicts the document's pages from the pool (the pool holds
one prompt). TTFT is the wall time of a 1-token request (prefill + the first token). Results are
written after every configuration (docs/cpu/kvstore.json), then the docs section.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jaxgen.bench import harness

WIKITEXT = os.path.join(os.path.dirname(__file__), "../../../shared/data/wikitext-2/valid.txt")
PAGE = 16


def texts(tokenizer, n_tokens: int, count: int, path: str = WIKITEXT) -> list[list[int]]:
    """`count` disjoint spans of `n_tokens` tokens of the text file."""
    ids = tokenizer.encode(open(path).read()[: 40 * n_tokens * count])
    if len(ids) < n_tokens * count:
        raise ValueError(f"{path} holds fewer than {n_tokens * count} tokens")
    return [ids[i * n_tokens : (i + 1) * n_tokens] for i in range(count)]


def run_config(name, doc, questions, fillers, host_bytes, model, out_rows):
    from jaxgen import LLM, SamplingParams

    longest = len(doc) + max(len(q) for q in questions)
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=1,
        page_size=PAGE,
        num_kv_pages=-(-(longest + 16) // PAGE),  # one prompt: the filler evicts the document
        kv_host_cache_bytes=host_bytes,
        warmup=False,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(prompt):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one)
        return time.perf_counter() - t0

    for _ in range(2):  # compiles every shape of the cycle (the loads' and offloads' too)
        ttft(doc + questions[0])
        ttft(fillers[0])
    times, tokens = [], 0
    for q, filler in zip(questions[1:], fillers[1:], strict=True):
        times.append(ttft(doc + q))
        tokens += len(doc) + len(q)
        ttft(filler)  # evicts the document's pages again
    stats = llm.stats()
    tiers = stats.get("kv_tiers", {})
    row = {
        "workload": "shared-document QA",
        "config": name,
        "prompt_tokens": len(doc) + len(questions[1]),
        "requests": len(times),
        "ttft_p50_s": float(np.percentile(times, 50)),
        "ttft_p90_s": float(np.percentile(times, 90)),
        "prefill_tok_s": tokens / sum(times),
        "host_hits": tiers.get("host_hits", 0),
        "loaded_blocks": tiers.get("loaded_blocks", 0),
        "offloaded_blocks": tiers.get("offloaded_blocks", 0),
        "device_prefix_hit_tokens": stats["prefix_hit_tokens"],
    }
    out_rows.append(row)
    return row


def run(model=None, doc_tokens=2048, questions=3, out=None) -> dict:
    """Both configurations; `out`: JSON written after each one (and at the end)."""
    from jaxgen.model.loading import load_tokenizer, resolve_source

    tokenizer = load_tokenizer(resolve_source(model))
    n = questions + 1
    spans = texts(tokenizer, doc_tokens, 1 + n)
    doc, fillers = spans[0], spans[1:]
    rng = np.random.RandomState(0)
    words = tokenizer.encode(" What does the text say about the second topic and why?")
    asks = [list(rng.permutation(words)) + [int(rng.randint(100, 1000))] for _ in range(n)]
    # The fillers have the question's length too (same compiled shapes).
    fillers = [f[: doc_tokens + len(words) + 1] for f in fillers]
    rows: list[dict] = []
    result = {"machine": harness.machine_info(), "rows": rows}
    for name, host_bytes in (("recompute (tier off)", None), ("host tier", 2 << 30)):
        row = run_config(name, doc, asks, fillers, host_bytes, model, rows)
        print(row, flush=True)
        if out:
            harness.dump_json(result, out)  # as it goes
    result["ttft_p50_speedup_host"] = rows[0]["ttft_p50_s"] / rows[1]["ttft_p50_s"]
    if out:
        harness.dump_json(result, out)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--questions", type=int, default=3, help="timed questions (+1 warm-up)")
    p.add_argument("--out", default="docs/cpu/kvstore.json")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    result = run(args.model, args.doc_tokens, args.questions, args.out)
    print(f"TTFT p50 recompute / host tier: {result['ttft_p50_speedup_host']:.2f}x", flush=True)
    if args.write_docs:
        harness.write_section("kvstore", to_markdown(result))
    return 0


def to_markdown(result) -> str:
    m = result["machine"]
    table = harness.markdown_table(
        result["rows"],
        [
            ("workload", "workload"),
            ("config", "KV store"),
            ("prompt_tokens", "prompt tokens"),
            ("requests", "timed requests"),
            ("ttft_p50_s", "TTFT p50 (s)"),
            ("ttft_p90_s", "TTFT p90 (s)"),
            ("prefill_tok_s", "prompt tok/s"),
            ("loaded_blocks", "pages loaded from host"),
        ],
    )
    body = f"""## KV cache tiers (`jaxgen bench kvstore`)

SmolLM2-135M f32 on {m["cpu"]} ({m["cores"]} cores), {m["date"]}. Shared-document QA: one
document of wikitext-2 text and questions about it, one request at a time, the device pool
holding one prompt, and an unrelated prompt of the same length between two questions that
evicts the document's pages. TTFT = wall time of a 1-token request. Tier off: the document is
recomputed; host tier: its pages, written to host RAM on eviction, are loaded back.
TTFT p50 recompute / host tier: **{result["ttft_p50_speedup_host"]:.2f}x**.

{table}

Not measured yet: the multi-turn chat workload, the Mooncake Store tier, restarts from the disk
tier (tested in tests/engine/test_kv_tiers.py, not benchmarked), host swapping on preemption.
"""
    return body


if __name__ == "__main__":
    raise SystemExit(main())
