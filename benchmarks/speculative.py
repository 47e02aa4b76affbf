"""Speculative decoding on the default model: tokens/s and acceptance of each drafter against
no speculation, measured in the same run, on (1) an editing prompt (the answer repeats much of
the prompt: prompt lookup shines) and (2) open-ended generation.

    python -m benchmarks speculative [--json]
"""

from __future__ import annotations

import time

import numpy as np

from jaxgen.bench import harness

EDIT_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog, who was very lazy, did not move at "
    "all. Then the fox ran into the forest, where it met a family of rabbits who lived under an "
    "old oak tree. The rabbits were friendly and invited the fox for dinner."
)
TASKS = {
    "edit (repeat the text with one change)": [
        {
            "role": "user",
            "content": "Rewrite the following text exactly, but replace the word 'fox' with "
            "'cat':\n\n" + EDIT_TEXT,
        }
    ],
    "open generation": [{"role": "user", "content": "Write a short story about a lighthouse."}],
}
DRAFTERS = {
    "none": None,
    "ngram": {"method": "ngram", "num_tokens": 4},
    "self (first 8 of 30 layers)": {"method": "self", "num_tokens": 3, "num_layers": 8},
}


def run(quick: bool = False, max_tokens: int = 128, repeats: int = 3) -> dict:
    """Each (drafter, task) timed `repeats` times after a warm-up; the median run is reported
    (this machine has multi-second slow spells; one run per cell was not enough)."""
    from jaxgen import LLM, SamplingParams

    if quick:
        max_tokens = 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = []
    for name, spec in DRAFTERS.items():
        llm = LLM(max_num_seqs=1, max_model_len=1024, speculative=spec)
        for task, messages in TASKS.items():
            # Warm-up: the same request, so every program the timed run needs (decode and verify
            # steps at each page-table width it reaches) is compiled before it; then the prefix
            # cache is emptied, so the timed run computes its prompt as the warm-up did.
            llm.chat(messages, params)
            timed = []
            before = llm.stats().get("speculative", {})
            for _ in range(1 if quick else repeats):
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                out = llm.chat(messages, params)[0]
                timed.append(time.perf_counter() - t0)
            seconds = float(np.median(timed))
            after = llm.stats().get("speculative", {})
            drafted = after.get("drafted", 0) - before.get("drafted", 0)
            accepted = after.get("accepted", 0) - before.get("accepted", 0)
            verify_rows = after.get("verify_rows", 0) - before.get("verify_rows", 0)
            tokens = len(out.outputs[0].token_ids)
            rows.append(
                {
                    "drafter": name,
                    "task": task,
                    "tokens": tokens,
                    "tok_s": tokens / seconds,
                    "seconds": seconds,
                    "acceptance": accepted / drafted if drafted else None,
                    "mean_accepted": (accepted + verify_rows) / verify_rows
                    if verify_rows
                    else None,
                    "text_head": out.outputs[0].text[:60],
                }
            )
        del llm
    for row in rows:
        base = next(r for r in rows if r["drafter"] == "none" and r["task"] == row["task"])
        row["speedup"] = row["tok_s"] / base["tok_s"]
        row["same_text"] = row["text_head"] == base["text_head"]
    return {
        "machine": harness.machine_info(),
        "max_tokens": max_tokens,
        "repeats": 1 if quick else repeats,
        "rows": rows,
    }


COLUMNS = [
    ("task", "task"),
    ("drafter", "drafter"),
    ("tok_s", "tok/s"),
    ("speedup", "× none"),
    ("acceptance", "acceptance"),
    ("mean_accepted", "tokens / verify"),
    ("same_text", "same text"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    return (
        f"### Speculative decoding (default model, greedy, batch 1)\n\n"
        f"`python -m benchmarks speculative`: up to {result['max_tokens']} tokens per task, "
        "median of "
        f"{result.get('repeats', 1)} timed runs after a warm-up run; "
        f"{m['cpu']} ({m['cores']} cores), {m['date']}.\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
    )
