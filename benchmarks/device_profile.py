"""Where a jitted step's device time goes: `profile_call(compiled, args)`.

`profile_call` runs a compiled function under `jax.profiler`, reads the Perfetto trace JSON the
profiler writes, and attributes every device event (one per kernel, copy or memset on a GPU; one
per executed thunk on the CPU) to the HLO instruction that launched it, each in one of
`jaxgen.bench.profile.CATEGORIES` (`classify`); the time between events inside a call is `gap`
(launch latency and host work: what CUDA graphs and fewer kernels remove). The kernel
benchmarks (`benchmarks/kernels.py`) read their device time from it; the decode-step profile of
the GPU suite (`benchmarks/decode_profile.py`) its categories.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import numpy as np

from jaxgen.bench.profile import CATEGORIES, CONTROL_OPS, Op, classify, hlo_ops


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
        if name in ops and ops[name].opcode in CONTROL_OPS:
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
