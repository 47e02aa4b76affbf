"""The `jaxgen` command line: its parser (every subcommand and option, with their defaults)
and `main`. The commands themselves are in `cli.commands`; importing this module imports no
JAX, so `--help` answers at once."""

from __future__ import annotations

import argparse
import sys

from jaxgen.cli import commands
from jaxgen.cli.commands import DEFAULT_PROMPT
from jaxgen.entrypoints.tool_calls import FORMATS

DTYPES = ["float32", "bfloat16", "float16"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What every command that loads a model takes."""
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or jaxgen checkpoint (None: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights/compute dtype")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "nf4", "fp8"],
        help="quantize the weights on load (RTN: per-channel 8-bit, group 128 int4, "
        "group 64 nf4, unless --group-size)",
    )
    p.add_argument("--group-size", type=int, default=None, help="group size for --quantization")


def _add_engine_args(p: argparse.ArgumentParser, speculative: bool = True) -> None:
    """What the commands that run the engine (generate, chat, serve, batch) take."""
    _add_model_args(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (None: the model's limit, at most 8192)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="device mesh, e.g. 'tp=4' or 'dp=2,tp=2,pp=2' (dp data, tp tensor, "
        "sp sequence, pp pipeline parallel; None: one device)",
    )
    p.add_argument(
        "--pipeline-microbatches",
        type=int,
        default=None,
        help="microbatches per pipelined step (None: the number of stages)",
    )
    p.add_argument(
        "--kv-cache",
        default="paged",
        choices=["paged", "contiguous"],
        help="paged: continuous batching; contiguous: static batches",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="read each step's tokens back before dispatching the next (default: overlap)",
    )
    p.add_argument(
        "--cover-new-shapes",
        type=float,
        default=0.0,
        metavar="FACTOR",
        help="run a step whose program has not compiled yet on a compiled one that covers it "
        "(padded further) when that costs at most FACTOR times its own work, instead of "
        "stalling to compile it (default 0: always compile)",
    )
    p.add_argument(
        "--compile-in-background",
        action="store_true",
        help="a step that no compiled program covers within --cover-new-shapes runs on one "
        "that covers it with more padding while its own program compiles on a background "
        "thread (only a step nothing covers stalls to compile)",
    )
    p.add_argument(
        "--no-ragged-step",
        action="store_true",
        help="run the older step whose program follows its rows (decode, prefill, pages), "
        "compiled as new shapes arrive, instead of one ragged step per token bucket compiled "
        "at start-up",
    )
    if speculative:
        p.add_argument(
            "--speculative",
            default=None,
            choices=["ngram", "draft", "self", "mtp"],
            help="speculative decoding drafter (None: off; mtp: the checkpoint's own "
            "multi-token-prediction module, DeepSeek-V3)",
        )
        p.add_argument(
            "--num-speculative-tokens", type=int, default=4, help="drafted tokens per step"
        )
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
        "'prefill:128,decode:8@1024' ('' for none; None: prefill:32,prefill:64,"
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
        help="do not turn on JAX's persistent compilation cache for this process (on "
        "in the command line, for the shapes not compiled ahead of time)",
    )


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(FORMATS),
        help="how the model writes tool calls (default: the format its chat template shows; "
        "hermes when it shows none)",
    )


def _add_sampling_args(p: argparse.ArgumentParser, *, several: bool = True) -> None:
    """Sampling flags; `several`: also --n and --logprobs (commands that print completions)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    g.add_argument(
        "--min-tokens", type=int, default=0, help="new tokens before a stop may end the output"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (-1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (None: random)")
    if several:
        g.add_argument("--n", type=int, default=1, help="completions per prompt")
        g.add_argument(
            "--logprobs",
            type=int,
            default=None,
            help="show each token's logprob and its N likeliest alternatives",
        )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default."""


def _command(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description, formatter_class=_HelpFormatter)


def _add_generate(sub) -> None:
    """`jaxgen generate`: its options and its command."""
    gen = _command(
        sub,
        "generate",
        "generate text for a prompt, a file of prompts or stdin",
        "Generate text. Prompts go through the model's chat template unless --raw; a single "
        "prompt is streamed as it is made (unless --json, --n > 1 or --logprobs).",
    )
    gen.add_argument(
        "prompt", nargs="*", help=f"prompt text; '-' reads stdin (none: {DEFAULT_PROMPT!r})"
    )
    gen.add_argument("--file", help="read prompts from FILE, one per line")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=commands.generate)


def _add_chat(sub) -> None:
    """`jaxgen chat`: its options and its command."""
    chat = _command(
        sub,
        "chat",
        "interactive multi-turn chat, streamed",
        "An interactive conversation with the model's chat template; each reply is streamed. "
        "/reset clears the history, /exit or Ctrl-D quits.",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--stats", action="store_true", help="print prompt size and time per turn")
    _add_engine_args(chat)
    _add_sampling_args(chat, several=False)
    chat.set_defaults(func=commands.chat, max_tokens=512)


def _add_perplexity(sub) -> None:
    """`jaxgen perplexity`: its options and its command."""
    ppl = _command(
        sub,
        "perplexity",
        "sliding-window perplexity of a text file",
        "Perplexity of a UTF-8 text file with overlapping windows (the Hugging Face recipe: each "
        "window scores only the tokens the previous one did not).",
    )
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument(
        "--max-tokens", type=int, default=None, help="score only the first N tokens (None: all)"
    )
    ppl.add_argument("--max-length", type=int, default=1024, help="window length")
    ppl.add_argument("--stride", type=int, default=512, help="window stride")
    ppl.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["int8", "fp8"],
        help="score with a quantized KV cache (windows fed through the page pool)",
    )
    _add_model_args(ppl)
    ppl.set_defaults(func=commands.perplexity)


def _add_serve(sub) -> None:
    """`jaxgen serve`: its options and its command."""
    srv = _command(
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
    srv.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    srv.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests before answering 503"
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
        "--enable-lora",
        action="store_true",
        help="serve PEFT LoRA adapters: a request's model names one (see --lora-modules and "
        "POST /v1/load_lora_adapter)",
    )
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) loaded at start, served as model NAME "
        "(implies --enable-lora)",
    )
    srv.add_argument(
        "--max-loras", type=int, default=4, help="LoRA: adapters one step mixes (device slots)"
    )
    srv.add_argument("--max-lora-rank", type=int, default=16, help="LoRA: largest adapter rank")
    _add_kv_tier_args(srv)
    _add_disaggregation_args(srv)
    _add_tool_args(srv)
    _add_engine_args(srv)
    srv.set_defaults(func=commands.serve)


def _add_batch(sub) -> None:
    """`jaxgen batch`: its options and its command."""
    bt = _command(
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
    bt.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    bt.add_argument(
        "--raw",
        action="store_true",
        help="send flat 'prompt' lines as they are (by default they go through the chat "
        "template, as in generate)",
    )
    bt.add_argument("--merge", action="store_true", help="join OUTPUT.rank* files into OUTPUT")
    bt.add_argument("--world", type=int, default=1, help="with --merge: the number of ranks")
    bt.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each request's tokens and logprobs bitwise the same whatever shares its batch, "
        "so a resumed or re-balanced job writes what an uninterrupted one would (cost: "
        "docs/serving.md, 'Batch jobs'; it grows with --max-model-len; default: off)",
    )
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
        "--gpus-per-replica", type=float, default=0, help="GPUs per replica (--mesh spans them)"
    )
    ray.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="restarts of a dead replica and retries of its block",
    )
    _add_tool_args(bt)
    _add_engine_args(bt)
    _add_sampling_args(bt)
    bt.set_defaults(func=commands.batch, seed=0)


def _add_quantize(sub) -> None:
    """`jaxgen quantize`: its options and its command."""
    qz = _command(
        sub,
        "quantize",
        "quantize a model and save it (LLM(model=OUT) loads it)",
        "Quantize a model's weights (calibrated methods read --calib text) and save a jaxgen "
        "checkpoint.",
    )
    qz.add_argument(
        "--method",
        required=True,
        choices=["rtn", "smoothquant", "llm_int8", "awq", "gptq", "nf4", "fp8", "qat"],
        help="quantization algorithm",
    )
    qz.add_argument(
        "--bits", type=int, default=None, help="3, 4 or 8 (integer methods; None: the method's)"
    )
    qz.add_argument(
        "--group-size", type=int, default=None, help="-1 = per channel (None: the method's)"
    )
    qz.add_argument("--calib", default=None, help="calibration text file")
    qz.add_argument("--out", required=True, help="output checkpoint directory")
    qz.add_argument("--model", default=None, help="model to quantize (None: the embedded one)")
    qz.add_argument("--asymmetric", action="store_true", help="zero points (integer formats)")
    qz.add_argument("--double-quant", action="store_true", help="nf4: quantize the scales too")
    qz.add_argument(
        "--outlier-share",
        type=float,
        default=None,
        help="llm_int8: calibrate each linear's outlier threshold so that this share of its "
        "activations takes the float path (e.g. 0.01; default: the paper's threshold 6.0)",
    )
    qz.add_argument(
        "--scale-dtype",
        choices=["float32", "float16"],
        default="float32",
        help="integer formats: group scales in 16 bits (int8 --group-size 32 = Q8_0's layout)",
    )
    qz.add_argument("--act-order", action="store_true", help="gptq: largest Hessian rows first")
    qz.add_argument("--alpha", type=float, default=0.5, help="smoothquant migration strength")
    qz.set_defaults(func=commands.quantize)


def _add_convert(sub) -> None:
    """`jaxgen convert`: its options and its command."""
    conv = _command(
        sub,
        "convert",
        "convert a HF dir or GGUF file to a jaxgen checkpoint",
        "Convert a Hugging Face model directory (safetensors) or a GGUF file into a jaxgen "
        "(orbax) checkpoint directory, tokenizer included; prints the destination.",
    )
    conv.add_argument("source", help="HF model directory or .gguf file")
    conv.add_argument("destination", help="new checkpoint directory")
    conv.add_argument("--dtype", default="float32", choices=DTYPES, help="stored dtype")
    conv.set_defaults(func=commands.convert)


def _add_kv_tier_args(srv: argparse.ArgumentParser) -> None:
    """`jaxgen serve`'s KV cache tiers below the device pool."""
    srv.add_argument(
        "--kv-host-cache-bytes",
        type=int,
        default=None,
        help="KV cache tier in host RAM: cached prefix pages evicted from the device pool are "
        "kept there (LRU, at most this many bytes) and loaded back instead of recomputed",
    )
    srv.add_argument(
        "--kv-disk-cache-dir",
        default=None,
        help="KV cache tier on disk (one file per page, checksummed): survives restarts",
    )
    srv.add_argument(
        "--kv-disk-cache-bytes", type=int, default=None, help="bound of --kv-disk-cache-dir"
    )
    srv.add_argument(
        "--kv-eviction-policy",
        choices=("lru", "lfu"),
        default="lru",
        help="which cached page the device pool displaces (and writes down the KV tiers)",
    )
    srv.add_argument(
        "--kv-prefetch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read tier prefixes on a background thread while other requests run (default: "
        "on for GPU/TPU, off on the CPU backend)",
    )


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
        "--prefill", nargs="+", default=[], metavar="URL", help="router: prefill instances"
    )
    srv.add_argument(
        "--decode", nargs="+", default=[], metavar="URL", help="router: decode instances"
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
    srv.add_argument(
        "--kv-mooncake",
        default=None,
        metavar="CONFIG.json",
        help="shared KV cache tier in a Mooncake Store: the path of Mooncake's client config "
        "(master_server_address, metadata_server, local_hostname, ...); every instance pointed "
        "at the same master reuses the prefixes the others computed",
    )
    srv.add_argument(
        "--kv-transfer",
        default=None,
        metavar="CONFIG.json",
        help="KV pages read straight from one instance's memory by another (Mooncake's "
        "transfer engine; a disaggregated prefill / decode pair): the path of a Mooncake config "
        "(metadata_server, local_hostname, protocol)",
    )
    srv.add_argument(
        "--kv-transfer-bytes",
        type=int,
        default=256 << 20,
        help="host memory registered with the transfer engine for those pages",
    )


COMMANDS = [
    _add_generate,
    _add_chat,
    _add_perplexity,
    _add_serve,
    _add_batch,
    _add_quantize,
    _add_convert,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxgen",
        description="LLM inference in JAX: generate text, chat, serve an OpenAI-compatible API, "
        "run batch jobs, measure perplexity, quantize, convert and benchmark models. Runs the "
        "embedded SmolLM2-135M-Instruct unless --model says otherwise.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for add_command in COMMANDS:
        add_command(sub)

    from jaxgen.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub, formatter_class=_HelpFormatter)
    from jaxgen.cli.train_draft import add_parser as add_train_draft_parser

    add_train_draft_parser(sub, formatter_class=_HelpFormatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "gpu-compile"]:  # its own flags (a deviceless compile, no model)
        from jaxgen.bench import gpu_compile

        return gpu_compile.main(argv[2:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # `serve --disaggregated` reuses it
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
