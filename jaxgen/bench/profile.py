"""Where a jitted step's device time goes: `python -m jaxgen.bench.profile decode [--quick]`.

`profile_call` runs a compiled function under `jax.profiler`, reads the Perfetto trace JSON the
profiler writes, and attributes every device event (one per kernel, copy or memset on a GPU; one
per executed thunk on the CPU) to the HLO instruction that launched it. The instruction is looked
up in the compiled module's text, which says what it is (a cuBLAS call, a Triton/Pallas kernel,
a fusion and the operations inside it) and where it came from (its `op_name`: the Flax module
path, e.g. `layers/attn/q_proj/dot_general`). Each event lands in one of `CATEGORIES`:

  matmul        the linear layers and the LM head (cuBLAS, Triton GEMM fusions, dots)
  attention     attention kernels and the score/value products of XLA attention
  norm/rope/sampling   everything elementwise or reducing: norms, rotary, activations, softmax,
                the sampler
  cache write   dynamic-update-slice / scatter into the KV cache
  copy          copies, transposes and (dynamic-)slices materialised as their own kernels: a
                layer's weights sliced out of the stacked params show up here
  other         the rest (while-loop predicates, memsets, unattributed events)

and the time between events inside a call is `gap` (launch latency and host work: what CUDA
graphs and fewer kernels remove). The `decode` command profiles one decode step of a model shape
(8B-shaped Llama at B=1 and 64, context 1k and 8k on a GPU; a tiny model on the CPU) under
variants of the step (XLA options, the decode attention path) and writes the table that
docs/gpu_decode.md keeps before and after.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.bench import harness

CATEGORIES = ("matmul", "attention", "norm/rope/sampling", "cache write", "copy", "other")

# One instruction of HLO text: `[ROOT] %name = <shape> opcode(operands), attrs...`.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ATTR = {
    "calls": re.compile(r"calls=%?([\w.\-]+)"),
    "target": re.compile(r'custom_call_target="([^"]+)"'),
    "op_name": re.compile(r'op_name="([^"]+)"'),
    "kernel": re.compile(r'"name"\s*:\s*"([^"]+)"'),
}
_COPY_OPS = {"copy", "transpose", "slice", "dynamic-slice", "concatenate", "pad", "gather"}
_WRITE_OPS = {"dynamic-update-slice", "scatter"}
_PLUMBING = {
    "parameter",
    "constant",
    "bitcast",
    "get-tuple-element",
    "tuple",
    "broadcast",
    "reshape",
    "iota",
    "convert",
}
# Index arithmetic a copy or slice kernel may carry (clamped dynamic offsets).
_INDEXING = {
    "add",
    "subtract",
    "compare",
    "select",
    "clamp",
    "maximum",
    "minimum",
    "and",
    "or",
    "not",
}
_CONTROL = {"while", "conditional", "call"}
_ATTENTION_NAMES = ("attention", "flash", "mha", "fmha", "paged")


@dataclasses.dataclass(frozen=True)
class Op:
    """One HLO instruction: its opcode, the opcodes of the computation it calls (a fusion's
    body), its custom-call target, its JAX op_name and a Pallas kernel's name."""

    name: str
    opcode: str
    body: frozenset = frozenset()
    shape: str = ""
    target: str = ""
    op_name: str = ""
    kernel: str = ""


def hlo_ops(text: str) -> dict[str, Op]:
    """Every instruction of a compiled module's text (`compiled.as_text()`), by name."""
    raw, bodies, current = {}, collections.defaultdict(set), None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            c = _COMPUTATION.match(line)
            if c is not None and "=" not in line.split("{")[0]:
                current = c.group(1)
            continue
        name, shape, opcode, rest = m.groups()
        attrs = {k: (r.search(rest) or [None, ""])[1] for k, r in _ATTR.items()}
        raw[name] = (opcode, shape, attrs)
        if current is not None:
            bodies[current].add(opcode)
    ops = {}
    for name, (opcode, shape, attrs) in raw.items():
        body = set(bodies.get(attrs["calls"], ()))
        for inner in list(body):  # a fusion may wrap another computation (one level deeper)
            body |= bodies.get(inner, set())
        ops[name] = Op(
            name,
            opcode,
            frozenset(body),
            shape,
            attrs["target"],
            attrs["op_name"],
            attrs["kernel"],
        )
    return ops


_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def result_bytes(op: Op) -> int:
    """Bytes of an instruction's result (the sum over a tuple's arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(op.shape):
        bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * bits // 8
    return total


def large_copies(ops: dict[str, Op], min_bytes: int) -> list[tuple[str, int]]:
    """Instructions of the `copy` category whose result is at least `min_bytes`, largest first:
    a cache-sized one means the cache was not updated in place (donation not honoured)."""
    found = [(op.name, result_bytes(op)) for op in ops.values() if classify(op) == "copy"]
    return sorted([f for f in found if f[1] >= min_bytes], key=lambda f: -f[1])


def _is_attention_name(text: str) -> bool:
    text = text.lower()
    return any(k in text for k in _ATTENTION_NAMES)


def classify(op: Op | None) -> str:
    """The category (one of CATEGORIES) of the device time an instruction launches."""
    if op is None:
        return "other"
    ops = set(op.body) if op.opcode == "fusion" else {op.opcode}
    path = op.op_name.lower()
    in_attention = "/attn/" in path and not re.search(r"/attn/[\w]*_proj/", path)
    if op.opcode == "custom-call":
        target = op.target.lower()
        if "fmha" in target or _is_attention_name(op.kernel) or _is_attention_name(path):
            return "attention"
        if any(k in target for k in ("gemm", "cublas", "matmul")) or "dot" in op.kernel:
            return "matmul"
        return "other"
    if ops & _WRITE_OPS:
        return "cache write"
    if ops & _COPY_OPS and ops - _PLUMBING - _INDEXING <= _COPY_OPS:
        return "copy"
    if in_attention and ops - _PLUMBING - _INDEXING:
        return "attention"  # scores, softmax and the value product of XLA attention
    if "dot" in ops or "convolution" in ops or "__triton_gemm" in op.name:
        return "matmul"
    if op.opcode in _CONTROL or not (ops - _PLUMBING):
        return "other"
    return "norm/rope/sampling"


def _trace_events(trace_dir: str):
    """(events, device pids) of the Perfetto trace the profiler wrote under trace_dir."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(sorted(paths)[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and re.search(r"/device:(GPU|TPU)", str(e.get("args", {}).get("name", "")))
    }
    return events, devices


def device_events(events, devices, module: str | None = None) -> list[dict]:
    """Complete events that ran on a device (a GPU's streams), or, on the CPU (no device
    process), the thunks XLA:CPU ran; only `module`'s when given."""
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        if devices:
            if e.get("pid") not in devices:
                continue
        elif "hlo_op" not in args or str(e.get("name", "")).startswith("end:"):
            continue
        if module and args.get("hlo_module") and not str(args["hlo_module"]).startswith(module):
            continue
        out.append(e)
    return out


def _union(intervals) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(events, ops: dict[str, Op], calls: int) -> dict:
    """Per-call device microseconds by category, busy time, gaps and launches."""
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    by_op = collections.Counter()
    intervals = []
    for e in events:
        args = e.get("args") or {}
        name = str(args.get("hlo_op") or "")
        if name in ops and ops[name].opcode in _CONTROL:
            continue  # XLA:CPU times a loop around the thunks it runs: counted in them
        cat = classify(ops.get(name)) if name else "other"
        by_cat[cat] += e["dur"]
        by_op[(cat, name or str(e.get("name")))] += e["dur"]
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    if not intervals:
        raise RuntimeError("the trace holds no device events for this function")
    busy = _union(intervals)
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return {
        "calls": calls,
        "device_us": busy / calls,
        "span_us": span / calls,
        "gap_us": (span - busy) / calls,
        "launches": len(intervals) / calls,
        "by_category_us": {k: v / calls for k, v in by_cat.items()},
        "top_ops": [
            {"category": c, "op": n, "us": t / calls} for (c, n), t in by_op.most_common(12)
        ],
    }


def profile_call(step, args, *, calls: int = 10, warmup: int = 2, carry=None) -> dict:
    """Profiles `calls` back-to-back calls of a compiled function (`jit(f).lower().compile()`).

    `carry(args, out) -> args` feeds a call's outputs into the next one's arguments (a donated
    cache); without it the same arguments are reused. The calls are dispatched without waiting
    in between, as a serving loop does; the result adds the host wall time per call."""
    module = None
    text = step.as_text()
    m = re.search(r"HloModule\s+([\w.\-]+)", text)
    if m:
        module = m.group(1)
    ops = hlo_ops(text)

    def run(n, args):
        out = None
        for _ in range(n):
            out = step(*args)
            if carry is not None:
                args = carry(args, out)
        jax.block_until_ready(out)
        return args

    args = run(warmup, args)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            args = run(calls, args)
        wall = time.perf_counter() - t0
        events, devices = _trace_events(d)
    t0 = time.perf_counter()
    args = run(calls, args)
    result = summarize(device_events(events, devices, module), ops, calls)
    result["wall_us"] = (time.perf_counter() - t0) / calls * 1e6
    result["wall_us_traced"] = wall / calls * 1e6
    result["backend"] = jax.default_backend()
    result["args"] = args  # the last arguments (the donated cache lives on in them)
    return result


# --- the decode-step profile -------------------------------------------------------------

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
        prog="python -m jaxgen.bench.profile",
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
