"""Benchmark harness: timing with warm-up and repeats, machine limits measured in the same run,
machine information, JSON output, and Markdown sections written into docs/benchmarks.md.

Speed is always reported next to a peer (or a machine limit) measured in the same process,
since the shared machines drift by 1.5-2.7x within minutes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxgen.engine import roofline

# The checkout's docs/ (jaxgen/bench/ -> the repository root).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")
BENCHMARKS_MD = os.path.join(DOCS, "benchmarks.md")


@dataclasses.dataclass
class Timing:
    min: float
    median: float
    max: float
    repeats: int

    def to_dict(self):
        return dataclasses.asdict(self)


def timeit(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5) -> Timing:
    """Times `fn()` (which must block until its work is done) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Timing(min(times), statistics.median(times), max(times), repeats)


def use_host_devices(count: int) -> None:
    """Makes the CPU appear as `count` devices (XLA's host-platform flag), if JAX has not
    started its backends yet; afterwards the flag cannot take effect and nothing changes."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if xla_bridge._backends or "xla_force_host_platform_device_count" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import jaxlib

    dev = jax.devices()[0]
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def machine_limits(quick: bool = False) -> dict:
    """Measured read bandwidth and matmul peaks of this machine, now (see engine.roofline)."""
    return dict(roofline.machine_limits(quick))


def gpu_peaks() -> dict | None:
    return roofline.gpu_peaks()


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Rows of dicts -> a Markdown table; columns are (key, header) pairs."""

    def fmt(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def write_section(name: str, body: str, path: str = BENCHMARKS_MD) -> None:
    """Replaces (or appends) the section between `<!-- bench:name -->` markers in `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block + "\n"
    )
    with open(path, "w") as f:
        f.write(text)


def plot(
    name: str,
    series: dict,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    directory: str = os.path.join(DOCS, "img"),
) -> str | None:
    """A line plot (PNG) of {label: (xs, ys)} into `directory`/name; returns its path relative
    to docs/ for a Markdown image link, or None without matplotlib (`pip install jaxgen[bench]`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for label, (xs, ys) in series.items():
        points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(directory, exist_ok=True)
    fig.savefig(os.path.join(directory, name))
    plt.close(fig)
    return os.path.relpath(os.path.join(directory, name), DOCS)


def dump_json(obj, path: str | None = None) -> str:
    text = json.dumps(obj, indent=2, default=_json_default)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return text


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")
