"""`jaxgen serve --disaggregated 1P1D`: a whole disaggregated deployment on this machine for
trying it: a Mooncake master (`mooncake_local.LocalMooncake`: the transfer engines' metadata
server), x prefill and y decode instances (`jaxgen serve --role prefill|decode --kv-transfer`,
one process each, with the command's other options; decode instances read the prompts' pages
straight from the prefill instances' memory), and the router in this process. It waits for
every instance's /health before the router answers and stops them all when it exits (Ctrl-C).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from jaxgen.entrypoints.disagg.router import RouterError, serve_router, wait_healthy
from jaxgen.entrypoints.mooncake_local import LocalMooncake, free_port

_OWN = ("--disaggregated", "--port", "--host", "--role", "--kv-mooncake", "--kv-transfer",
        "--prefill", "--decode", "--instance", "--router-load-weight")  # fmt: skip


def parse_layout(layout: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)P(\d+)D", layout.strip(), re.IGNORECASE)
    if not match or not all(int(g) > 0 for g in match.groups()):
        raise RouterError(f"--disaggregated takes xPyD with x, y >= 1 (e.g. 1P1D), got {layout!r}")
    return int(match.group(1)), int(match.group(2))


def instance_argv(argv: list[str]) -> list[str]:
    """The serve command's options (after `serve`) minus those each instance gets its own value
    of (and the deployment's own)."""
    argv = argv[1:] if argv[:1] == ["serve"] else list(argv)
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        i += 1
        if name not in _OWN:
            out.append(arg)
            continue
        if "=" in arg:
            continue
        if name in ("--prefill", "--decode", "--instance"):  # one or more URLs
            while i < len(argv) and not argv[i].startswith("-"):
                i += 1
        else:
            i += 1
    return out


def serve_local(layout: str, argv: list[str], *, host: str = "127.0.0.1", port: int = 8000,
                health_timeout_s: float = 900.0) -> int:  # fmt: skip
    prefills, decodes = parse_layout(layout)
    rest = instance_argv(argv)
    procs: list[subprocess.Popen] = []
    with LocalMooncake(segment_bytes=0) as store:  # the master alone: no store segment
        config = os.path.join(tempfile.mkdtemp(prefix="jaxgen-disagg-"), "mooncake.json")
        with open(config, "w") as f:
            json.dump(store.config(), f)
        urls = {"prefill": [], "decode": []}
        try:
            for role, count in (("prefill", prefills), ("decode", decodes)):
                for _ in range(count):
                    p = free_port()
                    cmd = [sys.executable, "-m", "jaxgen.cli", "serve", *rest, "--role", role,
                           "--port", str(p), "--kv-transfer", config]  # fmt: skip
                    procs.append(subprocess.Popen(cmd))
                    urls[role].append(f"http://127.0.0.1:{p}")
            print(f"jaxgen: waiting for {prefills} prefill and {decodes} decode instances",
                  flush=True)  # fmt: skip
            wait_healthy(urls["prefill"] + urls["decode"], health_timeout_s)
            serve_router(urls["prefill"], urls["decode"], host=host, port=port)
        finally:
            stop_processes(procs)
    return 0


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """Terminates every process, then kills those still running after `timeout_s`."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
