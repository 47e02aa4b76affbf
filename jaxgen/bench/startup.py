"""Start-up: process start to first token of `jaxgen generate`, and to `/health` of `jaxgen serve`,
cold and warm.

Three cache states, each a fresh process (`jaxgen generate --json --max-tokens 1`):
  cold         empty jaxgen cache: the GGUF is converted, every program compiled
  compile only the converted model is cached; no compiled program is
  warm         all cached: the ahead-of-time programs load from their serialized executables
The engine compiles its declared step buckets ahead of time (`engine.runner.aot`); the table lists
each program and its seconds. The wall time includes Python and JAX imports; the engine's own
breakdown (load, compile, ready) comes from `LLM.startup`, printed in the JSON line.
Then `jaxgen serve` (default settings: the ragged step's whole program ladder before `/health`)
from an empty cache and again from the cache it filled: process start to `/health` answering.

    jaxgen bench startup [--json]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from jaxgen.bench import harness

TARGET_WARM_S = 5.0
# Issue 58's must: `jaxgen serve` to /health from empty caches / from the executable cache.
TARGET_SERVE_S = {"cold": 90.0, "warm": 15.0}


def _serve(cache: str, model: str | None) -> float:
    """Seconds from `jaxgen serve`'s process start to /health, with the jaxgen cache `cache`."""
    from jaxgen.bench.replay import Server

    with Server(model, [], env={"JAXGEN_CACHE": cache}) as server:
        return server.start_to_health_s


def _start(cache: str, model: str | None) -> dict:
    cmd = [sys.executable, "-m", "jaxgen.cli", "generate", "--json", "--max-tokens", "1"]
    if model:
        cmd += ["--model", model]
    env = dict(os.environ, JAXGEN_CACHE=cache)
    t0 = time.perf_counter()
    out = subprocess.run(cmd + ["Hello"], capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"jaxgen generate failed: {out.stderr[-2000:]}")
    line = json.loads(out.stdout.strip().splitlines()[-1])
    startup = line.get("startup", {})
    programs = startup.pop("programs", [])
    return {
        "wall_s": wall,
        "ttft_s": line["metrics"]["ttft_s"],
        **{f"engine_{k}": v for k, v in startup.items()},
        "num_programs": len(programs),
        "programs_s": sum(p["seconds"] for p in programs),
        "sources": ", ".join(sorted({p["source"] for p in programs})),
        "programs": programs,
    }


def run(model: str | None = None, quick: bool = False) -> dict:
    from jaxgen.model.loading import cache_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        states = [("cold (convert + compile)", os.path.join(tmp, "cold"))]
        if not quick:
            # The converted model copied from the user's cache: only compilation is cold.
            warm_models = os.path.join(tmp, "compile", "models")
            src = os.path.join(cache_dir(), "models")
            if os.path.isdir(src):
                shutil.copytree(src, warm_models)
                states.append(("compile only (model converted)", os.path.join(tmp, "compile")))
        for name, cache in states:
            rows.append({"start": name, **_start(cache, model)})
        rows.append({"start": "warm (all cached)", **_start(states[0][1], model)})
        serve_cache = os.path.join(tmp, "serve")
        serve = {state: _serve(serve_cache, model) for state in ("cold", "warm")}
    warm = rows[-1]["wall_s"]
    return {
        "machine": harness.machine_info(),
        "rows": rows,
        "warm_s": warm,
        "target_warm_s": TARGET_WARM_S,
        "meets_target": warm <= TARGET_WARM_S,
        "serve_to_health_s": serve,
        "target_serve_s": TARGET_SERVE_S,
    }


COLUMNS = [
    ("start", "start"),
    ("wall_s", "process start → first token, s"),
    ("engine_load_s", "engine load s"),
    ("num_programs", "AOT programs"),
    ("sources", "compiled or loaded"),
    ("programs_s", "AOT s"),
    ("engine_ready_s", "engine ready s"),
    ("ttft_s", "first token after ready, s"),
]


def _program_rows(result: dict) -> list[dict]:
    """One row per ahead-of-time program: its seconds in each start."""
    rows = {}
    for start in result["rows"]:
        for p in start["programs"]:
            rows.setdefault(p["program"], {"program": p["program"]})[start["start"]] = p["seconds"]
    return list(rows.values())


def to_markdown(result: dict) -> str:
    m = result["machine"]
    verdict = "meets" if result["meets_target"] else "misses"
    serve = [
        f"{state} {result['serve_to_health_s'][state]:.1f} s (target "
        f"{result['target_serve_s'][state]:.0f} s)"
        for state in ("cold", "warm")
    ]
    return (
        "### Start-up (default model)\n\n"
        f"`jaxgen bench startup`: fresh processes of `jaxgen generate --max-tokens 1` (imports "
        f"included); {m['cpu']} ({m['cores']} cores), {m['date']}. Warm start "
        f"{result['warm_s']:.1f} s {verdict} the {result['target_warm_s']:.0f} s target.\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
        + "\n\n`jaxgen serve` (default settings), process start to `/health`: "
        + ", ".join(serve)
        + " (cold: an empty jaxgen cache; warm: the cache that start filled).\n\n"
        + "Seconds per ahead-of-time compiled program (the default `compile_buckets`):\n\n"
        + harness.markdown_table(
            _program_rows(result),
            [("program", "program")] + [(r["start"], r["start"]) for r in result["rows"]],
        )
    )
