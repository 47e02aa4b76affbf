"""Data-parallel replicas of the paged engine, behind the one-engine interface."""

from __future__ import annotations

from jaxgen.engine.core import LLMEngine


class EngineReplicas:
    """Data-parallel replicas: independent engines (each on its own sub-mesh) sharing the
    requests; the same interface as one LLMEngine."""

    def __init__(self, engines: list[LLMEngine]):
        self.engines = engines
        self.engine_cfg = engines[0].engine_cfg
        self._owner: dict[str, LLMEngine] = {}

    def check_request(self, request) -> None:
        self.engines[0].check_request(request)

    def add_request(self, request) -> None:
        self.add_requests([request])

    def add_requests(self, requests) -> None:
        for r in requests:  # the replicas share one configuration
            self.check_request(r)
        for r in requests:  # the least-loaded replica takes each
            engine = min(
                self.engines, key=lambda e: len(e.scheduler.running) + len(e.scheduler.waiting)
            )
            engine.scheduler.add(r)
            self._owner[r.request_id] = engine

    def abort(self, request_id: str) -> bool:
        engine = self._owner.pop(request_id, None)
        return engine.abort(request_id) if engine is not None else False

    def reset_prefix_cache(self) -> int:
        return sum(e.reset_prefix_cache() for e in self.engines)

    @property
    def has_work(self) -> bool:
        return any(e.has_work for e in self.engines)

    def step(self) -> list:
        events = []
        for engine in self.engines:
            if engine.has_work:
                events.extend(engine.step())
        return events

    def stats(self, limits: dict | None = None) -> dict:
        per = [e.stats(limits) for e in self.engines]
        skip = ("prefix_hit_rate", "mbu", "mfu", "step_gbps", "step_gflops")
        total = {
            k: sum(p[k] for p in per)
            for k, v in per[0].items()
            if isinstance(v, (int, float)) and k not in skip
        }
        total["replicas"] = per
        return total
