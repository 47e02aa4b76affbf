"""`jaxgen train-draft`: trains an EAGLE draft head for a model from a text corpus (and,
optionally, the model's own greedy answers to prompts cut from it), saves it in the HF layout
the public EAGLE checkpoints use, and reports the loss curve and held-out acceptance.
The training itself is `engine.spec_decode.eagle_train`."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

WIKITEXT = os.path.join(os.path.dirname(__file__), "../../../shared/data/wikitext-2")


def add_parser(sub, formatter_class=argparse.HelpFormatter) -> None:
    p = sub.add_parser(
        "train-draft",
        formatter_class=formatter_class,
        help="train an EAGLE draft head for a model (speculative decoding)",
        description="Train an EAGLE-1/2 or EAGLE-3 draft head on the model's own hidden states "
        "(teacher forcing over a text corpus, optax), save it as config.json + "
        "model.safetensors (the public EAGLE layout) with orbax checkpoints, a loss curve "
        "(training.json, loss.png) and the held-out acceptance before and after.",
    )
    p.add_argument("--model", default=None, help="target model (None: the embedded one)")
    p.add_argument("--out", default="eagle-head", help="output directory for the head")
    p.add_argument(
        "--corpus", default=os.path.join(WIKITEXT, "valid.txt"), help="training text file"
    )
    p.add_argument(
        "--heldout",
        default=os.path.join(WIKITEXT, "test.txt"),
        help="held-out text for the acceptance estimate ('none' to skip it)",
    )
    p.add_argument("--version", type=int, default=3, choices=[1, 2, 3], help="EAGLE version")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument(
        "--num-draft", type=int, default=4, help="k: tokens per chain in the acceptance estimate"
    )
    p.add_argument(
        "--ttt-steps", type=int, default=3, help="EAGLE-3 training-time-test steps (paper: 7)"
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="EAGLE-3: the head's vocabulary, the corpus's most frequent tokens (0: the model's)",
    )
    p.add_argument(
        "--aux-layers",
        default=None,
        help="EAGLE-3: three target layers to fuse, e.g. '2,15,27' (None: 2, L/2, L-3)",
    )
    p.add_argument(
        "--max-train-tokens", type=int, default=None, help="use at most this much corpus"
    )
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="also train on the model's greedy chat answers to N prompts cut from the corpus",
    )
    p.add_argument("--generate-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows measured")
    p.add_argument("--eval-context", type=int, default=64, help="context tokens per window")
    p.add_argument("--eval-batch", type=int, default=16, help="windows per evaluation batch")
    p.add_argument(
        "--checkpoint-every", type=int, default=50, help="orbax checkpoint every N steps"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="PRNG seed of the head's init and the batches"
    )
    p.add_argument(
        "--time-steps",
        type=int,
        default=None,
        metavar="N",
        help="run only N steps (and one evaluation batch) and project the full run's time",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw loss.png")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _generated(cfg, params, tokenizer, text: str, num: int, max_tokens: int) -> list[int]:
    """The model's greedy chat answers to `num` prompts cut from the corpus's paragraphs, each
    conversation's tokens followed by EOS (EAGLE trains on the target's own outputs)."""
    from jaxgen import LLM, SamplingParams

    paragraphs = [p.strip() for p in text.split("\n") if len(p.split()) > 30]
    step = max(1, len(paragraphs) // max(num, 1))
    prompts = [" ".join(p.split()[:40]) for p in paragraphs[::step][:num]]
    llm = LLM.from_parts(cfg, params, tokenizer)
    try:
        outs = llm.chat(
            [[{"role": "user", "content": f"Continue this text: {p}"}] for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            use_tqdm=True,
        )
    finally:
        llm.close()
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    ids: list[int] = []
    for out in outs:
        ids += list(out.prompt_token_ids) + list(out.outputs[0].token_ids) + [eos]
    return ids


def run(args) -> int:
    import numpy as np

    from jaxgen.engine.spec_decode import eagle_train
    from jaxgen.model import load_model, load_tokenizer
    from jaxgen.model.tokenizer import read_text_tokens

    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
    train = eagle_train.DraftTrainConfig(
        version=args.version,
        steps=args.steps,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        ttt_steps=args.ttt_steps,
        num_draft=args.num_draft,
        draft_vocab_size=args.draft_vocab_size or None,
        aux_layers=aux,
        eval_windows=args.eval_batch if args.time_steps else args.eval_windows,
        eval_context=args.eval_context,
        eval_batch=args.eval_batch,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
    )
    heldout = None if args.heldout == "none" else args.heldout
    for path in (args.corpus, heldout):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{path}: no such text file (--corpus / --heldout)")
    start, cpu_start = time.perf_counter(), eagle_train.cpu_seconds()
    cfg, params = load_model(args.model, show_progress=not args.quiet)
    tokenizer = load_tokenizer(args.model)
    ids = read_text_tokens(tokenizer, args.corpus, args.max_train_tokens)
    generated = 0
    if args.generate:
        with open(args.corpus, encoding="utf-8") as f:
            extra = _generated(
                cfg, params, tokenizer, f.read(), args.generate, args.generate_tokens
            )
        generated, ids = len(extra), ids + extra
    held = None
    if heldout is not None:
        held = read_text_tokens(tokenizer, heldout, 200_000)
    prep, prep_cpu = time.perf_counter() - start, eagle_train.cpu_seconds() - cpu_start
    report = eagle_train.train_head(
        cfg,
        params,
        np.asarray(ids, np.int32),
        None if held is None else np.asarray(held, np.int32),
        train,
        args.out,
        show_progress=not args.quiet,
        max_steps=args.time_steps,
    )
    summary = {
        "head": report.head_dir,
        "version": args.version,
        "corpus_tokens": len(ids),
        "generated_tokens": generated,
        "steps": report.steps,
        "tokens_trained": report.tokens,
        "minutes": round((prep + report.seconds) / 60, 2),
        # The process's CPU time beside the wall time: on a shared machine the wall time
        # includes waiting for cores others hold.
        "cpu_minutes": round((eagle_train.cpu_seconds() - cpu_start) / 60, 2),
        "load_average": os.getloadavg()[0],
        "first_loss": report.losses[0],
        "final_loss": report.losses[-1],
        "acceptance_before": report.acceptance_before,
        "acceptance_after": report.acceptance_after,
    }
    if args.time_steps:
        wall = _projection(report.step_seconds, report.eval_seconds, train, prep, args.eval_windows)
        cpu = _projection(
            report.step_cpu_seconds, report.eval_cpu_seconds, train, prep_cpu, args.eval_windows
        )
        summary["projected_minutes"] = round(wall / 60, 1)
        # The full run's CPU time: on an otherwise idle machine of C cores its wall time lies
        # between this / C and this.
        summary["projected_cpu_minutes"] = round(cpu / 60, 1)
    if not args.no_plot and eagle_train.plot_losses(report, os.path.join(args.out, "loss.png")):
        summary["plot"] = os.path.join(report.head_dir, "loss.png")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"{key}: {value}", file=sys.stdout)
    return 0


def _projection(step_seconds, eval_seconds, train, prep: float, eval_windows: int) -> float:
    """Seconds the full run would take: data preparation, the first (compiling) step, the
    remaining steps at the median measured step, and the evaluations scaled from the one
    batch measured before and after to every window (compiles counted again: an upper bound)."""
    steady = step_seconds[1:] or step_seconds
    rest = (train.steps - 1) * statistics.median(steady)
    batches = -(-eval_windows // train.eval_batch)
    return prep + step_seconds[0] + rest + eval_seconds * batches
