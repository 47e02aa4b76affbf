"""A plain multi-instance router that weighs cache hits against load (Mooncake's conductor, in
its simplest form): each instance answers how many leading tokens of a prompt it holds cached
(device pool or its KV tiers, `BlockManager.cached_prefix_tokens`), and the request goes to the
instance with the most saved prefill work after a penalty for the work already queued there.

score(instance) = cached_tokens - load_weight * (tokens of its waiting and running sequences
still to compute). Ties go to the first instance.
"""

from __future__ import annotations

import dataclasses

from jaxgen.errors import JaxgenError


@dataclasses.dataclass
class RouteDecision:
    index: int  # the chosen instance
    cached_tokens: list[int]  # per instance
    pending_tokens: list[int]  # per instance
    scores: list[float]


def pending_tokens(engine) -> int:
    """Prefill tokens still to compute plus one per running decode (the instance's load)."""
    sched = engine.scheduler
    waiting = sum(len(s.tokens) for s in sched.waiting)
    running = sum(max(len(s.tokens) - s.num_computed, 1) for s in sched.running)
    return waiting + running


class PrefixAwareRouter:
    """Routes prompts over engines (`LLM.engine` of each instance, paged)."""

    def __init__(self, engines, load_weight: float = 1.0):
        if not engines:
            raise JaxgenError("PrefixAwareRouter needs at least one engine")
        if load_weight < 0:
            raise JaxgenError(f"load_weight must be >= 0, got {load_weight}")
        self.engines = list(engines)
        self.load_weight = load_weight

    def route(self, prompt_ids: list[int], salt=None) -> RouteDecision:
        cached = [e.bm.cached_prefix_tokens(prompt_ids, salt) for e in self.engines]
        pending = [pending_tokens(e) for e in self.engines]
        scores = prefix_scores(cached, pending, self.load_weight)
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        return RouteDecision(best, cached, pending, scores)


def prefix_scores(cached: list[int], pending: list[int], load_weight: float) -> list[float]:
    """cached_tokens - load_weight * pending_tokens per instance (higher is better); shared by
    this router and the HTTP one (`entrypoints.disagg.router`)."""
    return [c - load_weight * p for c, p in zip(cached, pending, strict=True)]
