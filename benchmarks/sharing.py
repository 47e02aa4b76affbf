"""Memory sharing at fork, measured: parallel sampling (n > 1) and beam search with the KV pages
of a fork shared (copy-on-write, the default) and copied (`LLM(share_on_fork=False)`, an
engine that cannot share), against the PagedAttention paper (Kwon et al., SOSP 2023, §4.4, §6.3).

Workload (default model, SmolLM2-135M f32, page size 16), the issue's lengths: REQUESTS
prompts of 128-1,024 tokens (consecutive text of wikitext-2 valid) and output lengths of 64-256
tokens per request, both drawn with a fixed seed; every sequence of a request generates exactly
its request's output length (ignore_eos): (a) parallel sampling with n = 2, 4, 8 (temperature
1, seed = the request's index), (b) beam search with width 2, 4, 6 (length penalty 1). Every
configuration runs with sharing on and off in one engine and one pool (the block manager's
switch is flipped between runs; prefix caching is off, so no page is shared any other way). The
pool holds the largest configuration's biggest request without sharing, plus a fifth: memory,
not the sequence budget, is what limits how many requests run at once. Each run is done twice;
the first compiles the run's step shapes, the second is measured.

Per configuration: peak and mean KV pages in use; the mean pages per running sequence, and the
share of those that sharing saves (per sequence, so that runs holding different numbers of
sequences at once compare); requests running at once (mean, peak); preemptions; pages copied at
fork, and pages a fork had to share anyway (sharing off and no free page left: the page stays
shared, guarded by copy-on-write); output tokens/s (every returned sequence's tokens over the
wall time of the call, prefill included). Pages and running sequences are sampled after every
schedule of the engine.

Peer, in the same pool: transformers' `generate` (PyTorch CPU, same weights) with
num_return_sequences=n (sampled) and num_beams=w (num_return_sequences=w). A static-batching
system cannot page its cache, so it gets the pool's tokens as its memory: the requests, in
order, are grouped into left-padded batches whose cache (rows x (padded prompt + the batch's
longest output)) fits in the pool, and each batch runs to its longest output
(min_new_tokens = max_new_tokens); each sequence counts the tokens its request asked for.

    python -m benchmarks sharing [--quick] [--compare none] [--json] [--out F] [--write-docs]
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from jaxgen.bench import harness

REQUESTS = 4
PROMPT_RANGE = (128, 1024)
OUTPUT_RANGE = (64, 256)
SAMPLES = (2, 4, 8)
WIDTHS = (2, 4, 6)
PAGE_SIZE = 16
SEED = 0
QUICK = dict(requests=2, prompt_range=(24, 40), output_range=(3, 5), samples=(2,), widths=(2,))

# Issue 33's targets (this CPU, one run): (label, must, goal, unit).
TARGETS = {
    "beam_saved": ("beam search width {w}: KV memory saved by sharing", 35, 55, "%"),
    "sample_saved": ("parallel sampling n = {n}: KV memory saved by sharing", 6, 10, "%"),
    "beam_speedup": ("beam width {w} throughput, sharing on vs off", 1.5, 2.2, "x"),
    "sample_vs_hf": ("n = {n} throughput vs transformers", 2, 3, "x"),
}


def prompts(tokenizer, num: int, prompt_range: tuple[int, int], seed: int = SEED):
    """`num` prompts of real text, lengths uniform in `prompt_range` (fixed seed)."""
    from jaxgen.bench.decode import WIKITEXT
    from jaxgen.model.tokenizer import read_text_tokens

    rng = np.random.RandomState(seed)
    lengths = rng.randint(prompt_range[0], prompt_range[1] + 1, num).tolist()
    ids = read_text_tokens(tokenizer, WIKITEXT, sum(lengths))
    starts = np.cumsum([0] + lengths).tolist()
    return [ids[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def output_lengths(num: int, output_range: tuple[int, int], seed: int = SEED) -> list[int]:
    """Every request's output length, uniform in `output_range` (fixed seed)."""
    rng = np.random.RandomState(seed + 1)
    return rng.randint(output_range[0], output_range[1] + 1, num).tolist()


def pool_pages(prompt_range, longest_output: int, widest: int, page_size: int = PAGE_SIZE) -> int:
    """One request of the widest configuration without sharing, plus a fifth."""
    return int(1.2 * widest * -(-(prompt_range[1] + longest_output) // page_size))


@contextlib.contextmanager
def traced(engine):
    """Samples the engine after every schedule: (KV pages in use, sequences running, requests
    running)."""
    sched, samples = engine.scheduler, []
    schedule = sched.schedule

    def schedule_and_sample(*args, **kwargs):
        step = schedule(*args, **kwargs)
        if sched.running:
            running = len({s.seq.request_id for s in sched.running})
            samples.append((engine.bm.num_used_pages, len(sched.running), running))
        return step

    sched.schedule = schedule_and_sample
    try:
        yield samples
    finally:
        del sched.schedule


def ours(llm, kind: str, k: int, prompt_list, out_lens: list[int], share: bool) -> dict:
    """One configuration on our engine: a compiling run, then the measured one."""
    from jaxgen import SamplingParams

    engine = llm.engine
    engine.bm.share_on_fork = share
    if kind == "sampling":
        params = [
            SamplingParams(n=k, temperature=1.0, max_tokens=n, seed=i, ignore_eos=True)
            for i, n in enumerate(out_lens)
        ]

        def call():
            return [[c.token_ids for c in o.outputs] for o in llm.generate(prompt_list, params)]
    else:

        def call():
            out = llm.beam_search(prompt_list, beam_width=k, max_tokens=out_lens, ignore_eos=True)
            return [[h.token_ids for h in o.sequences] for o in out]

    call()
    before = engine.stats()
    with traced(engine) as samples:
        t0 = time.perf_counter()
        outputs = call()
        wall = time.perf_counter() - t0
    after = engine.stats()
    pages, seqs, running = (list(x) for x in zip(*samples, strict=True))
    tokens = sum(len(ids) for out in outputs for ids in out)
    return {
        "kind": kind,
        "k": k,
        "engine": f"jaxgen, sharing {'on' if share else 'off'}",
        "peak_pages": max(pages),
        "mean_pages": float(np.mean(pages)),
        "pages_per_seq": float(np.mean([p / n for p, n, _ in samples])),
        "mean_seqs": float(np.mean(seqs)),
        "mean_running": float(np.mean(running)),
        "peak_running": max(running),
        **{
            key: after[key] - before[key]
            for key in ("preemptions", "fork_pages_copied", "fork_pages_shared")
        },
        "steps": len(samples),
        "wall_s": wall,
        "tok_s": tokens / wall,
        "outputs": outputs,
    }


def batches(prompt_list, out_lens: list[int], k: int, pool_tokens: int) -> list[list[int]]:
    """The requests, in order, grouped into left-padded batches of k rows each whose cache
    (rows x (longest prompt + longest output)) fits in `pool_tokens`."""
    groups, group = [], []
    for i in range(len(prompt_list)):
        trial = group + [i]
        width = max(len(prompt_list[j]) for j in trial) + max(out_lens[j] for j in trial)
        if group and k * len(trial) * width > pool_tokens:
            groups.append(group)
            trial = [i]
        group = trial
    return groups + [group]


def theirs(hf, kind: str, k: int, prompt_list, out_lens: list[int], pool_tokens: int) -> dict:
    """The same configuration through transformers' generate, in static batches that fit in
    the pool (see the module's docstring)."""
    import torch

    if kind == "sampling":
        options = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    else:
        options = dict(do_sample=False, num_beams=k, length_penalty=1.0, early_stopping=False)
    torch.manual_seed(SEED)
    outputs, own_length, wall, peak_pages = [], [], 0.0, 0
    groups = batches(prompt_list, out_lens, k, pool_tokens)
    for group in groups:
        batch = [prompt_list[i] for i in group]
        width, new_tokens = max(len(p) for p in batch), max(out_lens[i] for i in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                num_return_sequences=k,
                pad_token_id=0,
                **options,
            )
        wall += time.perf_counter() - t0
        rows = out[:, width:].tolist()
        peak_pages = max(peak_pages, len(rows) * -(-(width + new_tokens) // PAGE_SIZE))
        outputs += [
            [r[: out_lens[i]] for r in rows[j * k : (j + 1) * k]] for j, i in enumerate(group)
        ]
        own_length += [out_lens[i] == new_tokens for i in group]
    seqs = len(prompt_list) * k
    return {
        "kind": kind,
        "k": k,
        "engine": "transformers",
        "peak_pages": peak_pages,
        "pages_per_seq": peak_pages / (k * max(len(g) for g in groups)),
        "mean_seqs": seqs / len(groups),
        "mean_running": len(prompt_list) / len(groups),
        "peak_running": max(len(g) for g in groups),
        "preemptions": 0,
        "wall_s": wall,
        "tok_s": sum(len(r) for out in outputs for r in out) / wall,
        "outputs": outputs,
        "own_length": own_length,
        "batches": len(groups),
    }


def sampling_page_arithmetic(prompt_list, n: int, out_lens: list[int]) -> float:
    """% of pages sharing saves once every sample has all its tokens: the prompt's full pages
    once instead of n times (a partly filled last prompt page is copied on the first write)."""
    ps = PAGE_SIZE
    on = sum(
        len(p) // ps + n * (-(-(len(p) + m) // ps) - len(p) // ps)
        for p, m in zip(prompt_list, out_lens, strict=True)
    )
    off = sum(n * -(-(len(p) + m) // ps) for p, m in zip(prompt_list, out_lens, strict=True))
    return 100 * (1 - on / off)


def run(compare_hf: bool = True, quick: bool = False, model: str | None = None) -> dict:
    from jaxgen import LLM

    settings = (
        QUICK
        if quick
        else dict(
            requests=REQUESTS,
            prompt_range=PROMPT_RANGE,
            output_range=OUTPUT_RANGE,
            samples=SAMPLES,
            widths=WIDTHS,
        )
    )
    num, longest_output = settings["requests"], settings["output_range"][1]
    widest = max(settings["samples"] + settings["widths"])
    pages = pool_pages(settings["prompt_range"], longest_output, widest)
    llm = LLM(
        model,
        max_model_len=settings["prompt_range"][1] + longest_output,
        max_num_seqs=num * widest,
        num_kv_pages=pages,
        page_size=PAGE_SIZE,
        enable_prefix_caching=False,
        warmup=False,  # each configuration's first run compiles its own step shapes
    )
    prompt_list = prompts(llm.tokenizer, num, settings["prompt_range"])
    out_lens = output_lengths(num, settings["output_range"])
    hf = None
    if compare_hf:
        from jaxgen.bench import decode

        hf = decode.hf_model(model)
        theirs(hf, "sampling", 2, prompt_list[:1], [2], pages * PAGE_SIZE)  # set-up, not timed
    configs = [("sampling", n) for n in settings["samples"]]
    configs += [("beam", w) for w in settings["widths"]]
    rows = []
    for kind, k in configs:
        on = ours(llm, kind, k, prompt_list, out_lens, share=True)
        off = ours(llm, kind, k, prompt_list, out_lens, share=False)
        on["saved_pct"] = 100 * (1 - on["pages_per_seq"] / off["pages_per_seq"])
        on["saved_peak_pct"] = 100 * (1 - on["peak_pages"] / off["peak_pages"])
        off["speed_vs_on"] = off["tok_s"] / on["tok_s"]
        off["equal_to_on"] = _equal(off["outputs"], on["outputs"])
        if kind == "sampling":
            on["page_arithmetic_pct"] = sampling_page_arithmetic(prompt_list, k, out_lens)
        rows += [on, off]
        if hf is not None:
            peer = theirs(hf, kind, k, prompt_list, out_lens, pages * PAGE_SIZE)
            on["speed_vs_hf"] = on["tok_s"] / peer["tok_s"]
            if kind == "beam":  # greedy on both sides: the best beams should agree, where
                # transformers' batch ran to the request's own length (a search run longer
                # and cut is a different search)
                own = peer["own_length"]
                peer["equal_to_on"] = _equal(
                    [s[:1] for s, o in zip(peer["outputs"], own, strict=True) if o],
                    [s[:1] for s, o in zip(on["outputs"], own, strict=True) if o],
                )
            rows.append(peer)
    for r in rows:
        del r["outputs"]
        r.pop("own_length", None)
    return {
        "machine": harness.machine_info(),
        "model": model or "SmolLM2-135M-Instruct (f32)",
        "requests": num,
        "prompt_lens": [len(p) for p in prompt_list],
        "output_lens": out_lens,
        "prompt_range": list(settings["prompt_range"]),
        "output_range": list(settings["output_range"]),
        "page_size": PAGE_SIZE,
        "pool_pages": pages,
        "rows": rows,
        "targets": targets(rows),
        "quick": quick,
    }


def _equal(a, b) -> str:
    """'k/N': requests whose sequences are the same token for token."""
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def targets(rows) -> list[dict]:
    """The issue's target rows, at the largest n and width measured."""

    def find(kind, engine):
        found = [r for r in rows if r["kind"] == kind and r["engine"] == engine]
        return max(found, key=lambda r: r["k"]) if found else None

    out = []
    beam_on, beam_off = find("beam", "jaxgen, sharing on"), find("beam", "jaxgen, sharing off")
    samp_on = find("sampling", "jaxgen, sharing on")
    values = {
        "beam_saved": beam_on and beam_on["saved_pct"],
        "sample_saved": samp_on and samp_on["saved_pct"],
        "beam_speedup": beam_off and 1 / beam_off["speed_vs_on"],
        "sample_vs_hf": samp_on and samp_on.get("speed_vs_hf"),
    }
    for key, (label, must, goal, unit) in TARGETS.items():
        value = values[key]
        row = beam_on if key.startswith("beam") else samp_on
        if row is None or value is None:
            continue
        out.append(
            {
                "measurement": label.format(w=row["k"], n=row["k"]),
                "value": f"{value:.3g}{unit}",
                "must": f"{must}{unit}",
                "goal": f"{goal}{unit}",
                "met": "goal" if value >= goal else "must" if value >= must else "no",
            }
        )
    return out


COLUMNS = [
    ("kind", "workload"),
    ("k", "n / width"),
    ("engine", "engine"),
    ("peak_pages", "peak pages"),
    ("mean_pages", "mean pages"),
    ("pages_per_seq", "pages per running sequence"),
    ("saved_pct", "saved %"),
    ("saved_peak_pct", "saved % (peak)"),
    ("page_arithmetic_pct", "saved % (page arithmetic)"),
    ("mean_seqs", "sequences running (mean)"),
    ("mean_running", "requests running (mean)"),
    ("peak_running", "(peak)"),
    ("preemptions", "preemptions"),
    ("batches", "static batches"),
    ("fork_pages_copied", "pages copied at fork"),
    ("fork_pages_shared", "shared anyway"),
    ("tok_s", "output tok/s"),
    ("speed_vs_hf", "vs transformers"),
    ("speed_vs_on", "vs sharing on"),
    ("equal_to_on", "outputs equal to sharing on"),
]
TARGET_COLUMNS = [
    ("measurement", "measurement"),
    ("value", "this run"),
    ("must", "must"),
    ("goal", "goal"),
    ("met", "met"),
]


def plot(result: dict) -> dict:
    """Saved memory and throughput against n and beam width (PNG files in docs/img)."""
    rows = result["rows"]

    def series(kind, engine, key):
        found = sorted(
            (r for r in rows if r["kind"] == kind and r["engine"] == engine), key=lambda r: r["k"]
        )
        return [r["k"] for r in found], [r.get(key) for r in found]

    kinds = (("sampling", "parallel sampling (n)"), ("beam", "beam search (width)"))
    saved = harness.plot(
        "sharing_saved.png",
        {label: series(kind, "jaxgen, sharing on", "saved_pct") for kind, label in kinds},
        xlabel="n / beam width",
        ylabel="KV pages per running sequence saved, %",
        title="KV memory saved by sharing at fork",
    )
    engines = ("jaxgen, sharing on", "jaxgen, sharing off", "transformers")
    speed = harness.plot(
        "sharing_throughput.png",
        {
            f"{label.split(' (')[0]}, {engine}": series(kind, engine, "tok_s")
            for kind, label in kinds
            for engine in engines
        },
        xlabel="n / beam width",
        ylabel="output tokens/s",
        title="Throughput, memory-bound pool",
    )
    return {"saved": saved, "throughput": speed}


def to_markdown(result: dict) -> str:
    m = result["machine"]
    lens, outs = result["prompt_lens"], result["output_lens"]
    pr, orange = result["prompt_range"], result["output_range"]
    plots = result.get("plots") or {}
    images = "".join(f"\n\n![{name}]({path})" for name, path in plots.items() if path is not None)
    return (
        f"### Memory sharing at fork: parallel sampling and beam search ({m['device']})\n\n"
        f"`python -m benchmarks sharing`{' --quick' if result['quick'] else ''}: "
        f"{result['model']}, "
        f"{result['requests']} requests per configuration, prompts of "
        f"{min(lens)}-{max(lens)} tokens (wikitext-2) and outputs of {min(outs)}-{max(outs)} "
        f"tokens per sequence (drawn per request from {pr[0]}-{pr[1]} and {orange[0]}-"
        f"{orange[1]}, fixed seed; prompts {lens}, outputs {outs}); one pool of "
        f"{result['pool_pages']} pages of "
        f"{result['page_size']} tokens for every run, prefix caching off; {m['cpu']}, "
        f"{m['date']}. Sharing on: the engine's forks share pages (copy-on-write); off: a fork "
        "copies the parent's pages (`LLM(share_on_fork=False)`). Saved %: 1 - (mean KV "
        "pages per running sequence, on / off), sampled after every schedule; (peak): from the "
        "peaks, which the pool caps; (page arithmetic): what page counting predicts once every "
        "sample is complete. Shared anyway: pages a fork without sharing found no free page for. "
        "Output tok/s: every returned sequence's tokens over the call's wall time (prefill "
        "included; second of two runs). transformers, in the same pool: "
        "`generate(num_return_sequences=n)` / `num_beams=w` over the requests in order, in "
        "left-padded static batches whose cache (rows x (padded prompt + the batch's longest "
        "output)) fits in the pool, each run to its longest output and cut to each request's "
        "length (pages: its largest batch's cache in page equivalents); its outputs-equal "
        "column compares best beams of the requests whose batch ran to their own length.\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
        + "\n\nTargets of the issue (at the largest n and width measured):\n\n"
        + harness.markdown_table(result["targets"], TARGET_COLUMNS)
        + images
        + "\n\nThe paper (vLLM on OPT-13B, A100, its own request traces at a sustained request "
        "rate) reports roughly 6-10% of KV memory saved for parallel sampling and 38-55% for "
        "beam search. This run differs: a few requests on a CPU rather than a request stream "
        "on a GPU, a 135M model, and prompts long next to the outputs, so that the share of "
        "pages a parallel sample can share (its prompt) is far larger than in the paper's "
        "traces; saved % grows with prompt length over output length, as the page arithmetic "
        "column shows."
    )
