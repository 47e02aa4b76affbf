"""Collects the GPU suite's JSON results into one Markdown page.

python -m benchmarks.gpu_report DIR
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks import decode_profile, kernels
from jaxgen.bench import e2e
from jaxgen.bench.gpu_compile import size_text


def gpu_compile_markdown(result: dict) -> str:
    """The deviceless compile's rows (`jaxgen bench gpu-compile --out F.json`) as a table."""
    lines = [
        f"Deviceless compile for the {result['target'].upper()} target (JAX {result['jax']}, "
        f"{result['date']}); bf16 activations and cache, 1k context.",
        "",
        "kernels: kernel launches (loop bodies included); launches: kernels and memcpy thunks; "
        "copies: memcpy thunks and copy/transpose kernels; temp: XLA's temporary buffer; "
        "weight-sized: temporaries as large as a weight matrix (dequantized weights, or a "
        "matrix-vector product XLA split into multiply + reduce).",
        "",
        "| program | model | B | weights | kernels | launches / layer | copies | temp "
        "| one cmd buffer | largest temporary (HLO, origin) | weight-sized (dequant) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        head = f"| {r['program']} | {r['model']} | {r['batch']} | {r['weights']} |"
        if "error" in r:
            lines.append(head + f" {r['error'][:120]} | | | | | | |")
            continue
        big = r["largest_temps"][0] if r["largest_temps"] else None
        where = (
            f"{size_text(big['bytes'])} `{big['op']}` {big['shape'].split('{')[0]} "
            f"({big['origin'].split('/')[-1] or '-'})"
            if big
            else "-"
        )
        lines.append(
            head + f" {r['kernels']} | {r['launches_per_layer']:.1f} | {r['copies']} | "
            f"{size_text(r['temp_bytes'])} | {'yes' if r['one_command_buffer'] else 'no'} | "
            f"{where} | "
            f"{len(r['weight_sized_temps']) + len(r['dequant_copies'])} "
            f"({len(r['dequant_copies'])}) |"
        )
    return "\n".join(lines) + "\n"


SECTIONS = [
    ("profile.json", decode_profile.to_markdown),
    ("gpu_compile.json", gpu_compile_markdown),
    ("flash.json", kernels.flash_markdown),
    ("paged.json", kernels.paged_markdown),
    ("prefill.json", kernels.chunked_prefill_markdown),
    ("e2e.json", e2e.to_markdown),
]


def render(directory: str) -> str:
    parts = ["## GPU suite\n"]
    summary = os.path.join(directory, "summary.txt")
    if os.path.exists(summary):
        with open(summary) as f:
            steps = [line.split() for line in f if line.strip()]
        parts.append(
            "| step | status | seconds |\n|---|---|---|\n"
            + "\n".join(f"| {s[0]} | {s[1]} | {s[2]} |" for s in steps if len(s) == 3)
        )
    log = os.path.join(directory, "log.txt")
    if os.path.exists(log):
        with open(log) as f:
            lines = [line.strip() for line in f]
        tests = [x for x in lines if (" passed" in x or " failed" in x) and " in " in x]
        parts.append(f"GPU-marked tests: `{tests[-1] if tests else 'no result line in log.txt'}`")
    for name, to_markdown in SECTIONS:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path) as f:
                parts.append(to_markdown(json.load(f)))
        else:
            parts.append(f"({name} missing: that step failed; see its log)")
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    directory = argv[0] if argv else "bench/results"
    text = render(directory)
    with open(os.path.join(directory, "gpu_suite.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
