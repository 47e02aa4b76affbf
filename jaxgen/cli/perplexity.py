"""`jaxgen perplexity`: its flags and its command (sliding-window perplexity of a text)."""

from __future__ import annotations

import json
import sys

from jaxgen.cli.options import add_config_args, command


def add_parser(sub) -> None:
    """`jaxgen perplexity`: its options and its command."""
    ppl = command(
        sub,
        "perplexity",
        "sliding-window perplexity of a text file",
        "Perplexity of a UTF-8 text file with overlapping windows (the Hugging Face recipe: each "
        "window scores only the tokens the previous one did not).",
    )
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="score only the first N tokens (None: all)",
    )
    ppl.add_argument("--max-length", type=int, default=1024, help="window length")
    ppl.add_argument("--stride", type=int, default=512, help="window stride")
    add_config_args(
        ppl,
        ("load", "cache"),
        only=(
            "model",
            "dtype",
            "quantization",
            "quantization_group_size",
            "kv_cache_dtype",
        ),
        speculative=False,
    )
    ppl.set_defaults(func=perplexity)


def perplexity(args) -> int:
    from jaxgen.entrypoints.perplexity import perplexity as score
    from jaxgen.model import load_model, load_tokenizer
    from jaxgen.model.tokenizer import read_text_tokens

    cfg, params = load_model(args.model, dtype=args.dtype)
    if args.quantization:
        from jaxgen.model.quantize import on_the_fly

        params = on_the_fly(params, args.quantization, args.quantization_group_size)
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
    print(
        f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return 0
