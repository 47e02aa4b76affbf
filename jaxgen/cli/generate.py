"""`jaxgen generate`: its flags and its command (prompts in, completions out; streamed for
one prompt)."""

from __future__ import annotations

import json
import sys

from jaxgen.cli.options import (
    add_engine_args,
    add_sampling_args,
    command,
    make_llm,
    sampling_params,
)

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def add_parser(sub) -> None:
    """`jaxgen generate`: its options and its command."""
    gen = command(
        sub,
        "generate",
        "generate text for a prompt, a file of prompts or stdin",
        "Generate text. Prompts go through the model's chat template unless --raw; a single "
        "prompt is streamed as it is made (unless --json, --n > 1 or --logprobs).",
    )
    gen.add_argument(
        "prompt",
        nargs="*",
        help=f"prompt text; '-' reads stdin (none: {DEFAULT_PROMPT!r})",
    )
    gen.add_argument("--file", help="read prompts from FILE, one per line")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=generate)


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
            (kv for kv in entry.items() if kv[1].rank <= num_top),
            key=lambda kv: kv[1].rank,
        )
        rows.append(
            {
                "token": tokenizer.decode([token]),
                "token_id": token,
                "logprob": entry[token].logprob,
                "rank": entry[token].rank,
                "top": [
                    {
                        "token": tokenizer.decode([t]),
                        "token_id": t,
                        "logprob": lp.logprob,
                    }
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
