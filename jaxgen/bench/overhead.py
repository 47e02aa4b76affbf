"""Engine overhead: where a step's time goes when the device has almost nothing to do.

A tiny random Llama (2 layers, hidden 64, vocab 512) generates 64 tokens for each of B
requests (B = 1, 16, 64, 256; greedy, ignore_eos) through `LLM.generate`. Reported per decode
step, from the engine's own `HostProfile` (every step of the timed call, prefill included):
the whole step, and its parts -- scheduling, packing the host arrays, the run (dispatch, the
device, the read-back: the host waits) and the update (tokens into sequences, stops, pages).
"device ms" is the compiled program of the run's widest decode step replayed alone on
device-resident inputs (median of 30, block_until_ready each), so `host ms = step ms -
device ms` and the device-busy fraction is `device ms / step ms`. The engine loop is
synchronous (no overlap of host and device work) today; those rows are "overlap off".

    jaxgen bench overhead [--json]
"""

from __future__ import annotations

import functools
import statistics
import time

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
    widest = None
    while engine.has_work:
        engine.step()
        if widest is None or engine.last_inputs[0].num_decode > widest[0].num_decode:
            widest = engine.last_inputs
    return widest


def device_ms(engine, inputs, repeats: int = 30) -> float:
    """One step program alone: median ms over `repeats` runs on device-resident inputs."""
    import jax

    from jaxgen.engine.runner import steps

    shape, batch, sa = inputs
    run = engine.executables.get(shape) or functools.partial(
        steps.paged_step,
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
        out = run(engine.params, kv, batch, sa)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        kv = out[-1]
    engine.kv = kv  # the pool was donated; the engine keeps the last one
    return 1e3 * statistics.median(times[2:])


def measure(batch: int, new_tokens: int, repeats: int) -> dict:
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
    inputs = widest_decode_inputs(llm, prompts, sp)
    dev = device_ms(llm.engine, inputs)
    return {
        "batch": batch,
        "steps": num_steps,
        "step_ms": step_ms,
        "device_ms": dev,
        "device_step": inputs[0].describe(),
        "host_ms": step_ms - dev,
        "device_busy": dev / step_ms,
        "steps_per_s": 1e3 / step_ms,
        **{f"{k}_ms": v for k, v in parts.items()},
        "outside_engine_ms": step_ms - sum(parts.values()),
    }


def run(quick: bool = False, repeats: int = 3) -> dict:
    batches, new_tokens = ((1, 4), 4) if quick else (BATCHES, NEW_TOKENS)
    rows = [measure(b, new_tokens, 1 if quick else repeats) for b in batches]
    return {
        "machine": harness.machine_info(),
        "model": "tiny random Llama (2 layers, hidden 64, vocab 512)",
        "new_tokens": new_tokens,
        "overlap": "off (the engine loop is synchronous)",
        "repeats": 1 if quick else repeats,
        "rows": rows,
    }


COLUMNS = [
    ("batch", "batch"),
    ("step_ms", "step ms"),
    ("device_ms", "device ms"),
    ("device_step", "replayed step"),
    ("host_ms", "host ms"),
    ("device_busy", "device-busy"),
    ("steps_per_s", "steps/s"),
    ("schedule_ms", "schedule"),
    ("pack_ms", "pack"),
    ("run_ms", "run (waits)"),
    ("update_ms", "update"),
    ("outside_engine_ms", "outside the engine"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    return (
        f"### Engine overhead ({m['device']}, {result['model']})\n\n"
        f"`jaxgen bench overhead`: {result['new_tokens']} greedy tokens per request through "
        f"`LLM.generate`, best of {result['repeats']} calls; ms per engine step, prefill steps "
        f"included; overlap {result['overlap']}; {m['cpu']}, {m['date']}. Device ms: the "
        f"program of the run's widest decode step replayed alone; the columns after steps/s "
        f"split the step as the engine's "
        f"`HostProfile` measured it.\n\n" + harness.markdown_table(result["rows"], COLUMNS)
    )
