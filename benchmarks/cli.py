"""`python -m benchmarks SECTION`: the studies, with `jaxgen bench`'s options and output (a
table or JSON; --write-docs rewrites the section on its docs page)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from jaxgen.bench import cli as bench_cli

SECTIONS = [
    "speculative",
    "overhead",
    "sharing",
    "structured",
    "lora",
    "batch",
    "moe",
    "disagg-sim",
    "kvstore",
    "disagg",
    "sharding",
    "ragged",
    "ragged-replay",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The studies behind docs/ (not installed with jaxgen). Prints a table (or "
        "JSON); --write-docs also rewrites its section on its docs page.",
    )
    p.add_argument("which", choices=[*SECTIONS, "all"], help="what to measure")
    bench_cli.add_options(p)
    # The options of the studies alone (jaxgen bench's drivers take add_options' only).
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="batch: a small random Llama with the default tokenizer instead of --model (the "
        "2,000-request job in minutes on a CPU)",
    )
    p.add_argument(
        "--batch-parts",
        default="invariant,fault",
        help="batch: measurements besides Ray's overhead (comma-separated; '' for none)",
    )
    p.add_argument(
        "--batch-default-mode",
        action="store_true",
        help="batch: compare the local and Ray jobs in the default mode (not batch-invariant)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return bench_cli.run_sections(args, SECTIONS, run_one)


def run_one(which: str, args: argparse.Namespace):
    """(result, markdown) of one study."""
    if which == "speculative":
        from benchmarks import speculative

        result = speculative.run(quick=args.quick)
        return result, speculative.to_markdown(result)
    if which == "overhead":
        from benchmarks import overhead

        result = overhead.run(quick=args.quick)
        return result, overhead.to_markdown(result)
    if which == "sharing":
        from benchmarks import sharing

        result = sharing.run(compare_hf="hf" in args.peers, quick=args.quick, model=args.model)
        if args.write_docs:
            result["plots"] = sharing.plot(result)
        return result, sharing.to_markdown(result)
    if which == "structured":
        from benchmarks import structured

        result = structured.run(quick=args.quick, model=args.model)
        return result, structured.to_markdown(result)
    if which == "lora":
        from benchmarks import lora

        result = lora.run(quick=args.quick, model=args.model)
        return result, lora.to_markdown(result)
    if which == "batch":
        from benchmarks import batch

        result = batch.run(
            args.model,
            num_requests=args.num_requests or 2000,
            repeats=args.repeats,
            quick=args.quick,
            prompt_range=bench_cli.length_range(args.prompt_lens, "--prompt-lens"),
            output_range=bench_cli.length_range(args.output_lens, "--output-lens"),
            random_weights=args.random_weights,
            out=args.out and args.out + ".partial",
            parts=tuple(p for p in args.batch_parts.split(",") if p),
            invariant=not args.batch_default_mode,
        )
        return result, batch.to_markdown(result)
    if which == "moe":
        from benchmarks import moe

        result = moe.run(quick=args.quick)
        return result, moe.to_markdown(result)
    if which == "disagg-sim":
        from benchmarks.disagg import sim
        from jaxgen import LLM

        result = sim.run(
            quick=args.quick, llm_factory=lambda: LLM(args.model, dtype=args.dtype, warmup=False)
        )
        if args.write_docs:
            result["plots"] = sim.plot(result)
        return result, sim.to_markdown(result)
    if which == "kvstore":
        from benchmarks import kvstore

        quick = {}
        if args.quick:
            quick = dict(doc_tokens=96, questions=2, turns=2, swap_requests=4, swap_prompt=32,
                         swap_tokens=8)  # fmt: skip
        result = kvstore.run(args.model, out="docs/cpu/kvstore.json" if args.write_docs else None,
                             **quick)  # fmt: skip
        return result, kvstore.to_markdown(result)
    if which == "disagg":
        from benchmarks.disagg import measure

        small = dict(scale=32, num_requests=6) if args.quick else {}
        result = measure.run(out="docs/cpu/disagg.json" if args.write_docs else None, **small)
        if args.write_docs:
            result["plots"] = measure.plot(result)
        return result, measure.to_markdown(result)
    if which == "sharding":
        import jax

        from benchmarks import sharding
        from jaxgen.bench import harness

        harness.use_host_devices(8)  # the meshes need 8 devices; on a CPU, 8 host devices
        if jax.device_count() >= 8:
            result = sharding.run(quick=args.quick)
        else:  # JAX already started with fewer devices (`all`): a fresh process
            cmd = [sys.executable, "-m", "benchmarks", "sharding", "--json"]
            out = subprocess.run(cmd + ["--quick"] * args.quick, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"benchmarks sharding failed: {out.stderr[-2000:]}")
            result = json.loads(out.stdout)
        return result, sharding.to_markdown(result)
    if which == "ragged":
        from benchmarks import ragged

        result = ragged.run(args.model, quick=args.quick, repeats=args.repeats)
        return result, ragged.to_markdown(result)
    if which == "ragged-replay":
        import shlex

        from benchmarks import ragged

        result = ragged.replay_pair(args.model, serve_args=shlex.split(args.serve_args),
                                    **bench_cli.replay_workload(args))  # fmt: skip
        return result, ragged.replay_markdown(result)
    raise ValueError(f"unknown study {which!r}; the studies: {', '.join(SECTIONS)}")
