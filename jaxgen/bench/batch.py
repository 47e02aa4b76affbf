"""`jaxgen bench batch`: one batch job (the throughput benchmark's length mix, greedy, each
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
) -> dict:
    from jaxgen.model import load_tokenizer
    from jaxgen.model.loading import resolve_source

    if quick:
        num_requests, repeats = 4, 1
        prompt_range, output_range = (8, 40), (2, 8)
    tokenizer = load_tokenizer(resolve_source(model))
    directory = tempfile.mkdtemp(prefix="jaxgen-bench-batch-")
    jobs = os.path.join(directory, "in.jsonl")
    useful = write_job(jobs, tokenizer, num_requests, prompt_range, output_range)
    # The first run of each variant also compiles the shapes it meets first (then kept in
    # the compilation caches): the table shows every run.
    variants = {
        "jaxgen batch --batch-invariant": ["--batch-invariant"],
        "jaxgen batch (default: not invariant)": ["--no-batch-invariant"],
        "jaxgen batch --batch-invariant --ray --replicas 1": [
            "--batch-invariant",
            "--ray",
            "--replicas",
            "1",
        ],
    }
    runs: dict[str, list] = {name: [] for name in variants}
    t_start = time.perf_counter()
    for _ in range(repeats):
        for name, flags in variants.items():
            out = os.path.join(directory, "out.jsonl")
            result = run_command(_command(jobs, out, model, *flags), out)
            if sorted(result["ids"]) != sorted(f"r{i}" for i in range(num_requests)):
                raise RuntimeError(f"{name}: the output does not hold every id once")
            runs[name].append(result)
    out = os.path.join(directory, "killed.jsonl")
    kill_at = max(1, num_requests // 8)
    ray_flags = variants["jaxgen batch --batch-invariant --ray --replicas 1"]
    # Blocks of 1/8 of the job: the kill loses the block in flight, not the whole job.
    flags = ray_flags + ["--ray-batch-size", str(max(1, num_requests // 8))]
    killed = run_command(_command(jobs, out, model, *flags), out, kill_after_rows=kill_at)
    clean = run_command(_command(jobs, out, model, *flags), out)
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
    base, off, ray = rows
    ids = killed["ids"]
    fault = {
        "killed_pid": killed["killed_pid"],
        "count": len(ids),
        "duplicates": len(ids) - len(set(ids)),
        "missing": len({f"r{i}" for i in range(num_requests)} - set(ids)),
        "duplicates_dropped_by_driver": killed["summary"]["duplicates_dropped"],
        "wall_s": killed["wall_s"],
        "clean_wall_s": clean["wall_s"],
        "block_size": max(1, num_requests // 8),
    }
    return {
        "machine": harness.machine_info(),
        "num_requests": num_requests,
        "prompt_range": prompt_range,
        "output_range": output_range,
        "output_tokens": useful,
        "repeats": repeats,
        "rows": rows,
        "invariant_cost": 1 - base["engine_tok_s"] / off["engine_tok_s"],
        "ray_overhead_wall": 1 - ray["wall_tok_s"] / base["wall_tok_s"],
        "ray_overhead_engine": 1 - ray["engine_tok_s"] / base["engine_tok_s"],
        "fault": fault,
        "ray_version": ray_version(),
        "bench_seconds": time.perf_counter() - t_start,
    }


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
    return (
        f"### Batch jobs: local vs Ray Data, batch-invariant mode ({m['device']}, float32)\n\n"
        f"`jaxgen bench batch --num-requests {result['num_requests']}`: "
        f"{result['num_requests']} requests, prompts {result['prompt_range'][0]}-"
        f"{result['prompt_range'][1]} tokens, outputs {result['output_range'][0]}-"
        f"{result['output_range'][1]} tokens (the throughput benchmark's mix, greedy), "
        f"{result['output_tokens']} output tokens; each command in its own process, the three "
        f"alternating {result['repeats']} times (medians); Ray {result['ray_version']}; "
        f"{m['cpu']}, {m['date']}. Wall clock counts the whole command (model load, compiles, "
        "and for --ray the local Ray cluster's start); engine time is the local job's run or "
        "the replica's busy seconds.\n\n"
        + harness.markdown_table(
            [
                dict(r, each_run=", ".join(f"{x['engine_tok_s']:.1f}" for x in r["runs"]))
                for r in result["rows"]
            ],
            COLUMNS,
        )
        + f"\n\nBatch-invariant mode costs {pct(result['invariant_cost'])} of engine tokens/s. "
        f"Ray's overhead: {pct(result['ray_overhead_wall'])} of output tokens/s on the wall "
        f"clock, {pct(result['ray_overhead_engine'])} on engine time.\n\n"
        f"Fault run (`--batch-invariant --ray --replicas 1 --ray-batch-size "
        f"{f['block_size']}`, the replica "
        f"SIGKILLed once rows were written; Ray restarted it and retried its block): "
        f"{f['wall_s']:.0f} s vs {f['clean_wall_s']:.0f} s clean; ids written {f['count']}, "
        f"duplicates {f['duplicates']}, missing {f['missing']} (rows the driver dropped as "
        f"re-delivered: {f['duplicates_dropped_by_driver']}).\n"
    )
