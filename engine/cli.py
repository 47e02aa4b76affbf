"""The `jaxgen` command line."""

from __future__ import annotations

import argparse
import sys

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def _cmd_generate(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from cache import KVCache
    from engine.steps import decode, prefill
    from model import load_model, load_tokenizer

    cfg, params = load_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    prompt = " ".join(args.prompt) if args.prompt else DEFAULT_PROMPT
    if args.raw:
        ids = tokenizer(prompt)["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    eos = set(cfg.eos_token_ids) | {tokenizer.eos_token_id}
    kv = KVCache.init(cfg, 1, len(ids) + args.max_tokens, params["embed"].dtype)
    logits, kv = prefill(
        params, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32), kv, cfg=cfg
    )
    out = []
    for _ in range(args.max_tokens):
        token = int(np.argmax(logits[0]))
        if token in eos:
            break
        out.append(token)
        logits, kv = decode(params, jnp.asarray([token], jnp.int32), kv, cfg=cfg)
    print(tokenizer.decode(out, skip_special_tokens=True))
    return 0


def _cmd_convert(args) -> int:
    from model import convert

    print(convert(args.source, args.destination, dtype=args.dtype))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxgen",
        description="LLM inference in JAX: generate text, chat, benchmark, convert models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (greedy)")
    gen.add_argument("prompt", nargs="*", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    gen.add_argument(
        "--model",
        default=None,
        help="HF dir, .gguf file or jaxgen checkpoint "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=_cmd_generate)

    conv = sub.add_parser("convert", help="convert a HF dir or GGUF file to a jaxgen checkpoint")
    conv.add_argument("source")
    conv.add_argument("destination")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    conv.set_defaults(func=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # our typed errors subclass ValueError; show the message only
        print(f"jaxgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
