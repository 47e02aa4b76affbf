"""Where a jitted step's device time goes: `profile_call(compiled, args)`.

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
graphs and fewer kernels remove). The kernel benchmarks (`bench.kernels`) read their device time
from it; the decode-step profile of the GPU suite (`benchmarks/decode_profile.py`) its categories.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import numpy as np

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
