"""One decode step's device time by category, per variant of the step (XLA options, the decode
attention path, stacked or unrolled layers): `python -m benchmarks.decode_profile decode [--quick]`
(the GPU suite's `profile` step).

Profiles one decode step of a model shape (8B-shaped Llama at B=1 and 64, context 1k and 8k on a
GPU; a tiny model on the CPU) with `benchmarks.device_profile.profile_call` and writes the table
that docs/gpu_decode.md keeps before and after, with an HLO audit of the copies each variant
makes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.device_profile import profile_call
from jaxgen.bench import harness
from jaxgen.bench.profile import CATEGORIES, hlo_ops, large_copies

# Variants of the step: XLA options passed to the compile, and the decode attention path.
COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
DS_FUSION = {"xla_gpu_enable_dynamic_slice_fusion": True}
GRAPHS = {"xla_gpu_enable_command_buffer": COMMAND_BUFFER, "xla_gpu_graph_min_graph_size": 1}
# Command buffers off: each kernel is its own trace event, attributable to its instruction
# (JAX 0.11's XLA:GPU records most of a step into CUDA graphs, which the trace shows as one
# event each). The category columns come from a second compile with these options.
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
VARIANTS = {  # name: (XLA options, attention impl, unrolled layers)
    # Stacked layers under a scan; decode attention slices the layer out for the flash kernel.
    "baseline": ({}, "flash", False),
    "ds-fusion": (DS_FUSION, "flash", False),
    "cmd-buffer": (GRAPHS, "flash", False),
    # Per-layer weights (model.unroll_layers): no dynamic-slice copy of any weight.
    "unrolled": ({}, "flash", True),
    # ... and decode attention through the paged kernel, reading the cache in place.
    "unrolled-paged": ({}, None, True),
    "unrolled-paged-graphs": (GRAPHS, None, True),
}
# Which variants each (model, batch, context) runs on the GPU.
GPU_GRID = {
    "smollm2": [((1, 1024), ("baseline", "unrolled-paged", "unrolled-paged-graphs"))],
    "llama3-8b": [
        ((1, 1024), ("baseline", "unrolled", "unrolled-paged")),
        ((1, 8192), ("baseline", "unrolled-paged")),
        ((64, 1024), ("baseline", "unrolled-paged")),
        ((64, 8192), ("unrolled-paged",)),
    ],
}


def decode_profile(cfg, params, *, batch, context, variant, calls, dtype) -> dict:
    """One decode step of `cfg` at `batch` rows of `context` cached tokens (random cache
    contents: decode time does not depend on them) as `variant` (a VARIANTS name) runs it."""
    from jaxgen.cache import KVCache
    from jaxgen.engine.roofline import param_bytes, step_cost
    from jaxgen.engine.runner import steps
    from jaxgen.model import unroll_layers

    options, impl, unrolled = VARIANTS[variant]
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:  # XLA:GPU options mean nothing to the CPU compiler; kernels interpret
        options, impl = {}, ("interpret" if impl is None else "xla")
    if unrolled:
        params = unroll_layers(params, cfg)
    kv = KVCache.init(cfg, batch, context + calls * 8 + 16, dtype)
    kv = kv.replace(lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.zeros((batch,), jnp.int32)
    active = jnp.ones((batch,), jnp.bool_)
    fn = jax.jit(functools.partial(steps.decode_step, cfg=cfg, attn_impl=impl), donate_argnums=2)

    def carry(a, out):
        return (a[0], a[1], out[1], a[3])

    t0 = time.perf_counter()
    step = fn.lower(params, tokens, kv, active).compile(options or None)
    compile_s = time.perf_counter() - t0
    ops = hlo_ops(step.as_text())
    layer_kv = kv.k.nbytes // cfg.num_layers
    audit = {  # the HLO audit: copies of a whole cache, of one layer's K or V, of weights
        "cache_copies": large_copies(ops, kv.k.nbytes),
        "layer_kv_copies": len(large_copies(ops, layer_kv)),
        "largest_copies": large_copies(ops, 1 << 20)[:6],
    }
    run = profile_call(step, (params, tokens, kv, active), calls=calls, carry=carry)
    res = {
        "wall_us": run["wall_us"],
        "device_us": run["device_us"],
        "audit": audit,
        "compile_s": compile_s,
    }
    if on_gpu:  # attribute per kernel: the same step with command buffers off
        plain = fn.lower(params, tokens, run["args"][2], active).compile({**options, **NO_GRAPHS})
        attr = profile_call(plain, run["args"], calls=calls, carry=carry)
    else:
        attr = run
    res.update(
        {k: attr[k] for k in ("by_category_us", "gap_us", "launches", "top_ops", "span_us")},
        kernels_device_us=attr["device_us"],
        kernels_wall_us=attr["wall_us"],
    )
    cost = step_cost(
        cfg,
        param_bytes(params),
        new_tokens=batch,
        context_tokens=batch * context,
        kv_itemsize=jnp.dtype(dtype).itemsize,
    )
    peak = harness.gpu_peaks()
    res["bytes"] = cost["bytes"]
    if peak:
        res["mbu"] = cost["bytes"] / (res["wall_us"] * 1e-6) / 1e9 / peak["hbm_gbps"]
        res["mbu_device"] = cost["bytes"] / (res["device_us"] * 1e-6) / 1e9 / peak["hbm_gbps"]
    return res


def decode(quick: bool, variants: list[str], calls: int, out: str | None = None) -> dict:
    """Profiles the grid; with `out`, the JSON is rewritten after every row (a run stopped at
    its time limit keeps what it measured)."""
    from jaxgen.bench.e2e import LLAMA3_8B, TINY, default_model
    from jaxgen.model import init_params

    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    if quick or not on_gpu:
        shapes = [
            (
                (lambda: (TINY, init_params(TINY, jax.random.key(0), dtype))),
                [((1, 64), tuple(variants))],
            )
        ]
    else:
        shapes = [
            ((lambda: default_model(dtype)[:2]), GPU_GRID["smollm2"]),
            (
                (lambda: (LLAMA3_8B, init_params(LLAMA3_8B, jax.random.key(0), dtype))),
                GPU_GRID["llama3-8b"],
            ),
        ]
    rows = []
    for make, grid in shapes:
        cfg, params = make()
        for (batch, context), names in grid:
            for variant in [v for v in names if v in variants]:
                row = {"model": cfg.name, "batch": batch, "context": context, "variant": variant}
                try:
                    row.update(
                        decode_profile(
                            cfg,
                            params,
                            batch=batch,
                            context=context,
                            variant=variant,
                            calls=calls,
                            dtype=dtype,
                        )
                    )
                except Exception as e:  # one variant failing (memory, an option) is reported
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(_row_line(row), flush=True)
                if out:
                    harness.dump_json(_result(rows, variants, dtype), out)
        del params
    return _result(rows, variants, dtype)


def _result(rows, variants, dtype) -> dict:
    return {
        "machine": harness.machine_info(),
        "dtype": str(jnp.dtype(dtype)),
        "variants": {k: VARIANTS[k] for k in variants},
        "rows": rows,
    }


def _row_line(row) -> str:
    if "error" in row:
        return (
            f"{row['model']} B={row['batch']} ctx={row['context']} {row['variant']}: {row['error']}"
        )
    cats = " ".join(f"{k}={v:.0f}" for k, v in row["by_category_us"].items())
    return (
        f"{row['model']} B={row['batch']} ctx={row['context']} {row['variant']}: "
        f"wall {row['wall_us']:.0f}us device {row['device_us']:.0f}us gap {row['gap_us']:.0f}us "
        f"launches {row['launches']:.0f} | {cats}"
    )


def to_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"### One decode step, device time by category ({m['device']}, {result['dtype']}; "
        f"{m['date']})",
        "",
        "µs per step. wall: host time per step of back-to-back dispatched steps; device: the "
        "union of device events (both as the variant compiles, CUDA graphs included). The "
        "categories, `gap` (time between kernels inside a step) and launches come from the same "
        "step compiled with command buffers off, so that each kernel is its own event. MBU: "
        "weight + KV bytes over the wall time, against the datasheet HBM bandwidth.",
        "",
        "| model | B | context | variant | wall µs | device µs | "
        + " | ".join(CATEGORIES)
        + " | gap | launches | MBU (wall) | note |",
        "|" + "---|" * (11 + len(CATEGORIES)),
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['context']} | {r['variant']} | "
                + " | " * (7 + len(CATEGORIES))
                + r["error"][:80]
                + " |"
            )
            continue
        cats = " | ".join(f"{r['by_category_us'][c]:.0f}" for c in CATEGORIES)
        mbu = f"{r['mbu']:.2f}" if "mbu" in r else "–"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['context']} | {r['variant']} | "
            f"{r['wall_us']:.0f} | {r['device_us']:.0f} | {cats} | {r['gap_us']:.0f} | "
            f"{r['launches']:.0f} | {mbu} | – |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("what", choices=["decode"])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    result = decode(args.quick, variants, args.calls, args.out)
    if args.out:
        harness.dump_json(result, args.out)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
