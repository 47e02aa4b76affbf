"""The `jaxgen` command line: `build_parser` gathers the subcommands, each of which keeps its
flags beside its command (`cli.generate`, `cli.chat`, `cli.perplexity`, `cli.serve`,
`cli.batch`, `cli.checkpoints`, `cli.train_draft`, `bench.cli`); the engine's flags are
generated from its config (`cli.options`). Importing this module imports no JAX, so `--help`
answers at once."""

from __future__ import annotations

import argparse
import sys

from jaxgen.cli import (
    batch,
    chat,
    checkpoints,
    generate,
    perplexity,
    serve,
    train_draft,
)
from jaxgen.cli.options import HelpFormatter

COMMANDS = [
    generate.add_parser,
    chat.add_parser,
    perplexity.add_parser,
    serve.add_parser,
    batch.add_parser,
    checkpoints.add_quantize_parser,
    checkpoints.add_convert_parser,
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

    add_bench_parser(sub, formatter_class=HelpFormatter)
    train_draft.add_parser(sub, formatter_class=HelpFormatter)
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
