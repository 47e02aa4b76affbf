"""Seeded synthetic workloads: length distributions, and Poisson arrivals at a given rate.

Lengths are log-normal (median, sigma of the log), rounded and clipped to [low, high]:

  summarization: prompts median 1800 tokens (sigma 0.5, 256..6144), answers median 64 (sigma
                 0.5, 8..256): long prompts, short answers (LongBench-like).
  chat:          prompts median 300 (sigma 0.9, 8..3072), answers median 180 (sigma 0.8,
                 4..1024) (ShareGPT-like).
"""

from __future__ import annotations

import dataclasses
import math
import random

from benchmarks.disagg.planner import PlanningError
from benchmarks.disagg.simulator import Request


@dataclasses.dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return min(
            self.high, max(self.low, round(self.median * math.exp(rng.gauss(0, self.sigma))))
        )


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    name: str
    prompt: LogNormal
    output: LogNormal
    description: str


TRACES = {
    "summarization": TraceSpec(
        "summarization",
        LogNormal(1800, 0.5, 256, 6144),
        LogNormal(64, 0.5, 8, 256),
        "long prompts, short answers",
    ),
    "chat": TraceSpec("chat", LogNormal(300, 0.9, 8, 3072), LogNormal(180, 0.8, 4, 1024), "chat"),
}


def sample_lengths(spec: TraceSpec, num_requests: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of `num_requests` requests, the same for the same seed."""
    if num_requests < 1:
        raise PlanningError(f"{num_requests=} must be >= 1")
    rng = random.Random(seed)
    return [(spec.prompt.sample(rng), spec.output.sample(rng)) for _ in range(num_requests)]


def unit_gaps(num_requests: int, seed: int) -> list[float]:
    """Inter-arrival gaps of a rate-1 Poisson process; divided by a rate they give that rate's
    arrivals, so traces at different rates hold the same requests in the same order."""
    rng = random.Random(seed + 1_000_003)
    return [rng.expovariate(1.0) for _ in range(num_requests)]


def poisson_requests(
    lengths: list[tuple[int, int]], rate: float, gaps: list[float]
) -> list[Request]:
    if rate <= 0:
        raise PlanningError(f"{rate=} must be > 0 requests/s")
    if not lengths or len(gaps) != len(lengths):
        raise PlanningError(f"{len(lengths)} requests need as many gaps, got {len(gaps)}")
    t, out = 0.0, []
    for (p, o), g in zip(lengths, gaps, strict=True):
        t += g / rate
        out.append(Request(t, p, o))
    return out
