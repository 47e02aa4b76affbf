"""The `jaxgen` subcommands: each turns parsed arguments into the engine's objects, runs, and
prints (text, or JSON with --json)."""

from __future__ import annotations

import json
import os
import sys
import time

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
# Off unless --batch-invariant: its decode steps read page tables max_model_len wide (every
# row, every step), so its cost grows with --max-model-len (the model's, up to 8192, by
# default); measured at 1024 in docs/serving.md ("Batch jobs").
BATCH_INVARIANT_DEFAULT = False


def sampling_params(args):
    from jaxgen import SamplingParams

    return SamplingParams(
        n=getattr(args, "n", 1),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        seed=args.seed,
        logprobs=getattr(args, "logprobs", None),
    )


def llm_options(args, **kwargs) -> dict:
    """The engine options of a command's `LLM(args.model, **options)` (also what each Ray
    replica of `jaxgen batch --ray` builds its engine with)."""
    kwargs.setdefault("kv_cache", args.kv_cache)
    if getattr(args, "speculative", None):
        kwargs["speculative"] = {
            "method": args.speculative,
            "num_tokens": args.num_speculative_tokens,
            "model": args.draft_model,
            "num_layers": args.draft_layers,
        }
    return dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        quantization_group_size=args.group_size,
        mesh=args.mesh,
        pipeline_microbatches=args.pipeline_microbatches,
        compile_buckets=args.compile_buckets,
        executable_cache=not args.no_executable_cache,
        compilation_cache=not args.no_compilation_cache,  # the command owns its process
        overlap=not args.no_overlap,
        cover_new_shapes=args.cover_new_shapes,
        compile_in_background=args.compile_in_background,
        ragged_step=not args.no_ragged_step,
        **kwargs,
    )


def make_llm(args, distributed: bool = True, **kwargs):
    """The engine for a command. With `distributed`, --coordinator joins a multi-process SPMD
    job (one global mesh); batch jobs instead split their lines by rank and keep each
    process's mesh on its own devices."""
    from jaxgen import LLM
    from jaxgen.sharding.distributed import initialize

    if distributed:
        initialize(args.coordinator, args.num_processes, args.process_id)
    return LLM(args.model, **llm_options(args, **kwargs))


def read_prompts(args) -> list[str]:
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    elif args.prompt == ["-"]:  # standard input only when asked for
        prompts = [sys.stdin.read().strip()]
    else:
        prompts = [" ".join(args.prompt) if args.prompt else DEFAULT_PROMPT]
    return prompts


def token_logprobs(c, tokenizer, num_top: int) -> list[dict] | None:
    """Per generated token: its text, id, logprob and the `num_top` likeliest candidates."""
    if c.logprobs is None:
        return None
    rows = []
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        top = sorted(
            (kv for kv in entry.items() if kv[1].rank <= num_top), key=lambda kv: kv[1].rank
        )
        rows.append(
            {
                "token": tokenizer.decode([token]),
                "token_id": token,
                "logprob": entry[token].logprob,
                "rank": entry[token].rank,
                "top": [
                    {"token": tokenizer.decode([t]), "token_id": t, "logprob": lp.logprob}
                    for t, lp in top
                ],
            }
        )
    return rows


def print_completions(out, tokenizer, label: str, num_top: int) -> None:
    n = len(out.outputs)
    for c in out.outputs:
        if n > 1 or label:
            which = f"completion {c.index + 1} of {n}" if n > 1 else ""
            print(f"--- {', '.join(x for x in (label, which) if x)} ---")
        print(c.text)
        for row in token_logprobs(c, tokenizer, num_top) or []:
            alts = ", ".join(f"{a['token']!r} {a['logprob']:.3f}" for a in row["top"])
            print(f"  {row['token']!r:>18} {row['logprob']:9.4f}   top: {alts}")
        if c.logprobs is not None:
            print(f"  cumulative logprob {c.cumulative_logprob:.4f}")


def generate(args) -> int:
    params = sampling_params(args)  # validate flags before loading anything
    prompts = read_prompts(args)
    llm = make_llm(args)
    inputs = (
        prompts
        if args.raw
        else [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    )
    if len(inputs) == 1 and not args.json and params.n == 1 and params.logprobs is None:
        for delta in llm.stream(inputs[0], params):
            print(delta, end="", flush=True)
        print()
        return 0
    outs = llm.generate(inputs, params, use_tqdm=len(inputs) > 1)
    for k, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        if not args.json:
            label = f"prompt {k + 1}" if len(prompts) > 1 else ""
            print_completions(out, llm.tokenizer, label, params.logprobs or 0)
            continue
        m = out.metrics
        completions = []
        for c in out.outputs:
            item = {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "cumulative_logprob": c.cumulative_logprob,
            }
            if c.logprobs is not None:
                item["logprobs"] = token_logprobs(c, llm.tokenizer, params.logprobs)
            completions.append(item)
        record = {
            "prompt": prompt,
            "outputs": completions,
            "startup": llm.startup,
            "metrics": {
                "ttft_s": m.ttft,
                "tpot_s": m.time_per_output_token,
                "e2e_s": m.e2e_latency,
                "tokens_per_s": m.tokens_per_second,
                "prompt_tokens": m.num_prompt_tokens,
                "generated_tokens": m.num_generated_tokens,
            },
        }
        print(json.dumps(record))
    return 0


def chat(args) -> int:
    params = sampling_params(args)
    llm = make_llm(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print(
        "jaxgen chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.apply_chat_template(history)
        reply, t0 = [], time.perf_counter()
        for delta in llm.stream(prompt, params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        if args.stats:
            print(
                f"[{len(prompt['prompt_token_ids'])} prompt tokens, "
                f"{time.perf_counter() - t0:.2f} s]",
                file=sys.stderr,
            )
        history.append({"role": "assistant", "content": "".join(reply)})


def perplexity(args) -> int:
    from jaxgen.entrypoints.perplexity import perplexity as score
    from jaxgen.model import load_model, load_tokenizer
    from jaxgen.model.tokenizer import read_text_tokens

    cfg, params = load_model(args.model, dtype=args.dtype)
    if args.quantization:
        from jaxgen.model.quantize import on_the_fly

        params = on_the_fly(params, args.quantization, args.group_size)
    ids = read_text_tokens(load_tokenizer(args.model), args.text, args.max_tokens)
    result = score(
        cfg,
        params,
        ids,
        max_length=args.max_length,
        stride=args.stride,
        progress=True,
        kv_quant=args.kv_cache_dtype,
    )
    print(f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens", file=sys.stderr)
    print(json.dumps(result))
    return 0


def quantize(args) -> int:
    from jaxgen.model import load_model, load_tokenizer, save_checkpoint
    from jaxgen.model.quantize import QuantSpec, quantize_model

    spec = QuantSpec(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        double_quant=args.double_quant,
        scale_dtype=args.scale_dtype,
        outlier_share=args.outlier_share,
        act_order=args.act_order,
        alpha=args.alpha,
    )
    if spec.needs_calibration and not args.calib:
        raise ValueError(f"--method {args.method} needs --calib FILE (calibration text)")
    if args.calib and not os.path.isfile(args.calib):
        raise ValueError(f"{args.calib}: calibration file not found")
    cfg, params = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    qparams, report = quantize_model(
        cfg, params, spec, tokenizer=tokenizer, calib_path=args.calib, progress=True
    )
    save_checkpoint(args.out, cfg, qparams, tokenizer)
    print(
        json.dumps(
            {"out": args.out, **{k: v for k, v in report.items() if not isinstance(v, list)}}
        )
    )
    return 0


def batch(args) -> int:
    from jaxgen.entrypoints.batch import check_paths, merge_outputs, rank_path, run_batch

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
    invariant = args.batch_invariant
    if invariant is None:
        invariant = BATCH_INVARIANT_DEFAULT and not (
            args.mesh or args.speculative or args.kv_cache != "paged"
        )
    engine = dict(max_num_seqs=args.max_num_seqs, seed=args.seed, batch_invariant=invariant)
    if args.ray:
        from jaxgen.entrypoints.ray_batch import run_ray_batch

        summary = run_ray_batch(
            args.model,
            args.input,
            args.output,
            params,
            llm_options=llm_options(args, **engine),
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
    llm = make_llm(args, distributed=False, **engine)
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
    lora = {}
    if args.enable_lora or modules:
        lora = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    tiers = dict(
        kv_host_cache_bytes=args.kv_host_cache_bytes,
        kv_disk_cache_dir=args.kv_disk_cache_dir,
        kv_disk_cache_bytes=args.kv_disk_cache_bytes,
        kv_mooncake=args.kv_mooncake,
        kv_transfer=args.kv_transfer,
        kv_transfer_bytes=args.kv_transfer_bytes,
        kv_write_through=args.role == "prefill",
        kv_prefetch=args.kv_prefetch,
        kv_eviction_policy=args.kv_eviction_policy,
    )
    llm = make_llm(args, max_num_seqs=args.max_num_seqs, **lora, **tiers)
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


def convert(args) -> int:
    from jaxgen.model import convert as convert_model

    print(convert_model(args.source, args.destination, dtype=args.dtype))
    return 0
