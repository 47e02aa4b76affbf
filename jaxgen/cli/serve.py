"""`jaxgen serve`: its flags and its command (the OpenAI-compatible server; a disaggregated
role, the router, or a whole local deployment)."""

from __future__ import annotations

import argparse

from jaxgen.cli.options import add_engine_args, add_tool_args, command, make_llm


def add_parser(sub) -> None:
    """`jaxgen serve`: its options and its command."""
    srv = command(
        sub,
        "serve",
        "OpenAI-compatible HTTP server (continuous batching)",
        "Serves /v1/completions, /v1/chat/completions (streaming too), /v1/models, /health and "
        "/metrics (Prometheus) over continuous batching. Clients name the model by "
        "--served-model-name. Unless --compile-buckets says otherwise, the steps of prompts up "
        "to 128 tokens and of decoding at every batch size up to --max-num-seqs compile before "
        "/health answers, so the first requests are not the slow ones.",
    )
    srv.add_argument("--host", default="127.0.0.1", help="listen address")
    srv.add_argument("--port", type=int, default=8000, help="listen port")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    srv.add_argument("--served-model-name", default="default", help="model id clients use")
    srv.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests before answering 503",
    )
    srv.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per engine step (seconds, rows, tokens, prefill chunks, "
        "decode context, the padded program it ran, compiled or not, pid) to FILE: the step "
        "times of a served load, for "
        "fitting a latency model (python -m benchmarks disagg)",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) loaded at start, served as model NAME "
        "(implies --enable-lora)",
    )
    _add_disaggregation_args(srv)
    add_tool_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=serve)


def _add_disaggregation_args(srv: argparse.ArgumentParser) -> None:
    """`jaxgen serve`'s disaggregated roles, the router and the KV transfer."""
    srv.add_argument(
        "--role",
        choices=("both", "prefill", "decode", "router"),
        default="both",
        help="disaggregated serving: 'prefill' runs prompts and keeps their KV pages where "
        "decode instances read them (Mooncake's transfer engine: --kv-transfer, or a Mooncake "
        "Store: --kv-mooncake), 'decode' reads them into its pool and generates, 'router' "
        "(no model) sends each request to a prefill then a decode instance (--prefill, "
        "--decode) or to one of several colocated instances (--instance), cache-aware; "
        "'both' (default): one colocated instance",
    )
    srv.add_argument(
        "--instance",
        nargs="+",
        default=[],
        metavar="URL",
        help="router: colocated instances (each runs whole requests)",
    )
    srv.add_argument(
        "--router-load-weight",
        type=float,
        default=1.0,
        help="router: a request goes where cached prompt tokens - this x queued tokens is "
        "highest (0: by cached prefix alone)",
    )
    srv.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="router: prefill instances",
    )
    srv.add_argument(
        "--decode",
        nargs="+",
        default=[],
        metavar="URL",
        help="router: decode instances",
    )
    srv.add_argument(
        "--disaggregated",
        default=None,
        metavar="xPyD",
        help="starts a whole local deployment: a Mooncake master, x prefill and y decode "
        "instances moving KV pages by the transfer engine (the other options apply to each) "
        "and the router on --host/--port; "
        "waits for their health, stops them all on exit. E.g. 1P1D",
    )


def lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... as [(name, path)]."""
    modules = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        modules.append((name, path))
    return modules


def serve(args) -> int:
    from jaxgen.entrypoints.server import serve as run_server

    if args.role == "router":
        from jaxgen.entrypoints.disagg.router import serve_router

        serve_router(
            args.prefill,
            args.decode,
            instances=args.instance,
            load_weight=args.router_load_weight,
            host=args.host,
            port=args.port,
        )
        return 0
    if args.disaggregated:
        from jaxgen.entrypoints.disagg.local import serve_local

        return serve_local(args.disaggregated, args.argv, host=args.host, port=args.port)
    if args.prefill or args.decode or args.instance:
        raise ValueError("--prefill, --decode and --instance are the router's: add --role router")
    if args.role in ("prefill", "decode") and args.kv_mooncake is None and args.kv_transfer is None:
        raise ValueError(
            f"--role {args.role} needs --kv-transfer CONFIG.json (Mooncake's transfer engine "
            "moves the KV pages) or --kv-mooncake CONFIG.json (they move through a Mooncake "
            "Store); or try the whole deployment: --disaggregated 1P1D"
        )

    if args.compile_buckets is None:  # compiled before /health answers: no slow first burst
        from jaxgen.engine.runner import aot

        args.compile_buckets = ",".join(aot.serving_buckets(args.max_num_seqs))
    modules = lora_modules(args.lora_modules)  # a bad spec fails before the model loads
    if args.step_log is not None:
        try:  # unwritable: fails before the model loads
            open(args.step_log, "a").close()
        except OSError as e:
            raise ValueError(
                f"--step-log {args.step_log}: {e.strerror}; give a writable file"
            ) from None
    # A prefill instance writes a finished prompt's pages down its tiers at once, where the
    # decode instances read them.
    llm = make_llm(
        args,
        enable_lora=args.enable_lora or bool(modules),
        kv_write_through=args.kv_write_through or args.role == "prefill",
    )
    for name, path in modules:
        llm.load_lora(name, path)
    run_server(
        llm,
        host=args.host,
        port=args.port,
        model_name=args.served_model_name,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        tool_call_parser=args.tool_call_parser,
        role=None if args.role == "both" else args.role,
        step_log=args.step_log,
    )
    return 0
