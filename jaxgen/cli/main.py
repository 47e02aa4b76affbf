"""The `jaxgen` command line: generate, chat, perplexity, convert, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DTYPES = ["float32", "bfloat16", "float16"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or jaxgen checkpoint (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights/compute dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "nf4", "fp8"],
        help="quantize the weights on load (RTN: per-channel 8-bit, group 128 int4, "
        "group 64 nf4, unless --group-size)",
    )
    p.add_argument("--group-size", type=int, default=None, help="group size for --quantization")
    p.add_argument(
        "--mesh",
        default=None,
        help="device mesh, e.g. 'tp=4' or 'dp=2,tp=2,pp=2' (dp data, tp tensor, "
        "sp sequence, pp pipeline parallel)",
    )
    p.add_argument(
        "--pipeline-microbatches",
        type=int,
        default=None,
        help="microbatches per pipelined step (default: the number of stages)",
    )
    p.add_argument(
        "--kv-cache",
        default="paged",
        choices=["paged", "contiguous"],
        help="paged: continuous batching (default); contiguous: static batches "
        "(needed for pipeline parallelism)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft", "self"],
        help="speculative decoding drafter",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None, help="--speculative draft: its path")
    p.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="--speculative self: target layers used as the drafter",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        help="multi-host: HOST:PORT of process 0 (jax.distributed; gloo on CPU)",
    )
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process")
    p.add_argument(
        "--compile-buckets",
        default=None,
        help="step shapes compiled ahead of time at start-up, e.g. "
        "'prefill:128,decode:8@1024' ('' for none; default prefill:32,prefill:64,"
        "decode:1@128,decode:1@256)",
    )
    p.add_argument(
        "--no-executable-cache",
        action="store_true",
        help="do not save/load the ahead-of-time compiled programs in the jaxgen cache",
    )
    p.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="do not turn on JAX's persistent compilation cache for this process (on by "
        "default in the command line, for the shapes not compiled ahead of time)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per token")


def _sampling_params(args):
    from jaxgen import SamplingParams

    return SamplingParams(
        n=args.n,
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
        logprobs=args.logprobs,
    )


def _llm(args, distributed: bool = True, **kwargs):
    """The engine for a command. With `distributed`, --coordinator joins a multi-process SPMD
    job (one global mesh); batch jobs instead split their lines by rank and keep each
    process's mesh on its own devices."""
    from jaxgen import LLM
    from jaxgen.sharding.distributed import initialize

    if distributed:
        initialize(args.coordinator, args.num_processes, args.process_id)
    kwargs.setdefault("kv_cache", args.kv_cache)
    if args.speculative:
        kwargs["speculative"] = {
            "method": args.speculative,
            "num_tokens": args.num_speculative_tokens,
            "model": args.draft_model,
            "num_layers": args.draft_layers,
        }
    return LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        quantization_group_size=args.group_size,
        mesh=args.mesh,
        pipeline_microbatches=args.pipeline_microbatches,
        compile_buckets=args.compile_buckets,
        executable_cache=not args.no_executable_cache,
        compilation_cache=not args.no_compilation_cache,  # the command owns its process
        **kwargs,
    )


def _read_prompts(args) -> list[str]:
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    elif args.prompt == ["-"] or (not args.prompt and not sys.stdin.isatty()):
        prompts = [sys.stdin.read().strip()]
    else:
        prompts = [" ".join(args.prompt) if args.prompt else DEFAULT_PROMPT]
    return prompts


def _cmd_generate(args) -> int:
    params = _sampling_params(args)  # validate flags before loading anything
    prompts = _read_prompts(args)
    llm = _llm(args)
    inputs = (
        prompts
        if args.raw
        else [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    )
    if len(inputs) == 1 and not args.json and params.n == 1:
        for delta in llm.stream(inputs[0], params):
            print(delta, end="", flush=True)
        print()
        return 0
    outs = llm.generate(inputs, params, use_tqdm=len(inputs) > 1)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            m = out.metrics
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "outputs": [
                            {
                                "text": c.text,
                                "token_ids": c.token_ids,
                                "finish_reason": c.finish_reason,
                                "cumulative_logprob": c.cumulative_logprob,
                            }
                            for c in out.outputs
                        ],
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
                )
            )
        else:
            for c in out.outputs:
                print(c.text)
    return 0


def _cmd_chat(args) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
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


def _cmd_perplexity(args) -> int:
    from jaxgen.entrypoints.perplexity import perplexity
    from jaxgen.model import load_model, load_tokenizer
    from jaxgen.model.tokenizer import read_text_tokens

    cfg, params = load_model(args.model, dtype=args.dtype)
    if args.quantization:
        from jaxgen.model.quantize import on_the_fly

        params = on_the_fly(params, args.quantization, args.group_size)
    ids = read_text_tokens(load_tokenizer(args.model), args.text, args.max_tokens)
    result = perplexity(
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


def _cmd_quantize(args) -> int:
    from jaxgen.model import load_model, load_tokenizer, save_checkpoint
    from jaxgen.model.quantize import QuantSpec, quantize_model

    spec = QuantSpec(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        double_quant=args.double_quant,
        act_order=args.act_order,
        alpha=args.alpha,
    )
    if spec.needs_calibration and not args.calib:
        raise ValueError(f"--method {args.method} needs --calib FILE (calibration text)")
    if args.calib and not os.path.isfile(args.calib):
        raise ValueError(f"{args.calib}: calibration file not found")
    cfg, params = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    qparams, report = quantize_model(cfg, params, spec, tokenizer=tokenizer, calib_path=args.calib)
    save_checkpoint(args.out, cfg, qparams, tokenizer)
    print(
        json.dumps(
            {"out": args.out, **{k: v for k, v in report.items() if not isinstance(v, list)}}
        )
    )
    return 0


def _cmd_batch(args) -> int:
    from jaxgen.entrypoints.batch import check_paths, merge_outputs, rank_path, run_batch

    if args.merge:
        print(json.dumps({"output": args.output, "lines": merge_outputs(args.output, args.world)}))
        return 0
    params = _sampling_params(args)  # bad flags fail before anything loads
    rank, world = _distributed(args)
    check_paths(args.input, rank_path(args.output, rank, world))
    llm = _llm(args, distributed=False, max_num_seqs=args.max_num_seqs, seed=args.seed)
    summary = run_batch(
        llm,
        args.input,
        args.output,
        params,
        seed=args.seed,
        errors_path=args.errors,
        rank=rank,
        world=world,
    )
    print(json.dumps(summary))
    return 0


def _distributed(args) -> tuple[int, int]:
    """(rank, world) from --process-id / --num-processes (or JAXGEN_RANK / JAXGEN_WORLD)."""
    world = args.num_processes or int(os.environ.get("JAXGEN_WORLD", "1"))
    rank = (
        args.process_id if args.process_id is not None else int(os.environ.get("JAXGEN_RANK", "0"))
    )
    if not 0 <= rank < world:
        raise ValueError(f"process id {rank} is not in [0, {world})")
    return rank, world


def _cmd_serve(args) -> int:
    from jaxgen.entrypoints.server import serve

    llm = _llm(args, max_num_seqs=args.max_num_seqs)
    serve(
        llm,
        host=args.host,
        port=args.port,
        model_name=args.served_model_name,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
    )
    return 0


def _cmd_convert(args) -> int:
    from jaxgen.model import convert

    print(convert(args.source, args.destination, dtype=args.dtype))
    return 0


def _cmd_bench(args) -> int:
    from jaxgen.bench import cli as bench_cli

    return bench_cli.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxgen",
        description="LLM inference in JAX: generate text, chat, measure perplexity, benchmark, "
        "convert models. Runs the embedded SmolLM2-135M-Instruct unless --model says otherwise.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text for a prompt, a file of prompts or stdin",
        description="Generate text. A single prompt is streamed as it is made.",
    )
    gen.add_argument(
        "prompt", nargs="*", help=f"prompt text; '-' reads stdin (default: {DEFAULT_PROMPT!r})"
    )
    gen.add_argument("--file", help="read prompts from FILE, one per line")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat, streamed")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--stats", action="store_true", help="print prompt size and time per turn")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=_cmd_chat, max_tokens=512)

    ppl = sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    ppl.add_argument("--max-length", type=int, default=1024, help="window length (default 1024)")
    ppl.add_argument("--stride", type=int, default=512, help="window stride (default 512)")
    ppl.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["int8", "fp8"],
        help="score with a quantized KV cache (windows fed through the page pool)",
    )
    _add_model_args(ppl)
    ppl.set_defaults(func=_cmd_perplexity)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    srv.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    srv.add_argument("--served-model-name", default="default", help="model id clients use")
    srv.add_argument("--max-num-seqs", type=int, default=32)
    srv.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests before answering 503 (back-pressure)",
    )
    _add_model_args(srv)
    srv.set_defaults(func=_cmd_serve)

    bt = sub.add_parser(
        "batch",
        help="generate for every line of a JSONL file (resumable)",
        description="Offline batch generation through continuous batching. "
        "Rerunning the same command resumes: ids already in OUTPUT are skipped.",
    )
    bt.add_argument(
        "input", help='JSONL: {"id": ..., "prompt": ...} or {"id": ..., "messages": [...]}'
    )
    bt.add_argument("output", help="JSONL results (OpenAI batch output shape)")
    bt.add_argument(
        "--errors", default=None, help="bad lines go here (default OUTPUT.errors.jsonl)"
    )
    bt.add_argument("--max-num-seqs", type=int, default=32)
    bt.add_argument("--merge", action="store_true", help="join OUTPUT.rank* files into OUTPUT")
    bt.add_argument("--world", type=int, default=1, help="with --merge: the number of ranks")
    _add_model_args(bt)
    _add_sampling_args(bt)
    bt.set_defaults(func=_cmd_batch, seed=0)

    qz = sub.add_parser("quantize", help="quantize a model and save it (LLM(model=OUT) loads it)")
    qz.add_argument(
        "--method",
        required=True,
        choices=["rtn", "smoothquant", "llm_int8", "awq", "gptq", "nf4", "fp8", "qat"],
    )
    qz.add_argument("--bits", type=int, default=None, help="3, 4 or 8 (integer methods)")
    qz.add_argument("--group-size", type=int, default=None, help="-1 = per channel")
    qz.add_argument("--calib", default=None, help="calibration text file")
    qz.add_argument("--out", required=True, help="output checkpoint directory")
    qz.add_argument("--model", default=None)
    qz.add_argument("--asymmetric", action="store_true", help="zero points (integer formats)")
    qz.add_argument("--double-quant", action="store_true", help="nf4: quantize the scales too")
    qz.add_argument("--act-order", action="store_true", help="gptq: largest Hessian rows first")
    qz.add_argument("--alpha", type=float, default=0.5, help="smoothquant migration strength")
    qz.set_defaults(func=_cmd_quantize)

    conv = sub.add_parser("convert", help="convert a HF dir or GGUF file to a jaxgen checkpoint")
    conv.add_argument("source")
    conv.add_argument("destination")
    conv.add_argument("--dtype", default="float32", choices=DTYPES)
    conv.set_defaults(func=_cmd_convert)

    from jaxgen.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # our typed errors subclass ValueError; show the message only
        print(f"jaxgen: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"jaxgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
