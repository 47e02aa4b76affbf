"""`jaxgen bench ...`: the drivers a user runs on their own model; each prints a table (or
JSON) and writes its docs page. The studies (`python -m benchmarks SECTION`, outside the
package) take the same options (`add_options`) and run the same way (`run_sections`)."""

from __future__ import annotations

import argparse


def add_parser(sub, formatter_class=argparse.HelpFormatter) -> None:
    p = sub.add_parser(
        "bench",
        formatter_class=formatter_class,
        help="benchmarks against peers measured in the same run",
        description="Benchmarks against peers measured in the same run. Prints a table (or "
        "JSON); --write-docs also rewrites its section on its docs page (listed in "
        "docs/benchmarks.md). The studies behind the docs run from a checkout: "
        "`python -m benchmarks --help`.",
    )
    p.add_argument(
        "which",
        choices=[*SECTIONS, "all"],
        help="what to measure ('all': every benchmark in turn)",
    )
    add_options(p)
    p.set_defaults(func=run)


def add_options(p: argparse.ArgumentParser) -> None:
    """The options every benchmark section reads (each its own; see their help)."""
    p.add_argument(
        "--compare",
        action="append",
        default=None,
        choices=["hf", "llamacpp", "none"],
        help="peer to measure in the same run (repeatable; None: transformers, and llama.cpp "
        "when llama-cpp-python is installed; 'none' for no peer)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument(
        "--write-docs",
        action="store_true",
        help="rewrite the results' section on its docs page (and its plots in docs/img)",
    )
    p.add_argument("--model", default=None, help="model to measure (None: the embedded one)")
    p.add_argument("--dtype", default="float32", help="decode: weights/compute dtype")
    p.add_argument("--batches", default="1,8,32", help="decode: batch sizes")
    p.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated per run")
    p.add_argument("--prompt-len", type=int, default=32, help="decode: prompt tokens")
    p.add_argument("--prefill-len", type=int, default=512, help="decode: prefill tokens measured")
    p.add_argument(
        "--repeats", type=int, default=3, help="decode, ragged: timed runs (the median is kept)"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="throughput / batch workload size (None: 256 / 2000)",
    )
    p.add_argument("--clients", default="1,4,16,64", help="serve: concurrent clients per level")
    p.add_argument("--seconds", type=float, default=30, help="serve: seconds per load level")
    p.add_argument(
        "--mesh",
        default=None,
        help="throughput: run both jaxgen engines on this mesh (e.g. 'pp=2'; on a CPU, host "
        "devices stand in for the mesh's devices)",
    )
    p.add_argument(
        "--prompt-lens", default="32,512", help="throughput: MIN,MAX prompt tokens per request"
    )
    p.add_argument(
        "--output-lens", default="16,256", help="throughput: MIN,MAX output tokens per request"
    )
    p.add_argument("--rate", type=float, default=0.5, help="replay: Poisson arrivals, req/s")
    p.add_argument(
        "--serve-args",
        default="",
        help="replay: more flags for the `jaxgen serve` it starts (one string, e.g. "
        "'--max-num-seqs 16')",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (checks the script works)")


SECTIONS = [
    "decode",
    "throughput",
    "serve",
    "startup",
    "replay",
]


def peers(compare: list[str] | None) -> set[str]:
    """The peers to measure: as asked, or by default transformers plus llama.cpp if installed."""
    from jaxgen.bench import llamacpp

    if compare is None:
        return {"hf"} | ({"llamacpp"} if llamacpp.available() else set())
    if "llamacpp" in compare and not llamacpp.available():
        raise SystemExit(
            "--compare llamacpp needs llama-cpp-python: pip install 'jaxgen[peers]' (see "
            "pyproject.toml for the build flags)"
        )
    return set(compare) - {"none"}


def run(args: argparse.Namespace) -> int:
    return run_sections(args, SECTIONS, _run_one)


def run_sections(args: argparse.Namespace, sections: list[str], run_one) -> int:
    """Runs `args.which` (or every one of `sections`) with `run_one(name, args)` -> (result,
    markdown): prints each table, writes its docs section (--write-docs) and the JSON."""
    from jaxgen.bench import harness

    which = sections if args.which == "all" else [args.which]
    args.peers = peers(args.compare)
    results = {}
    if getattr(args, "mesh", None) and which != ["throughput"]:
        raise SystemExit("--mesh applies to 'jaxgen bench throughput' only")
    for name in which:
        result, markdown = run_one(name, args)
        results[name] = result
        if not args.json:
            print(markdown)
        if args.write_docs:
            harness.write_section(name + _variant(name, args), markdown)
    single = results if args.which == "all" else results[args.which]
    if args.out:
        harness.dump_json(single, args.out)
    if args.json:
        print(harness.dump_json(single))
    return 0


def _variant(name: str, args) -> str:
    """A section of its own for a throughput run off the default workload or on a mesh."""
    if name != "throughput":
        return ""
    suffix = f":{args.mesh}" if args.mesh else ""
    if (args.prompt_lens, args.output_lens) != ("32,512", "16,256"):
        suffix += f":prompts {args.prompt_lens}:outputs {args.output_lens}"
    return suffix


def length_range(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} takes MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= low <= high:
        raise SystemExit(f"{flag} needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def replay_workload(args: argparse.Namespace) -> dict:
    """The requests a replay sends (`replay.run`'s keywords): tiny with --quick."""
    if args.quick:
        return dict(num_requests=6, rate=4.0, prompt_range=(8, 64), output_range=(1, 8))
    return dict(num_requests=args.num_requests or 48, rate=args.rate)


def _run_one(which: str, args: argparse.Namespace):
    from jaxgen import LLM
    from jaxgen.bench import harness

    if which == "decode":
        from jaxgen.bench import decode

        batches = tuple(int(b) for b in args.batches.split(","))
        llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(batches))
        result = decode.run(
            llm,
            batches=batches,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            prefill_len=args.prefill_len,
            compare_hf="hf" in args.peers,
            compare_llamacpp="llamacpp" in args.peers and args.model is None,
            repeats=args.repeats,
            limits=harness.machine_limits(quick=args.quick),
        )
        if args.write_docs:
            result["plot"] = decode.plot(result)
        markdown = decode.to_markdown(result)
    elif which == "throughput":
        from jaxgen.bench import throughput

        if args.mesh:
            import math

            from jaxgen.sharding.mesh import parse_mesh_spec

            harness.use_host_devices(math.prod(parse_mesh_spec(args.mesh).values()))
        result = throughput.run(
            args.model,
            mesh=args.mesh,
            prompt_range=length_range(args.prompt_lens, "--prompt-lens"),
            output_range=length_range(args.output_lens, "--output-lens"),
            num_requests=args.num_requests or 256,
            compare_hf="hf" in args.peers,
            compare_llamacpp="llamacpp" in args.peers and args.model is None,
            quick=args.quick,
        )
        markdown = throughput.to_markdown(result)
    elif which == "serve":
        from jaxgen.bench import serve_load

        levels = [1, 2] if args.quick else [int(c) for c in args.clients.split(",")]
        result = serve_load.sweep(levels, 3 if args.quick else args.seconds, args.model)
        plot = None if not args.write_docs else serve_load.plot_sweep(result, "latency_load.png")
        markdown = serve_load.sweep_markdown(result, plot)
    elif which == "replay":
        import shlex

        from jaxgen.bench import replay

        result = replay.run(args.model, serve_args=shlex.split(args.serve_args),
                            **replay_workload(args))  # fmt: skip
        markdown = replay.to_markdown(result)
    elif which == "startup":
        from jaxgen.bench import startup

        result = startup.run(args.model, quick=args.quick)
        markdown = startup.to_markdown(result)
    return result, markdown
