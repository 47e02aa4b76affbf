"""The ragged step against the step shaped by its rows: whole `llm.generate`, same run.

    python -m benchmarks ragged [--model M] [--quick]

Two engines of the same model in one process, `ragged_step=True` (one flat token axis, a program
per token bucket, all compiled at start-up) and `ragged_step=False` (the `StepShape` step, a
program per combination of rows), each warmed up on the same workload first (so neither times
a compile), then timed in alternation: B=1 (one prompt) and B=32 (32 prompts at once), prompts
of real text, greedy, `ignore_eos` so every request generates exactly its tokens. Reported:
output tokens/s of each (median of the repeats), the ratio new / old, and each engine's step
programs and its XLA compiles during the timed runs (the ragged engine's must be 0).

    python -m benchmarks ragged-replay [--model M] [--num-requests 48] [--rate 0.5] [--quick]

The same comparison served: `jaxgen bench replay`'s mixed replay (`bench.replay.run`) against
`jaxgen serve` on the ragged step, then against the step shaped by its rows
(`--no-ragged-step`), same workload, one after the other, with the ratios of their latencies.
"""

from __future__ import annotations

import statistics
import time

from jaxgen.bench import harness
from jaxgen.engine.params import SamplingParams

CASES = ((1, 128, 128), (32, 128, 64))  # (batch, prompt tokens, output tokens)


def _timed(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def run(model: str | None = None, quick: bool = False, repeats: int = 3) -> dict:
    from jaxgen import LLM
    from jaxgen.bench.decode import prompt_ids
    from jaxgen.engine.metrics import CompileCounter

    cases = ((1, 16, 8), (4, 16, 8)) if quick else CASES
    engines = {}
    for name, ragged in (("ragged", True), ("rows", False)):
        t0 = time.perf_counter()
        llm = LLM(model, ragged_step=ragged, executable_cache=False, max_num_seqs=32)
        engines[name] = (llm, time.perf_counter() - t0)
    tokenizer = engines["ragged"][0].tokenizer
    rows = []
    for batch, prompt_len, out_len in cases:
        text = prompt_ids(tokenizer, 1, batch * prompt_len + 1)[0]
        prompts = [text[i * prompt_len : (i + 1) * prompt_len] for i in range(batch)]
        params = SamplingParams(
            temperature=0.0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True
        )
        speeds = {name: [] for name in engines}
        compiles = {name: 0 for name in engines}
        for llm, _ in engines.values():
            llm.generate(prompts, params)  # warm-up: whatever programs the shapes need
        for _ in range(1 if quick else repeats):
            for name, (llm, _) in engines.items():
                counter = CompileCounter().install()
                try:
                    speeds[name].append(_timed(llm, prompts, params))
                finally:
                    counter.close()
                compiles[name] += counter.compiles
        new, old = (statistics.median(speeds[n]) for n in ("ragged", "rows"))
        rows.append(
            {
                "batch": batch,
                "prompt_tokens": prompt_len,
                "output_tokens": out_len,
                "ragged_tok_s": new,
                "rows_tok_s": old,
                "ratio": new / old,
                "ragged_compiles": compiles["ragged"],
                "rows_compiles": compiles["rows"],
            }
        )
    programs = {
        name: sorted({k[1].describe() for k in llm._note_program.keys if k[0] == "paged_step"})
        for name, (llm, _) in engines.items()
    }
    return {
        "machine": harness.machine_info(),
        "rows": rows,
        "start_s": {name: s for name, (_, s) in engines.items()},
        "repeats": 1 if quick else repeats,
        "programs": programs,
    }


def to_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "### Ragged step vs row-shaped step, whole `llm.generate` "
        f"({m['cpu']}, {m['cores']} cores)",
        "",
        "`python -m benchmarks ragged`, default model, f32, greedy, `ignore_eos`; median of "
        f"{result['repeats']} timed runs of each (alternating) after a warm-up of each engine; "
        f"{m['date']}.",
        "",
        "| batch | prompt | output | ragged tok/s | rows tok/s | ragged / rows | compiles "
        "(ragged, rows) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['prompt_tokens']} | {r['output_tokens']} | "
            f"{r['ragged_tok_s']:.1f} | {r['rows_tok_s']:.1f} | {r['ratio']:.2f}x | "
            f"{r['ragged_compiles']}, {r['rows_compiles']} |"
        )
    start = result["start_s"]
    lines += [
        "",
        f"Start-up (no executable cache): ragged {start['ragged']:.1f} s, "
        f"rows {start['rows']:.1f} s.",
        "",
    ]
    for name, shapes in result["programs"].items():
        lines.append(f"- {name}: {len(shapes)} step programs: " + "; ".join(shapes))
    return "\n".join(lines) + "\n"


def replay_pair(
    model: str | None = None, *, serve_args: list[str] | None = None, **workload
) -> dict:
    """The replay against the ragged step, then against the older step shaped by its rows
    (`--no-ragged-step`), same workload, one after the other."""
    from jaxgen.bench import replay

    serve_args = serve_args or []
    runs = [replay.run(model, serve_args=args, **workload)
            for args in (serve_args, [*serve_args, "--no-ragged-step"])]  # fmt: skip
    return {"runs": runs}


def replay_markdown(result: dict) -> str:
    from jaxgen.bench import replay

    text = replay.to_markdown(result, command="python -m benchmarks ragged-replay")
    if len(result["runs"]) == 2 and result["runs"][1]["ttft_p90_s"]:
        new, old = result["runs"]
        text += (
            f"\n\nRagged / row-shaped step: TTFT p90 {new['ttft_p90_s'] / old['ttft_p90_s']:.2f}x, "
            f"p50 {new['ttft_p50_s'] / old['ttft_p50_s']:.2f}x, request p90 "
            f"{new['latency_p90_s'] / old['latency_p90_s']:.2f}x.\n"
        )
    return text
