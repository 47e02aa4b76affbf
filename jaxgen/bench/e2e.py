"""End-to-end decode and prefill throughput through the jitted engine steps, with roofline
fractions: `python -m jaxgen.bench.e2e [--quick] [--json]`.

On a GPU it runs SmolLM2-135M (the default model's architecture) and a Llama-3-8B-shaped model
in bf16. Weights come from the default model when its package is installed; otherwise (and for
the 8B shape always) they are random: decode speed does not depend on weight values, and the
result says which was used.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.bench import harness
from jaxgen.cache import KVCache
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.roofline import param_bytes, step_cost
from jaxgen.engine.runner import steps
from jaxgen.engine.sample.sampling import SamplingArrays
from jaxgen.model import ModelConfig, init_params

LLAMA3_8B = ModelConfig(
    arch="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    name="llama3-8b-shape",
)
SMOLLM2_135M = ModelConfig(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    name="smollm2-135m-shape",
)
TINY = ModelConfig(
    arch="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    name="tiny",
)


def default_model(dtype):
    """(cfg, params, 'checkpoint' | 'random') for SmolLM2-135M."""
    from jaxgen.model import load_model
    from jaxgen.model.errors import ModelLoadError

    try:
        cfg, params = load_model(None, dtype=dtype, show_progress=False)
        return cfg, params, "checkpoint"
    except (ModelLoadError, ImportError):
        cfg = SMOLLM2_135M
        return cfg, init_params(cfg, jax.random.key(0), dtype), "random"


def _peaks(limits, dtype) -> tuple[float, float]:
    """(GB/s, GFLOP/s) the MBU and MFU are taken against: the datasheet's on a GPU."""
    peak = limits.get("datasheet") or {}
    bw = peak.get("hbm_gbps") or limits["read_gbps"]
    flops = (
        (peak.get("bf16_tflops", 0) * 1e3)
        if dtype == jnp.bfloat16 and peak
        else (limits["bf16_gflops"] if dtype == jnp.bfloat16 else limits["f32_gflops"])
    )
    return bw, flops


def measure_prefill(cfg, params, *, batch, prompt_len, dtype, limits, attn_impl=None) -> dict:
    """Prefill alone (a fresh cache), best of 3 after the compile: tok/s and MFU."""
    tokens = jax.random.randint(jax.random.key(1), (batch, prompt_len), 0, cfg.vocab_size)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    def prefill():
        kv = KVCache.init(cfg, batch, prompt_len, dtype)
        logits, _ = steps.prefill(params, tokens, lengths, kv, cfg=cfg, attn_impl=attn_impl)
        jax.block_until_ready(logits)

    prefill()  # compile
    seconds = harness.timeit(prefill, warmup=0, repeats=3).min
    pre = step_cost(
        cfg,
        param_bytes(params),
        new_tokens=batch * prompt_len,
        context_tokens=batch * prompt_len,
        kv_itemsize=jnp.dtype(dtype).itemsize,
        attended_pairs=batch * prompt_len * (prompt_len + 1) // 2,
    )
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "attention": attn_impl or "default",
        "prefill_tok_s": batch * prompt_len / seconds,
        "prefill_mfu": pre["flops"] / seconds / 1e9 / _peaks(limits, dtype)[1],
    }


def measure(cfg, params, *, batch, prompt_len, new_tokens, dtype, limits) -> dict:
    cache_len = prompt_len + new_tokens
    tokens = jax.random.randint(jax.random.key(1), (batch, prompt_len), 0, cfg.vocab_size)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    sa = SamplingArrays.build(
        [SamplingParams(temperature=0)] * batch, np.zeros((batch, 2), np.uint32)
    )

    def prefill():
        kv = KVCache.init(cfg, batch, cache_len, dtype)
        logits, kv = steps.prefill(params, tokens, lengths, kv, cfg=cfg)
        return jax.block_until_ready(logits), kv

    prefill()  # compile
    t0 = time.perf_counter()
    logits, kv = prefill()
    t_prefill = time.perf_counter() - t0

    def decode(kv, logits):
        state = steps.DecodeState.create(cfg.vocab_size, max_tokens=np.full(batch, new_tokens + 1))
        state, _ = steps.sample_tokens(logits, state, sa)
        outs, kv, state, n = steps.decode_loop(params, kv, state, sa, cfg=cfg, num_steps=new_tokens)
        jax.block_until_ready(outs.tokens)
        return int(n)

    decode(*prefill()[::-1])  # compile
    logits, kv = prefill()
    t0 = time.perf_counter()
    n = decode(kv, logits)
    t_decode = (time.perf_counter() - t0) / n
    weights = param_bytes(params)
    itemsize = jnp.dtype(dtype).itemsize
    dec = step_cost(
        cfg,
        weights,
        new_tokens=batch,
        context_tokens=int(batch * (prompt_len + new_tokens / 2)),
        kv_itemsize=itemsize,
    )
    pre = step_cost(
        cfg,
        weights,
        new_tokens=batch * prompt_len,
        context_tokens=batch * prompt_len,
        kv_itemsize=itemsize,
        attended_pairs=batch * prompt_len * (prompt_len + 1) // 2,
    )
    bw, flops = _peaks(limits, dtype)
    return {
        "batch": batch,
        "decode_tok_s": batch / t_decode,
        "decode_step_ms": t_decode * 1e3,
        "decode_mbu": dec["bytes"] / t_decode / 1e9 / bw,
        "decode_mfu": dec["flops"] / t_decode / 1e9 / flops,
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "prefill_mfu": pre["flops"] / t_prefill / 1e9 / flops,
    }


def run(quick: bool, last_model_only: bool = False, out: str | None = None) -> dict:
    """The table; with `out`, the JSON is rewritten after every model (a run stopped at its
    time limit keeps what it measured)."""
    on_gpu = jax.default_backend() == "gpu"
    limits = harness.machine_limits(quick=quick or not on_gpu)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    if quick or not on_gpu:
        models = [(lambda dt: (TINY, init_params(TINY, jax.random.key(0), dt), "random"), (1, 2))]
        prompt_len, new_tokens = 16, 4
    else:
        models = [
            (default_model, (1, 64, 256)),
            (
                lambda dt: (LLAMA3_8B, init_params(LLAMA3_8B, jax.random.key(0), dt), "random"),
                (1, 64),
            ),
        ]
        prompt_len, new_tokens = 512, 128
    if last_model_only:  # batch 1 only: the rerun is for the weight-bound rows
        models = [(models[-1][0], models[-1][1][:1])]
    # Weight-only quantized copies of the last model, decoded at batch 1: does tok/s scale with
    # bytes per weight (the dequantization fused into the matmul, no dequantized copy in HBM)?
    quantized = [("int8", None), ("int4", 128)] if on_gpu and not quick else [("int8", None)]
    rows, prefill_rows = [], []

    def result():
        return {
            "machine": harness.machine_info(),
            "limits": limits,
            "dtype": str(jnp.dtype(dtype)),
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "rows": rows,
            "prefill_rows": prefill_rows,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }

    def save():
        if out:
            harness.dump_json(result(), out)

    for index, (make, batches) in enumerate(models):
        cfg, params, source = make(dtype)
        rows += _measure_rows(cfg, params, source, batches, prompt_len, new_tokens, dtype, limits)
        save()
        if index < len(models) - 1:
            continue
        prefill_rows += _long_prefill_rows(cfg, params, source, dtype, limits, quick or not on_gpu)
        save()
        from jaxgen.quant.apply import quantize_params

        for fmt, group in quantized:
            label = f"{source} {fmt}" + (f" g{group}" if group else "")
            try:
                qparams = quantize_params(params, fmt, group)
            except Exception as e:  # a format this model cannot take: reported, not fatal
                rows.append({"model": cfg.name, "weights": label, "error": f"{type(e).__name__}"})
                continue
            rows += _measure_rows(
                cfg, qparams, label, batches[:1], prompt_len, new_tokens, dtype, limits
            )
            save()
            del qparams
        del params
    return result()


def _backend_layout(params, cfg):
    """(params, unrolled): on a GPU the layers run unrolled over per-layer weights (the scan's
    weight slices are copies there; docs/gpu_decode.md), which also sends decode attention
    through the paged kernel reading the cache in place."""
    from jaxgen.model import unroll_layers

    if jax.default_backend() != "gpu":
        return params, False
    return unroll_layers(params, cfg), True


def _long_prefill_rows(cfg, params, source, dtype, limits, small: bool) -> list[dict]:
    """Prefill of one long prompt (4k tokens on the GPU), the dispatch's default attention
    against the Hopper kernel forced (issue 23's end-to-end MFU row)."""
    # The Hopper kernel needs the unrolled layers too (it fails Flax's check inside nn.scan).
    params, _ = _backend_layout(params, cfg)
    impls = [None, "mosaic"] if jax.default_backend() == "gpu" else [None]
    rows = []
    for impl in impls:
        row = {"model": cfg.name or cfg.arch, "weights": source}
        try:
            row.update(
                measure_prefill(
                    cfg,
                    params,
                    batch=1,
                    prompt_len=32 if small else 4096,
                    dtype=dtype,
                    limits=limits,
                    attn_impl=impl,
                )
            )
        except Exception as e:  # reported, not fatal
            row.update(attention=impl or "default", error=f"{type(e).__name__}: {str(e)[:160]}")
        rows.append(row)
    return rows


def _measure_rows(cfg, params, source, batches, prompt_len, new_tokens, dtype, limits):
    params, unrolled = _backend_layout(params, cfg)
    rows = []
    for batch in batches:
        row = {"model": cfg.name or cfg.arch, "weights": source, "unrolled": unrolled}
        try:
            row.update(
                measure(
                    cfg,
                    params,
                    batch=batch,
                    prompt_len=prompt_len,
                    new_tokens=new_tokens,
                    dtype=dtype,
                    limits=limits,
                )
            )
        except Exception as e:  # e.g. out of memory at the largest batch: reported, not fatal
            row.update(batch=batch, error=f"{type(e).__name__}: {str(e)[:160]}")
        rows.append(row)
    return rows


COLUMNS = [
    ("model", "model"),
    ("weights", "weights"),
    ("batch", "B"),
    ("decode_tok_s", "decode tok/s"),
    ("decode_step_ms", "step ms"),
    ("decode_mbu", "MBU"),
    ("decode_mfu", "decode MFU"),
    ("prefill_tok_s", "prefill tok/s"),
    ("prefill_mfu", "prefill MFU"),
    ("error", "note"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    flags = result.get("xla_flags", "").strip()
    return (
        f"### End-to-end decode / prefill ({m['device']}, {result['dtype']}"
        + (f"; XLA_FLAGS `{flags}`" if flags else "")
        + ")\n\n"
        f"Prompts of {result['prompt_len']} tokens, {result['new_tokens']} greedy tokens, "
        f"fused on-device decode loop; MBU/MFU against "
        f"{'the datasheet peaks' if 'datasheet' in result['limits'] else 'measured limits'}; "
        f"{m['date']}.\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
        + _prefill_section(result)
    )


PREFILL_COLUMNS = [
    ("model", "model"),
    ("weights", "weights"),
    ("prompt_len", "prompt"),
    ("attention", "attention"),
    ("prefill_tok_s", "prefill tok/s"),
    ("prefill_mfu", "prefill MFU"),
    ("error", "note"),
]


def _prefill_section(result: dict) -> str:
    rows = result.get("prefill_rows") or []
    if not rows:
        return ""
    return (
        "\n\nOne long prompt, B=1: the dispatch's default prefill attention (the table in "
        "`pallas_kernels/prefill_table.py`) and the Hopper kernel forced.\n\n"
        + harness.markdown_table(rows, PREFILL_COLUMNS)
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxgen.bench.e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--last-model-only",
        action="store_true",
        help="only the largest model (and its quantized copies): a rerun under other XLA flags",
    )
    args = p.parse_args(argv)
    result = run(args.quick, args.last_model_only, args.out)
    markdown = to_markdown(result)
    if args.out:
        harness.dump_json(result, args.out)
    print(harness.dump_json(result) if args.json else markdown)
    if args.write_docs:
        harness.write_section("e2e-gpu" if jax.default_backend() == "gpu" else "e2e", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
