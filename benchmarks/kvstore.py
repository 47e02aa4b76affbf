"""`python -m benchmarks kvstore` (also `python -m benchmarks.kvstore`): TTFT and throughput of
prompts whose long prefix was computed before but evicted from a device pool too small to keep
it, with the KV tiers off (recompute), the host tier, and a Mooncake Store (a real
`mooncake_master` and storage process on loopback, `entrypoints.mooncake_local`).

Workloads (text from wikitext-2 *valid*; the device pool holds one prompt, so each request
evicts the previous one's pages):
- shared-document QA: one document of `doc_tokens` tokens and questions about it, one request
  at a time, with an unrelated prompt of the same length between two questions.
- multi-turn chat: two conversations, each opening with a `doc_tokens`-token context, taking
  turns; every turn resends its whole conversation (earlier questions and the model's answers)
  plus a new question, and the model answers `ANSWER` tokens. The first turn is cold for every
  configuration and is not timed.
- restart: a fresh engine after the one that wrote the blocks has closed (Mooncake Store; disk
  tier), asked the document's questions: hits come from the blocks the first engine left.
- small pool: `swap_requests` requests decoding together in a pool a quarter of what they need:
  throughput when preempted sequences' pages go to the host tier vs when they are recomputed.
- overlap: a request decoding while questions about stored documents arrive; its inter-token
  gaps with the store's reads on the prefetch thread vs at admission (`overlap`).

TTFT is the engine's own measure (arrival to first token, `RequestMetrics.ttft`). Results are
written after every row (docs/cpu/kvstore.json), then the docs section and plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

from jaxgen.bench import harness

WIKITEXT = os.path.join(os.path.dirname(__file__), "../../../shared/data/wikitext-2/valid.txt")
PAGE = 16
ANSWER = 16  # tokens the model answers per chat turn
HOST_BYTES = 2 << 30
STORE_BYTES = 1 << 30


def texts(tokenizer, n_tokens: int, count: int, path: str = WIKITEXT) -> list[list[int]]:
    """`count` disjoint spans of `n_tokens` tokens of the text file."""
    ids = tokenizer.encode(open(path).read()[: 40 * n_tokens * count])
    if len(ids) < n_tokens * count:
        raise ValueError(f"{path} holds fewer than {n_tokens * count} tokens")
    return [ids[i * n_tokens : (i + 1) * n_tokens] for i in range(count)]


def make_llm(model, longest: int, tier: dict, max_num_seqs: int = 1, num_kv_pages=None):
    from jaxgen import LLM

    return LLM(
        model,
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=max_num_seqs,
        page_size=PAGE,
        num_kv_pages=num_kv_pages or -(-(longest + 16) // PAGE),  # one prompt at a time
        warmup=False,
        **tier,
    )


def ttft(llm, prompt, max_tokens: int = 1):
    """(TTFT, generated tokens) of one greedy request run alone."""
    from jaxgen import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    return out.metrics.ttft, list(out.outputs[0].token_ids)


def tier_row(llm, workload, name, times, tokens) -> dict:
    stats = llm.stats()
    tiers = stats.get("kv_tiers", {})
    return {
        "workload": workload,
        "config": name,
        "requests": len(times),
        "ttft_p50_s": float(np.percentile(times, 50)),
        "ttft_p90_s": float(np.percentile(times, 90)),
        "prefill_tok_s": tokens / sum(times),
        "ttft_s": [float(t) for t in times],
        "loaded_blocks": tiers.get("loaded_blocks", 0),
        "offloaded_blocks": tiers.get("offloaded_blocks", 0),
        "tier_hits": {k[: -len("_hits")]: v for k, v in tiers.items() if k.endswith("_hits")},
        "tier_bad": sum(v for k, v in tiers.items() if k.endswith("_bad")),
        "device_prefix_hit_tokens": stats["prefix_hit_tokens"],
    }


def qa(llm, doc, questions, fillers, warm=True):
    """TTFTs of `doc + question` for each question after the first, an unrelated filler
    evicting the document between two questions."""
    if warm:  # compiles every shape of the cycle (the loads' and offloads' too)
        for _ in range(2):
            ttft(llm, doc + questions[0])
            ttft(llm, fillers[0])
    times, tokens = [], 0
    for q, filler in zip(questions[1:], fillers[1:], strict=True):
        times.append(ttft(llm, doc + q)[0])
        tokens += len(doc) + len(q)
        ttft(llm, filler)  # evicts the document's pages again
    return times, tokens


def chat(llm, contexts, questions, turns: int):
    """Two conversations taking turns; TTFTs of every turn after the first."""
    convs = [list(c) for c in contexts]
    times, tokens = [], 0
    for turn in range(turns):
        for c, conv in enumerate(convs):
            prompt = conv + questions[(turn * len(convs) + c) % len(questions)]
            t, answer = ttft(llm, prompt, ANSWER)
            if turn:  # the first turn is cold in every configuration
                times.append(t)
                tokens += len(prompt)
            convs[c] = prompt + answer
    return times, tokens


def small_pool(model, prompts, max_tokens: int, tier: dict) -> dict:
    """Every prompt at once in a pool a quarter of what they need (preemptions)."""
    from jaxgen import SamplingParams

    need = sum(-(-(len(p) + max_tokens) // PAGE) for p in prompts)
    longest = max(len(p) for p in prompts) + max_tokens
    pages = max(need // 4, -(-longest // PAGE) + 1)
    llm = make_llm(model, longest, tier, max_num_seqs=len(prompts), num_kv_pages=pages)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up on other prompts of the same lengths (the shapes, preemption's included), so the
    # timed run finds none of its pages cached.
    warm = [{"prompt_token_ids": [t + 1 for t in p]} for p in prompts]
    llm.generate(warm, params)
    before = llm.stats()
    tiers_before = before.get("kv_tiers", {})
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    wall = time.perf_counter() - t0
    stats = llm.stats()
    tiers = stats.get("kv_tiers", {})
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "pages": pages,
        "pages_needed": need,
        "requests": len(prompts),
        "generated_tokens": generated,
        "wall_s": wall,
        "tok_s": generated / wall,
        "preemptions": stats["preemptions"] - before["preemptions"],
        "loaded_blocks": tiers.get("loaded_blocks", 0) - tiers_before.get("loaded_blocks", 0),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def overlap(model, docs, question, busy_prompts, busy_tokens: int, store_config) -> dict:
    """Loads from the Mooncake Store while another request decodes, with the reads on the
    prefetch thread vs at admission (in the step): a request decodes `busy_tokens` tokens and,
    once it has 5, questions about the documents (whose pages the store holds) arrive; the pool
    holds the busy request and one document. Per mode: the busy request's inter-token gaps
    (median before the questions; median and max after they arrive: the loads and the
    questions' own short prefills fall there), the seconds the engine thread waited on the
    store, the questions' TTFT. `docs[0]` and `busy_prompts[0]` warm up (compile) each engine."""
    from jaxgen import SamplingParams

    longest = len(docs[0]) + len(question)
    pages = -(-(longest + 1) // PAGE) + -(-(len(busy_prompts[0]) + busy_tokens) // PAGE) + 1
    busy_params = SamplingParams(max_tokens=busy_tokens, temperature=0.0, ignore_eos=True)
    ask_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for mode in ("prefetch thread", "at admission"):
        tier = {"kv_mooncake": store_config, "kv_prefetch": mode == "prefetch thread"}
        llm = make_llm(model, longest, tier, 2, pages)
        args = (question, busy_params, ask_params)
        episode(llm, busy_prompts[0], docs[:1], *args)  # warm-up: every shape of the episode
        out[mode] = episode(llm, busy_prompts[1], docs[1:], *args)
        llm.close()
        del llm
    a, b = out["prefetch thread"], out["at admission"]
    out["same_tokens"] = a.pop("busy_tokens") == b.pop("busy_tokens")
    out["gap_ratio"] = b["gap_max_after_s"] / a["gap_max_after_s"]
    out["busy_tokens"], out["questions"] = busy_tokens, len(docs) - 1
    return out


def episode(llm, busy_prompt, doc_list, question, busy_params, ask_params) -> dict:
    """One busy request with questions arriving once it has 5 tokens (`overlap`)."""
    engine = llm.engine
    (busy,) = llm.processor.make_requests([{"prompt_token_ids": busy_prompt}], busy_params)
    asks = llm.processor.make_requests(
        [{"prompt_token_ids": d + question} for d in doc_list], ask_params
    )
    engine.add_request(busy)
    added = None
    store0 = engine.kv_store.stats()
    while engine.has_work:
        engine.step()
        if added is None and len(busy.seqs[0].output_ids) >= 5:
            engine.add_requests(asks)
            added = len(busy.seqs[0].output_ids)
    gaps = np.diff(busy.seqs[0].token_times)  # gaps[added - 1:] end after the questions came
    store1 = engine.kv_store.stats()
    return {
        "gap_p50_before_s": float(np.median(gaps[: added - 1])),
        "gap_p50_after_s": float(np.median(gaps[added - 1 :])),
        "gap_max_after_s": float(gaps[added - 1 :].max()),
        "engine_wait_s": store1["lookup_seconds"] - store0["lookup_seconds"],
        "prefetch_s": store1["prefetch_seconds"] - store0["prefetch_seconds"],
        "loaded_blocks": store1["loaded_blocks"] - store0["loaded_blocks"],
        "ttft_s": [float(a.to_output().metrics.ttft) for a in asks],
        "busy_tokens": list(busy.seqs[0].output_ids),
    }


def tier_rows(model, record, result, doc, asks, fillers, contexts, turns, qa_longest,
              chat_longest) -> None:  # fmt: skip
    """The rows of every workload and tier configuration (and the restarts)."""
    from jaxgen.entrypoints.mooncake_local import LocalMooncake

    scratch = tempfile.mkdtemp(prefix="jaxgen-kvstore-")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, True)
        store = stack.enter_context(LocalMooncake(segment_bytes=STORE_BYTES))
        result["mooncake_capacity_bytes"] = store.capacity_bytes()
        configs = [
            ("recompute (tiers off)", {}),
            ("host tier", {"kv_host_cache_bytes": HOST_BYTES}),
            ("Mooncake Store", {"kv_mooncake": store.config()}),
        ]
        for name, tier in configs:
            llm = make_llm(model, qa_longest, tier)
            times, tokens = qa(llm, doc, asks, fillers)
            record(tier_row(llm, "shared-document QA", name, times, tokens))
            llm.close()
            del llm
        for name, tier in configs:
            llm = make_llm(model, chat_longest, tier)
            chat(llm, fillers[:2], asks, 2)  # warm-up: other contexts, the same shapes
            times, tokens = chat(llm, contexts, asks, turns)
            record(tier_row(llm, "multi-turn chat", name, times, tokens))
            llm.close()
            del llm
        # Restart: a fresh engine asks about the document the QA engines stored and left.
        disk = {"kv_disk_cache_dir": os.path.join(scratch, "disk")}
        writer = make_llm(model, qa_longest, disk)
        ttft(writer, doc + asks[0])
        writer.close()  # the disk tier now holds the document
        del writer
        for name, tier in (
            ("Mooncake Store, restarted engine", configs[2][1]),
            ("disk tier, restarted engine", disk),
        ):
            llm = make_llm(model, qa_longest, tier)
            # Warm-up on other text (its prompt and load shapes), then the stored document.
            warm_doc = fillers[0][: len(doc)]
            for _ in range(2):
                ttft(llm, warm_doc + asks[0])
                ttft(llm, fillers[1])
            times, tokens = qa(llm, doc, asks, fillers, warm=False)
            record(tier_row(llm, "shared-document QA", name, times, tokens))
            llm.close()
            del llm
        result["mooncake_allocated_bytes"] = store.allocated_bytes()


def run(
    model=None,
    doc_tokens: int = 2048,
    questions: int = 3,
    turns: int = 3,
    swap_requests: int = 8,
    swap_prompt: int = 32,
    swap_tokens: int = 288,
    out=None,
    parts=("tiers", "small pool", "overlap"),
) -> dict:
    """Every workload and configuration; `out`: JSON written after each row (and at the end).
    `parts`: "tiers" (the TTFT rows), "small pool", "overlap" (any of them: the others' results
    are kept from `out`)."""
    from jaxgen.model.loading import load_tokenizer, resolve_source

    tokenizer = load_tokenizer(resolve_source(model))
    n = questions + 1
    spans = texts(tokenizer, doc_tokens, 4 + n)
    doc, contexts, fillers = spans[0], spans[1:3], spans[3 : 3 + n]
    rng = np.random.RandomState(0)
    words = tokenizer.encode(" What does the text say about the second topic and why?")
    asks = [list(rng.permutation(words)) + [int(rng.randint(100, 1000))] for _ in range(n)]
    fillers = [f[: doc_tokens + len(words) + 1] for f in fillers]  # the questions' length
    qa_longest = doc_tokens + len(words) + 1
    chat_longest = doc_tokens + turns * (len(words) + 1 + ANSWER)
    rows: list[dict] = []
    result = {
        "machine": harness.machine_info(),
        "doc_tokens": doc_tokens,
        "turns": turns,
        "answer_tokens": ANSWER,
        "rows": rows,
    }

    def record(row):
        rows.append(row)
        print({k: v for k, v in row.items() if k != "ttft_s"}, flush=True)
        if out:
            harness.dump_json(result, out)  # as it goes

    old = {}
    if out and set(parts) != {"tiers", "small pool", "overlap"} and os.path.exists(out):
        with open(out) as f:
            old = json.load(f)  # the parts not run this time keep their last results
    if "tiers" in parts:
        tier_rows(model, record, result, doc, asks, fillers, contexts, turns, qa_longest,
                  chat_longest)  # fmt: skip
    else:
        rows += old.get("rows", [])
        for key in ("machine", "mooncake_capacity_bytes", "mooncake_allocated_bytes"):
            if key in old:
                result[key] = old[key]
    if "small pool" in parts:  # host swapping vs recompute preemption
        result["machine_small_pool"] = harness.machine_info()
        swap = texts(tokenizer, swap_prompt, swap_requests)
        recompute = small_pool(model, swap, swap_tokens, {})
        hosted = small_pool(model, swap, swap_tokens, {"kv_host_cache_bytes": HOST_BYTES})
        result["small_pool"] = {
            "recompute": {k: v for k, v in recompute.items() if k != "tokens"},
            "host tier": {k: v for k, v in hosted.items() if k != "tokens"},
            "same_tokens": recompute["tokens"] == hosted["tokens"],
            "throughput_ratio": hosted["tok_s"] / recompute["tok_s"],
        }
    elif "small_pool" in old:
        result["small_pool"] = old["small_pool"]
        result["machine_small_pool"] = old.get("machine_small_pool", result["machine"])
    if "overlap" in parts:  # prefetch thread vs reads at admission
        from jaxgen.entrypoints.mooncake_local import LocalMooncake

        result["machine_overlap"] = harness.machine_info()
        docs = [f[:doc_tokens] for f in fillers[:3]]
        busy = [f[:32] for f in contexts]
        with LocalMooncake(segment_bytes=STORE_BYTES) as store:
            writer = make_llm(model, qa_longest, {"kv_mooncake": store.config()})
            for d in docs:
                ttft(writer, d + asks[0])
            writer.close()  # the store now holds the documents' pages
            del writer
            result["overlap"] = overlap(model, docs, asks[0], busy, 120, store.config())
        print({"overlap": result["overlap"]}, flush=True)
    elif "overlap" in old:
        result["overlap"] = old["overlap"]
        result["machine_overlap"] = old["machine_overlap"]
    result["ratios"] = ratios(rows)
    if out:
        harness.dump_json(result, out)
    return result


def ratios(rows) -> dict:
    """TTFT p50 of recompute over each tier, per workload."""
    base = {r["workload"]: r for r in rows if r["config"].startswith("recompute")}
    out = {}
    for r in rows:
        b = base.get(r["workload"])
        if b is not None and r is not b:
            out[f"{r['workload']}: {r['config']}"] = b["ttft_p50_s"] / r["ttft_p50_s"]
    return out


def plot(result) -> list[str]:
    paths = []
    for workload, name in (("shared-document QA", "kvstore_qa.png"),
                           ("multi-turn chat", "kvstore_chat.png")):  # fmt: skip
        series = {
            r["config"]: (list(range(1, len(r["ttft_s"]) + 1)), r["ttft_s"])
            for r in result["rows"]
            if r["workload"] == workload
        }
        path = harness.plot(
            name, series, xlabel="timed request", ylabel="TTFT (s)", logy=True,
            title=f"{workload}: TTFT with the prefix stored ({result['doc_tokens']}-token text)",
        )  # fmt: skip
        if path:
            paths.append(path)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--questions", type=int, default=3, help="timed questions (+1 warm-up)")
    p.add_argument("--turns", type=int, default=3, help="chat turns per conversation")
    p.add_argument("--out", default="docs/cpu/kvstore.json")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--parts",
        default="tiers,small pool,overlap",
        help="some of 'tiers', 'small pool', 'overlap' (the others' results are kept from --out)",
    )
    args = p.parse_args(argv)
    result = run(
        args.model,
        args.doc_tokens,
        args.questions,
        args.turns,
        out=args.out,
        parts=tuple(x.strip() for x in args.parts.split(",")),
    )
    for what, ratio in result["ratios"].items():
        print(f"TTFT p50 recompute / {what}: {ratio:.2f}x", flush=True)
    if args.write_docs:
        result["plots"] = plot(result)
        harness.write_section("kvstore", to_markdown(result))
    return 0


def to_markdown(result) -> str:
    m = result["machine"]
    rows = [
        {**r, "hits": ", ".join(f"{k} {v}" for k, v in r["tier_hits"].items()) or "-",
         "speedup": result["ratios"].get(f"{r['workload']}: {r['config']}")}
        for r in result["rows"]
    ]  # fmt: skip
    table = harness.markdown_table(
        rows,
        [
            ("workload", "workload"),
            ("config", "KV store"),
            ("requests", "timed requests"),
            ("ttft_p50_s", "TTFT p50 (s)"),
            ("ttft_p90_s", "TTFT p90 (s)"),
            ("speedup", "recompute / this (p50)"),
            ("prefill_tok_s", "prompt tok/s"),
            ("loaded_blocks", "pages loaded"),
            ("hits", "tier hits"),
        ],
    )
    sp = result["small_pool"]
    swap = harness.markdown_table(
        [{"config": k, **v} for k, v in sp.items() if isinstance(v, dict)],
        [
            ("config", "preempted pages"),
            ("requests", "requests"),
            ("pages", "pool pages"),
            ("pages_needed", "pages needed"),
            ("preemptions", "preemptions"),
            ("loaded_blocks", "pages loaded"),
            ("tok_s", "generated tok/s"),
        ],
    )
    images = "\n".join(f"![{p}]({p})" for p in result.get("plots", []))
    return f"""### KV cache tiers (`python -m benchmarks kvstore`)

SmolLM2-135M f32 on {m["cpu"]} ({m["cores"]} cores), {m["date"]}, one run. The device pool holds
one prompt, so every request evicts the one before. Shared-document QA: a
{result["doc_tokens"]}-token document of wikitext-2 text and questions about it, an unrelated
prompt of the same length between two questions. Multi-turn chat: two conversations opening with
{result["doc_tokens"]}-token contexts take turns, each turn resending the conversation (with the
model's {result["answer_tokens"]}-token answers) plus a question; {result["turns"]} turns each,
the cold first turn not timed. Restarted engine: a fresh engine after the writer closed (the
Mooncake Store's blocks live in its storage process, {result["mooncake_capacity_bytes"] >> 20}
MiB; the disk tier's in files). TTFT is the engine's arrival-to-first-token time. Mooncake runs a
real `mooncake_master` and storage process on loopback (TCP).

{table}

Small pool ({sp["recompute"]["requests"]} requests of short prompts decoding long answers
together in a quarter of the pages they need, {result.get("machine_small_pool", m)["date"]}):
host-tier swapping / recompute preemption throughput
**{sp["throughput_ratio"]:.2f}x**; tokens identical: {sp["same_tokens"]}.

{swap}

{images}

{overlap_text(result)}
"""


def overlap_text(result) -> str:
    ov = result.get("overlap")
    if ov is None:
        return "Overlap of loads with other requests' steps: not measured yet."
    table = harness.markdown_table(
        [
            {"mode": k, **v, "ttft": ", ".join(f"{t:.2f}" for t in v["ttft_s"])}
            for k, v in ov.items()
            if isinstance(v, dict)
        ],  # fmt: skip
        [
            ("mode", "Mooncake reads"),
            ("gap_p50_before_s", "gap p50 before (s)"),
            ("gap_p50_after_s", "gap p50 after (s)"),
            ("gap_max_after_s", "gap max after (s)"),
            ("engine_wait_s", "engine waited on the store (s)"),
            ("prefetch_s", "prefetch thread reads (s)"),
            ("loaded_blocks", "pages loaded"),
            ("ttft", "questions' TTFT (s)"),
        ],
    )
    date = result["machine_overlap"]["date"]
    a, b = ov["prefetch thread"], ov["at admission"]
    return f"""Overlap ({date}): a request decodes {ov["busy_tokens"]} tokens; once it has 5,
{ov["questions"]} questions about {result["doc_tokens"]}-token documents whose pages the
Mooncake Store holds arrive (the pool holds the decoding request and one document). Inter-token
gaps of the decoding request with the store's reads on the prefetch thread vs at admission
inside the step: max gap after the questions arrive, at admission / prefetch =
**{ov["gap_ratio"]:.2f}x**; the decoding request's tokens identical: {ov["same_tokens"]}. The
engine thread waited {a["engine_wait_s"]:.2f} s on the store with the prefetch thread and
{b["engine_wait_s"]:.2f} s with reads at admission, but here the reads (this process's prefetch
thread and the Mooncake storage process) take the same two cores as the steps, the largest gap
is the step that writes the loaded pages into the pool and prefills the question's last page,
and the questions wait at least one step longer for their reads to be polled: on the CPU
backend `kv_prefetch` is off by default; on a GPU the host's cores are free while the device
computes.

{table}"""


if __name__ == "__main__":
    raise SystemExit(main())
