"""Benchmark harness: timing with warm-up and repeats, machine limits measured in the same run,
machine information, JSON output, and Markdown sections written into the docs page of their
topic (`SECTION_PAGES`).

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
import textwrap
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxgen.engine import roofline

# The checkout's docs/ (jaxgen/bench/ -> the repository root).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")

# Which docs page holds each `jaxgen bench` section (docs/benchmarks.md lists them by section).
# A section name's variant (`throughput:pp=2`) goes to its base name's page.
SECTION_PAGES = {
    "decode": "serving.md",
    "throughput": "serving.md",
    "serve": "serving.md",
    "speculative": "serving.md",
    "sharding": "serving.md",
    "structured": "serving.md",
    "lora": "serving.md",
    "batch": "serving.md",
    "e2e": "serving.md",
    "moe": "models.md",
    "startup": "compilation.md",
    "replay": "compilation.md",
    "ragged": "compilation.md",
    "ragged-replay": "compilation.md",
    "overhead": "compilation.md",
    "overhead-profile": "compilation.md",
    "sharing": "kv_cache.md",
    "kvstore": "kv_cache.md",
    "disagg-sim": "disaggregation.md",
    "disagg": "disaggregation.md",
    "gpu": "gpu.md",
    "e2e-gpu": "gpu.md",
    "kernels-flash": "gpu.md",
    "kernels-paged": "gpu.md",
    "kernels-prefill": "gpu.md",
}
# Prose lines in the pages stay readable in a terminal and a diff (tables are left whole).
PROSE_WIDTH = 110


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


def section_page(name: str) -> str:
    """The docs page that holds section `name` (or its base name's, for a variant)."""
    base = name.split(":", 1)[0]
    if base not in SECTION_PAGES:
        raise ValueError(
            f"no docs page for benchmark section {name!r}: add it to harness.SECTION_PAGES "
            f"(known: {', '.join(sorted(SECTION_PAGES))})"
        )
    return os.path.join(DOCS, SECTION_PAGES[base])


def wrap_prose(text: str, width: int = PROSE_WIDTH) -> str:
    """Markdown with every prose line longer than `width` wrapped at spaces; tables, headings,
    images, HTML comments and fenced code stay as they are (a wrapped paragraph or list item
    renders the same)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        stripped = line.lstrip()
        keep = fenced or len(line) <= width or stripped.startswith(("|", "#", "![", "<!--"))
        if keep:
            out.append(line)
            continue
        indent = line[: len(line) - len(stripped)]
        item = re.match(r"([-*]|\d+\.) ", stripped)
        follow = indent + " " * (len(item.group(0)) if item else 0)
        out.extend(
            textwrap.wrap(
                stripped,
                width,
                initial_indent=indent,
                subsequent_indent=follow,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
    return "\n".join(out)


def write_section(name: str, body: str, path: str | None = None) -> None:
    """Replaces (or appends) the section between `<!-- bench:name -->` markers in `path`
    (default: the section's page, `section_page(name)`)."""
    path = path or section_page(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{wrap_prose(body.strip())}\n{end}"
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
