"""Collects the GPU suite's JSON results into one Markdown page.

python -m benchmarks.gpu_report DIR
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks import decode_profile, gpu_compile
from jaxgen.bench import e2e, kernels

SECTIONS = [
    ("profile.json", decode_profile.to_markdown),
    ("gpu_compile.json", gpu_compile.to_markdown),
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
