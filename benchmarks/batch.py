"""`python -m benchmarks batch`: one batch job (the throughput benchmark's length mix, greedy, each
request its own output length) through the command line, in the same run:

  - `jaxgen batch` with and without --batch-invariant: the mode's cost in output tokens/s
    (the summary's, engine time only);
  - `jaxgen batch` vs `jaxgen batch --ray --replicas 1` (both batch-invariant): Ray's
    overhead, on the whole command's
    wall clock (start-up included: Ray's local cluster and the actor's engine) and on engine
    time (the replica's busy seconds vs the local job's);
  - a Ray run whose replica is killed (SIGKILL by pid) once rows are written: its wall-clock
    cost against the clean Ray run, and every id counted (count, duplicates, missing).

The variants alternate `repeats` times and medians are compared (this host's speed drifts
within minutes). Each command runs in a process of its own, as a user runs it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from jaxgen.bench import harness


def write_job(path: str, tokenizer, num_requests: int, prompt_range, output_range) -> int:
    """Flat lines of token-id prompts with their own output lengths; returns output tokens."""
    from jaxgen.bench.throughput import workload

    prompts, params = workload(
        tokenizer, num_requests, prompt_range=prompt_range, output_range=output_range
    )
    with open(path, "w") as f:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            line = {"id": f"r{i}", "prompt": ids, "max_tokens": p.max_tokens}
            line.update(min_tokens=p.max_tokens, ignore_eos=True, temperature=0.0)
            f.write(json.dumps(line) + "\n")
    return sum(p.max_tokens for p in params)


PARTS = ("invariant", "fault")
RANDOM_MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2)


def random_model(directory: str, tokenizer) -> str:
    """Saves a small random Llama with the default model's tokenizer (4 layers, hidden 256) to
    `directory`: the 2,000-request job in a time this host allows (the default model decodes
    about 70 output tokens/s here, an hour per command). Its greedy tokens mean nothing; the
    job's shapes (prompt and output lengths, batching, rows, ids) are the same."""
    import jax

    from jaxgen.model import ModelConfig, init_params
    from jaxgen.model.loading import save_checkpoint

    d = RANDOM_MODEL["hidden_size"]
    cfg = ModelConfig(
        arch="llama",
        vocab_size=tokenizer.vocab_size,
        intermediate_size=2 * d,
        head_dim=d // RANDOM_MODEL["num_heads"],
        max_position_embeddings=1024,
        eos_token_ids=(0,),  # the job ignores EOS (every output its own length)
        tie_word_embeddings=True,
        name="random-llama-4x256",
        **RANDOM_MODEL,
    )
    save_checkpoint(directory, cfg, init_params(cfg, jax.random.key(0)), tokenizer)
    return directory


def _command(jobs, out, model, *flags) -> list[str]:
    cmd = [sys.executable, "-m", "jaxgen.cli", "batch", jobs, out, "--max-model-len", "1024"]
    return cmd + (["--model", model] if model else []) + list(flags)


def run_command(cmd: list[str], out: str, kill_after_rows: int | None = None) -> dict:
    """Runs one `jaxgen batch` command; returns its summary, wall seconds and (with
    `kill_after_rows`) the replica pid killed once the output holds that many rows."""
    from jaxgen.entrypoints.ray_batch import replica_pids

    for path in (out, out + ".errors.jsonl"):
        if os.path.exists(path):
            os.remove(path)
    killed = []

    def kill():
        while proc.poll() is None:
            if os.path.exists(out) and open(out).read().count("\n") >= kill_after_rows:
                pids = replica_pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                    return
            time.sleep(0.2)

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = None
    if kill_after_rows is not None:
        watcher = threading.Thread(target=kill, daemon=True)
        watcher.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {stderr[-3000:]}")
    if watcher is not None:
        watcher.join()
    # Ray may log to stdout after the summary: take the last line that is the summary.
    summary = next(
        json.loads(line) for line in reversed(stdout.splitlines()) if line.startswith('{"output"')
    )
    with open(out) as f:
        ids = [json.loads(line)["custom_id"] for line in f]
    return {"summary": summary, "wall_s": wall, "ids": ids, "killed_pid": killed or None}


def engine_tok_s(result: dict) -> float:
    """Output tokens per second of engine time: the local job's run, or the replicas' busy
    seconds (blocks in flight) for a Ray job."""
    s = result["summary"]
    if "replicas" in s:
        busy = sum(r["busy_s"] for r in s["replicas"].values())
        return s["output_tokens"] / busy
    return s["tokens_per_s"]


def run(
    model=None,
    *,
    num_requests=2000,
    repeats=2,
    quick=False,
    prompt_range=(32, 512),
    output_range=(16, 256),
    random_weights=False,
    out=None,
    parts=PARTS,
    invariant=True,
) -> dict:
    """Runs the commands (see the module docstring); `random_weights` measures a small random
    model with the default tokenizer instead of `model` (`random_model`); `out` receives the
    runs so far after each command (a stopped benchmark keeps what it measured). `parts`:
    which measurements ("invariant": the mode's cost; "fault": the killed replica; Ray's
    overhead always); `invariant`: the mode the local and Ray jobs compared run in."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}: choose from {list(PARTS)}")
    from jaxgen.model import load_tokenizer
    from jaxgen.model.loading import resolve_source

    if quick:
        num_requests, repeats = 4, 1
        prompt_range, output_range = (8, 40), (2, 8)
    tokenizer = load_tokenizer(resolve_source(model))
    directory = tempfile.mkdtemp(prefix="jaxgen-bench-batch-")
    model_name = model or "the embedded default model"
    if random_weights:
        model = random_model(os.path.join(directory, "model"), tokenizer)
        model_name = "a random Llama with the default tokenizer (4 layers, hidden 256)"
    jobs = os.path.join(directory, "in.jsonl")
    useful = write_job(jobs, tokenizer, num_requests, prompt_range, output_range)
    # The first run of each variant also compiles the shapes it meets first (then kept in
    # the compilation caches): the table shows every run.
    modes = {"--batch-invariant": "jaxgen batch --batch-invariant",
             "--no-batch-invariant": "jaxgen batch (default: not invariant)"}  # fmt: skip
    mode, other = list(modes) if invariant else list(modes)[::-1]
    variants = {modes[mode]: [mode]}
    if "invariant" in parts:
        variants[modes[other]] = [other]
    ray_name = f"jaxgen batch {mode} --ray --replicas 1"
    variants[ray_name] = [mode, "--ray", "--replicas", "1"]
    runs: dict[str, list] = {name: [] for name in variants}
    t_start = time.perf_counter()
    # Every variant once on a short job first (untimed): the compilation caches hold the
    # programs of all three before any timed run, so no variant pays for another's compiles.
    warm = os.path.join(directory, "warm.jsonl")
    with open(jobs) as src, open(warm, "w") as dst:
        dst.writelines(itertools.islice(src, 64))
    for flags in variants.values():
        path = os.path.join(directory, "warm-out.jsonl")
        run_command(_command(warm, path, model, *flags), path)
    for _ in range(repeats):
        for name, flags in variants.items():
            path = os.path.join(directory, "out.jsonl")
            result = run_command(_command(jobs, path, model, *flags), path)
            if sorted(result["ids"]) != sorted(f"r{i}" for i in range(num_requests)):
                raise RuntimeError(f"{name}: the output does not hold every id once")
            runs[name].append(result)
            _save_partial(out, runs)
    fault = None
    if "fault" in parts:
        fault = _fault(jobs, directory, model, variants[ray_name], num_requests, runs, out)
    rows = []
    for name, results in runs.items():
        rows.append(
            {
                "system": name,
                "wall_s": statistics.median(r["wall_s"] for r in results),
                "wall_tok_s": statistics.median(useful / r["wall_s"] for r in results),
                "engine_tok_s": statistics.median(engine_tok_s(r) for r in results),
                "runs": [{"wall_s": r["wall_s"], "engine_tok_s": engine_tok_s(r)} for r in results],
            }
        )
    by_name = {r["system"]: r for r in rows}
    base, ray = by_name[modes[mode]], by_name[ray_name]
    invariant_cost = None
    if "invariant" in parts:
        on, off = by_name[modes["--batch-invariant"]], by_name[modes["--no-batch-invariant"]]
        invariant_cost = 1 - on["engine_tok_s"] / off["engine_tok_s"]
    return {
        "machine": harness.machine_info(),
        "model": model_name,
        "num_requests": num_requests,
        "prompt_range": prompt_range,
        "output_range": output_range,
        "output_tokens": useful,
        "repeats": repeats,
        "rows": rows,
        "invariant_cost": invariant_cost,
        "compared_mode": mode,
        "ray_overhead_wall": 1 - ray["wall_tok_s"] / base["wall_tok_s"],
        "ray_overhead_engine": 1 - ray["engine_tok_s"] / base["engine_tok_s"],
        "fault": fault,
        "ray_version": ray_version(),
        "bench_seconds": time.perf_counter() - t_start,
    }


def _fault(jobs, directory, model, ray_flags, num_requests, runs, out) -> dict:
    """A Ray run whose replica is SIGKILLed once 1/8 of the rows are written, then the same
    run clean: wall clocks and every id counted."""
    path = os.path.join(directory, "killed.jsonl")
    block = max(1, num_requests // 8)  # the kill loses the blocks in flight, not the whole job
    flags = ray_flags + ["--ray-batch-size", str(block)]
    killed = run_command(_command(jobs, path, model, *flags), path, kill_after_rows=block)
    _save_partial(out, runs, killed=killed)
    clean = run_command(_command(jobs, path, model, *flags), path)
    ids = killed["ids"]
    return {
        "killed_pid": killed["killed_pid"],
        "count": len(ids),
        "duplicates": len(ids) - len(set(ids)),
        "missing": len({f"r{i}" for i in range(num_requests)} - set(ids)),
        "duplicates_dropped_by_driver": killed["summary"]["duplicates_dropped"],
        "wall_s": killed["wall_s"],
        "clean_wall_s": clean["wall_s"],
        "block_size": block,
    }


def _save_partial(out, runs, **more) -> None:
    if out:
        strip = lambda r: {k: v for k, v in r.items() if k != "ids"}  # noqa: E731
        runs = {name: [strip(r) for r in results] for name, results in runs.items()}
        more = {k: strip(v) for k, v in more.items()}
        with open(out, "w") as f:
            json.dump({"partial": True, "runs": runs, **more}, f, indent=1)


def ray_version() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return ray.__version__


COLUMNS = [
    ("system", "command"),
    ("wall_s", "wall s (median)"),
    ("wall_tok_s", "output tok/s, wall clock"),
    ("engine_tok_s", "output tok/s, engine time"),
    ("each_run", "engine tok/s of each run, in order"),
]


def to_markdown(result: dict) -> str:
    m, f = result["machine"], result["fault"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    mode = result.get("compared_mode", "--batch-invariant")
    text = (
        f"### Batch jobs: local vs Ray Data ({m['device']}, float32, {mode})\n\n"
        f"`python -m benchmarks batch --num-requests {result['num_requests']}`: "
        f"{result['num_requests']} requests to {result.get('model', 'the default model')}, "
        f"prompts {result['prompt_range'][0]}-"
        f"{result['prompt_range'][1]} tokens, outputs {result['output_range'][0]}-"
        f"{result['output_range'][1]} tokens (the throughput benchmark's mix, greedy), "
        f"{result['output_tokens']} output tokens; each command in its own process, the "
        f"commands alternating {result['repeats']} time(s) (medians); Ray "
        f"{result['ray_version']}; {m['cpu']}, {m['date']}. Wall clock counts the whole command "
        "(model load, compiles, and for --ray the local Ray cluster's start); engine time is "
        "the local job's run or the replica's busy seconds.\n\n"
        + harness.markdown_table(
            [
                dict(r, each_run=", ".join(f"{x['engine_tok_s']:.1f}" for x in r["runs"]))
                for r in result["rows"]
            ],
            COLUMNS,
        )
        + "\n\n"
    )
    if result["invariant_cost"] is not None:
        text += f"Batch-invariant mode costs {pct(result['invariant_cost'])} of engine tokens/s. "
    text += (
        f"Ray's overhead ({mode}): {pct(result['ray_overhead_wall'])} of output tokens/s on the "
        f"wall clock, {pct(result['ray_overhead_engine'])} on engine time.\n"
    )
    if f is not None:
        text += (
            f"\nFault run (`{mode} --ray --replicas 1 --ray-batch-size {f['block_size']}`, the "
            "replica SIGKILLed once rows were written; Ray restarted it and retried its blocks): "
            f"{f['wall_s']:.0f} s vs {f['clean_wall_s']:.0f} s clean; ids written {f['count']}, "
            f"duplicates {f['duplicates']}, missing {f['missing']} (rows the driver dropped as "
            f"re-delivered: {f['duplicates_dropped_by_driver']}).\n"
        )
    return text
