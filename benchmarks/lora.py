"""Multi-LoRA serving, measured on the default model: a batch of requests spread over several LoRA
adapters against the same requests on the base model alone (output tokens/s).

Adapters: A random LoRA adapters (rank R, all seven projections, A and B both non-zero, so each
adapter changes the outputs) written with `safetensors` in PEFT's layout (adapter_config.json +
adapter_model.safetensors, as peft's save_pretrained writes them) into a temporary directory --
no peft needed -- and loaded with `LLM.load_lora`. Workload: B prompts of random token ids, all
of one length, greedy, ignore_eos and one max_tokens, so every run has the same rows, lengths
and steps; request i runs adapter i mod A. Runs, each the second of two (the first compiles):

- base: an engine without LoRA (`LLM()`); the reference;
- LoRA engine, no adapter: `LLM(enable_lora=True, max_loras=A, max_lora_rank=R)` with every
  request on the base model (what the adapter stack costs when no row uses it);
- LoRA engine, A adapters: the same engine, the requests spread over the adapters.

Ratio = tok/s / base tok/s (issue 27: >= 0.7 with A adapters). The engines run one after the
other (on a GPU each takes most of its memory for KV pages).

    python -m benchmarks lora [--quick] [--json] [--out F] [--write-docs]
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time

import numpy as np

from jaxgen.bench import harness

BATCH = 32
NUM_ADAPTERS = 8
RANK = 16
PROMPT_LEN = 64
MAX_TOKENS = 128
SEED = 0
QUICK = dict(batch=4, num_adapters=2, rank=8, prompt_len=16, max_tokens=8)
RATIO_MUST = 0.7  # issue 27: A adapters' output tok/s >= 0.7x the base model's


def write_random_adapter(cfg, directory: str, rank: int, seed: int) -> str:
    """A random LoRA adapter on every projection of every layer of `cfg`, saved in PEFT's layout
    (lora_A [r, in] ~ N(0, 1/in), lora_B [out, r] ~ N(0, 0.02^2); alpha = 2r). Returns the
    directory."""
    from safetensors.numpy import save_file

    from jaxgen.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGET_MODULES

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, parent in TARGET_MODULES.items():
            d_in, d_out = cfg.linear_shapes[module]
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a = rng.standard_normal((rank, d_in), np.float32) / np.sqrt(d_in)
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = 0.02 * rng.standard_normal((d_out, rank), np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
    }
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def _timed(llm, prompts, params, lora_request) -> tuple[float, list]:
    """(seconds, token ids per request) of the second of two identical `generate` calls."""
    llm.generate(prompts, params, lora_request=lora_request)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora_request)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def run(quick: bool = False, model: str | None = None) -> dict:
    import jax

    from jaxgen import LLM, SamplingParams

    q = QUICK if quick else {}
    batch, num_adapters = q.get("batch", BATCH), q.get("num_adapters", NUM_ADAPTERS)
    rank, prompt_len = q.get("rank", RANK), q.get("prompt_len", PROMPT_LEN)
    max_tokens = q.get("max_tokens", MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    options = dict(max_num_seqs=batch, warmup=False)

    base = LLM(model, **options)
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(1000, base.cfg.vocab_size, (batch, prompt_len)).tolist()
    seconds, base_tokens = _timed(base, prompts, params, None)
    runs = [("base model (no LoRA)", seconds, base_tokens, 0)]
    cfg = base.cfg
    del base
    gc.collect()  # its KV pool goes before the next engine takes one

    llm = LLM(model, enable_lora=True, max_loras=num_adapters, max_lora_rank=rank, **options)
    with tempfile.TemporaryDirectory() as root:
        names = [f"random-{i}" for i in range(num_adapters)]
        for i, name in enumerate(names):
            llm.load_lora(name, write_random_adapter(cfg, os.path.join(root, name), rank, i))
        seconds, tokens = _timed(llm, prompts, params, None)
        runs.append(("LoRA engine, no adapter", seconds, tokens, 0))
        spread = [names[i % num_adapters] for i in range(batch)]
        seconds, tokens = _timed(llm, prompts, params, spread)
        runs.append((f"LoRA engine, {num_adapters} adapters", seconds, tokens, num_adapters))
    stack_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.adapters.weights))

    output_tokens = batch * max_tokens
    base_tok_s = output_tokens / runs[0][1]
    rows = [
        {
            "run": label,
            "adapters": adapters,
            "seconds": seconds,
            "tok_s": output_tokens / seconds,
            "ratio": output_tokens / seconds / base_tok_s,
            "differ": sum(t != b for t, b in zip(tokens, base_tokens, strict=True)),
        }
        for label, seconds, tokens, adapters in runs
    ]
    return {
        "machine": harness.machine_info(),
        "model": model or "SmolLM2-135M-Instruct (embedded default, f32)",
        "quick": quick,
        "batch": batch,
        "num_adapters": num_adapters,
        "rank": rank,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "stack_mib": stack_bytes / 2**20,
        "rows": rows,
        "ratio": rows[-1]["ratio"],
        "met": rows[-1]["ratio"] >= RATIO_MUST,
    }


COLUMNS = [
    ("run", "run"),
    ("seconds", "seconds"),
    ("tok_s", "output tok/s"),
    ("ratio", "vs base"),
    ("differ", "requests whose tokens differ from base"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    verdict = "met" if result["met"] else "NOT met"
    return (
        f"### Multi-LoRA: {result['num_adapters']} adapters in one batch vs the base model "
        f"({m['device']})\n\n"
        f"`python -m benchmarks lora`{' --quick' if result['quick'] else ''}: {result['model']}, "
        f"{m['cpu']}, {m['date']}. {result['batch']} requests of {result['prompt_len']} random "
        f"prompt tokens, greedy, ignore_eos, max_tokens {result['max_tokens']} (every run has "
        "the same rows, lengths and steps); second of two runs each. Adapters: random PEFT "
        f"LoRA adapters of rank {result['rank']} on all seven projections (A and B non-zero), "
        f"request i on adapter i mod {result['num_adapters']}; the engine's stack holds "
        f"{result['num_adapters']} slots ({result['stack_mib']:.1f} MiB), every token's "
        "adapter term computed by two matmuls over the stack and a one-hot of its slot "
        "(`model.lora`).\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
        + f"\n\nIssue 27 asks for >= {RATIO_MUST}x the base model's output tok/s with the "
        f"adapters: {result['ratio']:.2f}x, {verdict}."
    )
