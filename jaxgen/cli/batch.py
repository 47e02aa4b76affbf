"""`jaxgen batch`: its flags and its command (a JSONL file through continuous batching,
resumable; optionally a Ray Data pipeline)."""

from __future__ import annotations

import json
import os

from jaxgen.cli.options import (
    add_engine_args,
    add_sampling_args,
    add_tool_args,
    command,
    llm_options,
    make_llm,
    sampling_params,
)


def add_parser(sub) -> None:
    """`jaxgen batch`: its options and its command."""
    bt = command(
        sub,
        "batch",
        "generate for every line of a JSONL file (resumable)",
        "Offline batch generation through continuous batching. Each line's fields override the "
        "job's sampling flags. Rerunning the same command resumes: ids already in OUTPUT are "
        "skipped. The summary counts empty outputs and finish reasons.",
    )
    bt.add_argument(
        "input",
        help='JSONL, OpenAI\'s batch format: {"custom_id": ..., "method": "POST", '
        '"url": "/v1/chat/completions" or "/v1/completions", "body": {...}}; or '
        'flat lines {"id": ..., "messages": [...]} / {"id": ..., "prompt": ...} '
        "with SamplingParams fields",
    )
    bt.add_argument("output", help="JSONL results (OpenAI batch output shape)")
    bt.add_argument("--errors", default=None, help="bad lines go here (None: OUTPUT.errors.jsonl)")
    bt.add_argument(
        "--raw",
        action="store_true",
        help="send flat 'prompt' lines as they are (by default they go through the chat "
        "template, as in generate)",
    )
    bt.add_argument("--merge", action="store_true", help="join OUTPUT.rank* files into OUTPUT")
    bt.add_argument("--world", type=int, default=1, help="with --merge: the number of ranks")
    ray = bt.add_argument_group("Ray Data (--ray; needs the ray extra: pip install 'jaxgen[ray]')")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="run the job as a Ray Data pipeline over an actor pool of engines; INPUT and "
        "OUTPUT may be Parquet (*.parquet) and pyarrow.fs URIs (s3://...)",
    )
    ray.add_argument("--replicas", type=int, default=1, help="engine actors (one LLM each)")
    ray.add_argument(
        "--ray-address",
        default=None,
        help="cluster to join ('auto' after `ray start --head`, or ray://HOST:10001; None: "
        "a new local one)",
    )
    ray.add_argument(
        "--ray-batch-size",
        type=int,
        default=64,
        help="lines per block fed to a replica (the unit retried after a fault)",
    )
    ray.add_argument("--cpus-per-replica", type=float, default=1, help="CPUs Ray reserves")
    ray.add_argument(
        "--gpus-per-replica",
        type=float,
        default=0,
        help="GPUs per replica (--mesh spans them)",
    )
    ray.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="restarts of a dead replica and retries of its block",
    )
    add_tool_args(bt)
    add_engine_args(bt)
    add_sampling_args(bt)
    bt.set_defaults(func=batch, seed=0)


def batch(args) -> int:
    from jaxgen.entrypoints.batch import (
        check_paths,
        merge_outputs,
        rank_path,
        run_batch,
    )

    if args.merge:
        print(json.dumps({"output": args.output, "lines": merge_outputs(args.output, args.world)}))
        return 0
    params = sampling_params(args)  # bad flags fail before anything loads
    job = dict(
        seed=args.seed,
        errors_path=args.errors,
        raw=args.raw,
        model_name=args.model or "default",
        tool_call_parser=args.tool_call_parser,
    )
    if args.ray:
        from jaxgen.entrypoints.ray_batch import run_ray_batch

        options = llm_options(args)
        summary = run_ray_batch(
            options.pop("model"),
            args.input,
            args.output,
            params,
            llm_options=options,
            replicas=args.replicas,
            batch_size=args.ray_batch_size,
            cpus_per_replica=args.cpus_per_replica,
            gpus_per_replica=args.gpus_per_replica,
            max_retries=args.max_retries,
            address=args.ray_address,
            **job,
        )
        print(json.dumps(summary))
        return 0
    rank, world = distributed_rank(args)
    check_paths(args.input, rank_path(args.output, rank, world))
    llm = make_llm(args, distributed=False)
    summary = run_batch(llm, args.input, args.output, params, rank=rank, world=world, **job)
    print(json.dumps(summary))
    return 0


def distributed_rank(args) -> tuple[int, int]:
    """(rank, world) from --process-id / --num-processes (or JAXGEN_RANK / JAXGEN_WORLD)."""
    world = args.num_processes or int(os.environ.get("JAXGEN_WORLD", "1"))
    rank = (
        args.process_id if args.process_id is not None else int(os.environ.get("JAXGEN_RANK", "0"))
    )
    if not 0 <= rank < world:
        raise ValueError(f"process id {rank} is not in [0, {world})")
    return rank, world
