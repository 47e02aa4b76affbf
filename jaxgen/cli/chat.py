"""`jaxgen chat`: its flags and its command (an interactive conversation, streamed)."""

from __future__ import annotations

import sys
import time

from jaxgen.cli.options import (
    add_engine_args,
    add_sampling_args,
    command,
    make_llm,
    sampling_params,
)


def add_parser(sub) -> None:
    """`jaxgen chat`: its options and its command."""
    p = command(
        sub,
        "chat",
        "interactive multi-turn chat, streamed",
        "An interactive conversation with the model's chat template; each reply is streamed. "
        "/reset clears the history, /exit or Ctrl-D quits.",
    )
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--stats", action="store_true", help="print prompt size and time per turn")
    add_engine_args(p)
    add_sampling_args(p, several=False)
    p.set_defaults(func=chat, max_tokens=512)


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
