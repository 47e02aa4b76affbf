"""Engine overhead: where a step's time goes when the device has almost nothing to do, and
what a whole `llm.generate` call costs on the default model beside transformers.

Tiny model: a random Llama (2 layers, hidden 64, vocab 512) generates 64 tokens for each of B
requests (B = 1, 16, 64, 256; greedy, ignore_eos) through `LLM.generate`, with the engine loop
overlapped (step N+1 dispatched before step N is read back; the default) and synchronous.
Reported per engine step (every step of the timed call, prefill included), from the engine's
own `HostProfile`: scheduling, packing the host arrays, the dispatch, the wait for the device
(the host blocked on a step's tokens) and the update (tokens into sequences, stops, detokenizing,
pages); "outside" is the rest of the call (request building, the LLM loop). "host ms" is the
host's own work per step: the step minus the wait. "device ms" is the compiled program of the
run's widest decode step replayed alone on device-resident inputs (median of 30,
block_until_ready each). The device-busy fraction is measured in the run itself: one more call
under `jax.profiler` (Python tracer off, so the host runs at its own speed) and the union of the
device's program executions (XLA:CPU's `ThunkExecutor::Execute` spans, on any thread) over the
call's wall time. (On this CPU the host and the "device" share two cores, so a step overlapped
with host work runs slower than alone: `device ms / step ms` would mix that slowdown with idle
time, and is shown as "alone / step" beside it.)

Default model (SmolLM2-135M, f32): whole `llm.generate` calls (16-token prompts of wikitext-2,
64 greedy tokens, prefill included, best of 3) at batch 1 and 32, interleaved with
transformers' `generate` on the same prompts, overlap on and off; next to each, the decode-only
rates of the same calls (first to last token: jaxgen's request metrics; transformers' tokens
stamped as generate asks its stopping criteria).

    python -m benchmarks overhead [--json] [--write-docs]
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np

from jaxgen.bench import harness

BATCHES = (1, 16, 64, 256)
NEW_TOKENS = 64


def tiny_config():
    from jaxgen.model import ModelConfig

    return ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_ids=(2,),
    )


def widest_decode_inputs(llm, prompts, sp):
    """Runs the requests once more, step by step, and keeps the inputs of the step with the most
    decode rows (the steady state the step times are dominated by)."""
    engine = llm.engine
    engine.add_requests(llm.processor.make_requests(prompts, sp))

    def rows(inputs):  # decode rows (a ragged step's: its sequences of one token)
        shape, batch, _ = inputs
        if hasattr(shape, "num_decode"):
            return shape.num_decode
        lens = np.diff(batch.md.cu_q_lens)[: int(batch.md.num_seqs[0])]
        return int((lens == 1).sum()) if (lens == 1).all() else 0

    widest = None
    while engine.has_work:
        engine.step()
        if widest is None or rows(engine.last_inputs) > rows(widest):
            widest = engine.last_inputs
    return widest


def device_ms(engine, inputs, repeats: int = 30) -> float:
    """One step program alone: median ms over `repeats` runs on device-resident inputs."""
    import jax

    from jaxgen.engine.runner import packed

    shape, batch, sa = inputs
    run = engine.programs.executables.get(shape) or functools.partial(
        packed.paged_step,
        cfg=engine.cfg,
        num_logprobs=shape.num_logprobs,
        prompt_logprobs=shape.prompt_logprobs,
        attn_impl=engine.attn_impl,
    )
    batch, sa = jax.device_put((batch, sa))
    kv = engine.kv
    times = []
    for _ in range(repeats + 2):  # the first two are warm-up
        t0 = time.perf_counter()
        out = run(engine.params, kv, batch, sa, engine.lora_weights)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        kv = out[-1]
    engine.kv = kv  # the pool was donated; the engine keeps the last one
    return 1e3 * statistics.median(times[2:])


def _union_ms(spans, lo: float, hi: float) -> float:
    """Total length of the union of [start, end) spans clipped to [lo, hi)."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def traced_busy(call) -> dict:
    """Runs `call()` once under `jax.profiler` and measures how much of its wall time the device
    spent executing programs: {"busy": fraction, "busy_ms", "wall_ms", "executions"}."""
    import glob
    import gzip
    import json
    import tempfile

    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python function events would slow the host down 2x
    options.host_tracer_level = 2
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=options):
            with jax.profiler.TraceAnnotation("jaxgen_bench_call"):
                call()
        (path,) = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    (window,) = [e for e in events if e["name"] == "jaxgen_bench_call"]
    lo, hi = window["ts"], window["ts"] + window["dur"]
    runs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "ThunkExecutor::Execute"]
    busy = _union_ms(runs, lo, hi)
    return {
        "busy": busy / (hi - lo),
        "busy_ms": busy / 1e3,
        "wall_ms": (hi - lo) / 1e3,
        "executions": len(runs),
    }


def measure(batch: int, new_tokens: int, repeats: int, overlap: bool) -> dict:
    import jax

    from jaxgen import LLM, SamplingParams
    from jaxgen.model import init_params, load_tokenizer

    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))
    llm = LLM.from_parts(
        cfg,
        params,
        load_tokenizer(None),
        max_num_seqs=batch,
        max_model_len=256,
        max_num_batched_tokens=max(512, 8 * batch),
        warmup=False,
        overlap=overlap,
    )
    prompts = [[3 + (i * 7 + j) % 500 for j in range(8)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, sp)  # compiles every shape of the run
    best = None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        llm.engine.profile.reset()
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        profile = llm.engine.profile
        if best is None or wall < best[0]:
            best = (wall, profile.steps, profile.per_step_ms())
    wall, num_steps, parts = best
    step_ms = 1e3 * wall / num_steps
    llm.reset_prefix_cache()
    traced = traced_busy(lambda: llm.generate(prompts, sp))
    llm.reset_prefix_cache()
    inputs = widest_decode_inputs(llm, prompts, sp)
    dev = device_ms(llm.engine, inputs)
    return {
        "batch": batch,
        "overlap": "on" if overlap else "off",
        "steps": num_steps,
        "step_ms": step_ms,
        "device_ms": dev,
        "device_step": inputs[0].describe(),
        "host_ms": step_ms - parts["wait"],
        "device_busy": traced["busy"],
        "traced_call_ms": traced["wall_ms"],
        "alone_over_step": dev / step_ms,
        "steps_per_s": 1e3 / step_ms,
        **{f"{k}_ms": v for k, v in parts.items()},
        "outside_engine_ms": step_ms - sum(parts.values()),
    }


def whole_calls(batches=(1, 32), new_tokens: int = 64, prompt_len: int = 16, repeats: int = 3):
    """The default model's whole `generate` calls beside transformers' (see the module doc)."""
    from jaxgen import LLM, SamplingParams
    from jaxgen.bench import decode

    hf = decode.hf_model()
    llms = {ov: LLM(overlap=ov) for ov in (True, False)}
    sp = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
    )
    rows = []
    for batch in batches:
        prompts = decode.prompt_ids(llms[True].tokenizer, batch, prompt_len)
        inputs = [{"prompt_token_ids": p} for p in prompts]

        def ours(llm, inputs=inputs):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(inputs, sp)
            wall = time.perf_counter() - t0
            first = min(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.last_token_time for o in outs)
            return wall, (last - first) / (new_tokens - 1), [o.outputs[0].token_ids for o in outs]

        def theirs(n, prompts=prompts):
            """transformers' call: (wall, seconds per token from the first to the last, the
            tokens). Each token's time is when generate asks its stopping criteria, right after
            the token is chosen."""
            import torch
            from transformers import StoppingCriteria, StoppingCriteriaList

            class Stamps(StoppingCriteria):
                def __init__(self):
                    self.times = []

                def __call__(self, input_ids, scores, **kwargs):
                    self.times.append(time.perf_counter())
                    return torch.zeros(input_ids.shape[0], dtype=torch.bool)

            ids, stamps = torch.tensor(prompts), Stamps()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    stopping_criteria=StoppingCriteriaList([stamps]),
                )
            wall = time.perf_counter() - t0
            if len(stamps.times) != n:
                raise RuntimeError(f"transformers chose {len(stamps.times)} tokens, not {n}")
            step = (stamps.times[-1] - stamps.times[0]) / (n - 1)
            return wall, step, out[:, ids.shape[1] :].tolist()

        for llm in llms.values():
            ours(llm)  # compiles the call's shapes
        theirs(2)
        times = {True: [], False: []}
        hf_times = []
        for _ in range(repeats):  # interleaved: the machine's speed drifts
            for ov, llm in llms.items():
                times[ov].append(ours(llm))
            hf_times.append(theirs(new_tokens))
        hf_wall = min(t[0] for t in hf_times)
        hf_step = statistics.median(t[1] for t in hf_times)
        same = sum(
            a == b for a, b in zip(times[True][0][2], hf_times[0][2], strict=True)
        )  # greedy f32 on both sides: most rows agree token for token
        for ov in (True, False):
            wall = min(t[0] for t in times[ov])
            step = statistics.median(t[1] for t in times[ov])
            rows.append(
                {
                    "batch": batch,
                    "overlap": "on" if ov else "off",
                    "ours_s": wall,
                    "hf_s": hf_wall,
                    "ratio": hf_wall / wall,
                    "ours_decode_tok_s": batch / step,
                    "hf_decode_tok_s": batch / hf_step,
                    "decode_ratio": hf_step / step,
                    "rows_equal_hf": f"{same}/{batch}",
                }
            )
    return rows


# The default model's matmuls at decode batch 32 (SmolLM2-135M: MLP up/gate, down, LM head).
GEMM_SHAPES = ((32, 576, 1536), (32, 1536, 576), (32, 576, 49152))


@functools.cache
def _jitted_matmul():
    import jax

    return jax.jit(lambda x, w: x @ w)


def _matmul(x, w):
    return _jitted_matmul()(x, w)


def gemm_rates(shapes=GEMM_SHAPES, repeats: int = 50) -> list[dict]:
    """f32 GEMM rates of XLA:CPU (a jitted `x @ w`) and of torch (oneDNN, transformers'
    matmuls) on this machine's cores, interleaved: what a batch-32 decode step's matmuls can
    reach on each side."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    def best(f, *args):
        for _ in range(5):  # warm-up: compiling, oneDNN's primitive cache, thread pools
            f(*args)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats // 5):
                f(*args)
            times.append((time.perf_counter() - t0) / (repeats // 5))
        return min(times)

    rows = []
    rng = np.random.default_rng(0)
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), np.float32)
        b = rng.standard_normal((k, n), np.float32)
        ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
        xla = best(lambda x, w: _matmul(x, w).block_until_ready(), ja, jb)
        with torch.no_grad():
            peer = best(torch.matmul, ta, tb)
        flops = 2 * m * k * n
        rows.append(
            {
                "shape": f"[{m},{k}] x [{k},{n}]",
                "xla_gflops": flops / xla / 1e9,
                "torch_gflops": flops / peer / 1e9,
                "xla_over_torch": peer / xla,
            }
        )
    return rows


def run(quick: bool = False, repeats: int = 3) -> dict:
    batches, new_tokens = ((1, 4), 4) if quick else (BATCHES, NEW_TOKENS)
    rows = [
        measure(b, new_tokens, 1 if quick else repeats, overlap)
        for b in batches
        for overlap in (True, False)
    ]
    whole = whole_calls(
        batches=(1, 2) if quick else (1, 32),
        new_tokens=8 if quick else 64,
        repeats=1 if quick else repeats,
    )
    return {
        "machine": harness.machine_info(),
        "model": "tiny random Llama (2 layers, hidden 64, vocab 512)",
        "new_tokens": new_tokens,
        "repeats": 1 if quick else repeats,
        "rows": rows,
        "whole_calls": whole,
        "gemm": gemm_rates(repeats=10 if quick else 50),
    }


COLUMNS = [
    ("batch", "batch"),
    ("overlap", "overlap"),
    ("step_ms", "step ms"),
    ("device_ms", "device ms"),
    ("host_ms", "host ms"),
    ("device_busy", "device-busy (traced)"),
    ("alone_over_step", "alone / step"),
    ("steps_per_s", "steps/s"),
    ("schedule_ms", "schedule"),
    ("pack_ms", "pack"),
    ("dispatch_ms", "dispatch"),
    ("wait_ms", "wait"),
    ("update_ms", "update"),
    ("outside_engine_ms", "outside"),
    ("device_step", "replayed step"),
]
GEMM_COLUMNS = [
    ("shape", "matmul"),
    ("xla_gflops", "XLA:CPU GFLOP/s"),
    ("torch_gflops", "torch GFLOP/s"),
    ("xla_over_torch", "XLA / torch"),
]
WHOLE_COLUMNS = [
    ("batch", "batch"),
    ("overlap", "overlap"),
    ("ours_s", "jaxgen s"),
    ("hf_s", "transformers s"),
    ("ratio", "whole call: jaxgen / transformers speed"),
    ("ours_decode_tok_s", "jaxgen decode tok/s"),
    ("hf_decode_tok_s", "transformers decode tok/s"),
    ("decode_ratio", "decode only: ratio"),
    ("rows_equal_hf", "rows equal to transformers"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    return (
        f"### Engine overhead ({m['device']}, {result['model']})\n\n"
        f"`python -m benchmarks overhead`: {result['new_tokens']} greedy tokens per request "
        "through "
        f"`LLM.generate`, best of {result['repeats']} calls; ms per engine step, prefill steps "
        f"included; {m['cpu']}, {m['date']}. Overlap on: step N+1 is dispatched before step N "
        "is read back (the default); off: synchronous. Host ms: the step minus the wait for the "
        "device. Device ms: the program of the run's widest decode step replayed alone. "
        "Device-busy: the share of one more (traced) call's wall time during which the device "
        "executed a program (`jax.profiler`, Python tracer off); alone / step: device ms / step "
        "ms (below the busy share where host work slows an overlapped step). Schedule to "
        "outside split the step as the engine's `HostProfile` measured it.\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
        + "\n\n### Whole calls on the default model beside transformers\n\n"
        "SmolLM2-135M f32, 16-token wikitext-2 prompts, 64 greedy tokens each, prefill "
        "included, best of 3, interleaved with transformers' `generate` (PyTorch CPU) on the "
        "same prompts. Decode only: the first-to-last-token rate of the same calls (jaxgen's "
        "request metrics; transformers' tokens stamped as generate asks its stopping "
        "criteria).\n\n"
        + harness.markdown_table(result["whole_calls"], WHOLE_COLUMNS)
        + "\n\nThe batch-32 step's matmul shapes, f32, on this machine in the same run (best of 5 "
        "rounds): XLA:CPU's jitted `x @ w` beside torch's (oneDNN, what transformers runs).\n\n"
        + harness.markdown_table(result.get("gemm", []), GEMM_COLUMNS)
    )


# Where the host's time goes, by what the code does (a function's own time, cProfile).
HOST_GROUPS = (
    ("jaxgen/engine/sched/scheduler.py", "scheduler"),
    ("jaxgen/cache/block_manager.py", "page bookkeeping"),
    ("jaxgen/engine/runner/packer.py", "packing"),
    ("jaxgen/pallas_kernels/page_blocks.py", "packing"),
    ("jaxgen/engine/sample/sampling.py", "packing"),
    ("jaxgen/engine/detokenizer.py", "detokenizing"),
    ("jaxgen/model/tokenizer.py", "detokenizing"),
    ("method 'decode'", "detokenizing"),
    ("jaxgen/engine/sched/sequence.py", "sequences (append, stops)"),
    ("jaxgen/engine/processor.py", "building requests"),
    ("jaxgen/engine/loop.py", "engine loop (incl. the jitted call)"),
    ("jaxgen/engine/runner/model_runner.py", "engine loop (incl. the jitted call)"),
    ("jaxgen/engine/runner/programs.py", "engine loop (incl. the jitted call)"),
    ("numpy.asarray", "read-back (waits for the device)"),
    ("jax/", "JAX Python (dispatch, pytrees)"),
)


def host_profile(batch: int = 256, overlap: bool = True, new_tokens: int = NEW_TOKENS) -> dict:
    """One `generate` call of the tiny model under cProfile: ms per step of each group's own
    time (the profiler slows Python down, so compare shares and before/after, not absolutes)."""
    import cProfile
    import pstats

    import jax

    from jaxgen import LLM, SamplingParams
    from jaxgen.model import init_params, load_tokenizer

    cfg = tiny_config()
    kwargs = dict(max_num_seqs=batch, max_model_len=256, max_num_batched_tokens=max(512, 8 * batch))
    llm = LLM.from_parts(
        cfg,
        init_params(cfg, jax.random.key(0)),
        load_tokenizer(None),
        warmup=False,
        overlap=overlap,
        **kwargs,
    )
    prompts = [[3 + (i * 7 + j) % 500 for j in range(8)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, sp)
    llm.reset_prefix_cache()
    steps_before = llm.engine.num_steps
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, sp)
    profiler.disable()
    num_steps = llm.engine.num_steps - steps_before
    groups: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profiler).stats.items():
        where = f"{path}:{name}"
        group = next((g for key, g in HOST_GROUPS if key in where), "other")
        groups[group] = groups.get(group, 0.0) + own
    total = sum(groups.values())
    return {
        "batch": batch,
        "overlap": "on" if overlap else "off",
        "new_tokens": new_tokens,
        "steps": num_steps,
        "ms_per_step": {g: 1e3 * v / num_steps for g, v in groups.items()},
        "total_ms_per_step": 1e3 * total / num_steps,
    }


def host_profile_markdown(profiles: dict[str, dict]) -> str:
    """profiles: {column label: host_profile(...)} -> a table, groups as rows, in ms per
    `batch` generated tokens (one full step's worth: runs that took different numbers of steps
    for the same tokens compare)."""

    def per_batch(p):  # ms per step -> ms per `batch` tokens
        return p["steps"] / p.get("new_tokens", NEW_TOKENS)

    groups = sorted(
        {g for p in profiles.values() for g in p["ms_per_step"]},
        key=lambda g: -max(p["ms_per_step"].get(g, 0.0) * per_batch(p) for p in profiles.values()),
    )
    rows = [
        {
            "group": g,
            **{k: p["ms_per_step"].get(g, 0.0) * per_batch(p) for k, p in profiles.items()},
        }
        for g in groups
    ]
    rows.append(
        {"group": "all", **{k: p["total_ms_per_step"] * per_batch(p) for k, p in profiles.items()}}
    )
    rows.append({"group": "engine steps", **{k: p["steps"] for k, p in profiles.items()}})
    return harness.markdown_table(rows, [("group", "host time in")] + [(k, k) for k in profiles])
