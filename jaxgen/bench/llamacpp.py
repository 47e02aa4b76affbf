"""llama.cpp as a benchmark peer, through `llama-cpp-python` (the optional `jaxgen[peers]` extra),
on the very GGUF file the default model comes from.

llama.cpp computes with the file's own quantized weights (Q4_1 for the default model) while
jaxgen dequantizes them to float32 on load, so the two read different numbers of weight bytes
per token; the tables say so. The Python binding runs one sequence at a time, so its offline
throughput is that of requests served one after another.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import time

import numpy as np


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def load(gguf: str | None = None, n_ctx: int = 2048, **options):
    """A `llama_cpp.Llama` on `gguf` (default: the embedded default model's file); `options`
    go to `Llama` as they are (e.g. logits_all=True)."""
    from llama_cpp import Llama

    from jaxgen.model.loading import default_gguf_path

    kwargs = dict(
        model_path=gguf or default_gguf_path(),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=os.cpu_count(),
        verbose=False,
    )
    if "use_extra_bufts" in inspect.signature(Llama.__init__).parameters:
        # ggml's extra (AMX) buffer types crash with an illegal instruction on some CPUs.
        kwargs["use_extra_bufts"] = False
    return Llama(**kwargs, **options)


def _generate(llm, prompt: list[int], n: int) -> int:
    """Greedy: prefill `prompt`, then exactly `n` new tokens (end-of-text does not stop it)."""
    llm.reset()  # no reuse of the previous call's cache
    tokens = itertools.islice(llm.generate(prompt, temp=0.0, reset=True), n)
    return sum(1 for _ in tokens)


def decode_step_s(llm, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """Seconds per decode step at batch 1: (N tokens - 1 token) / (N - 1), median of repeats."""
    _generate(llm, prompt, 2)
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _generate(llm, prompt, 1)
        t1 = time.perf_counter()
        _generate(llm, prompt, new_tokens)
        t2 = time.perf_counter()
        per_step.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1))
    return float(np.median(per_step))


def prefill_s(llm, prompt: list[int], repeats: int) -> float:
    """Seconds to prefill `prompt` (median of repeats)."""
    times = []
    for _ in range(repeats + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def serve_sequentially(llm, prompts, params) -> tuple[float, int]:
    """Each request in turn (the binding has no batching): (seconds, output tokens)."""
    t0 = time.perf_counter()
    produced = sum(_generate(llm, p, sp.max_tokens) for p, sp in zip(prompts, params, strict=True))
    return time.perf_counter() - t0, produced
