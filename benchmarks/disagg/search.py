"""DistServe's goodput search (Zhong et al., OSDI 2024, section 4): the highest request rate
at which a deployment keeps a target fraction of requests within both SLOs, found by
simulating the same trace at scaled rates and bisecting; per-device goodput is that rate over
the devices used, and the placement search enumerates TP degrees and instance counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from benchmarks.disagg.planner import LatencyModel, PlanningError
from benchmarks.disagg.simulator import (
    Outcome,
    Request,
    attainment,
    simulate_colocated,
    simulate_disaggregated,
)
from benchmarks.disagg.traces import poisson_requests


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft: float  # seconds
    tpot: float  # seconds
    target: float = 0.9  # fraction of requests that must meet both

    def __post_init__(self):
        if self.ttft <= 0 or self.tpot <= 0:
            raise PlanningError(f"SLOs must be > 0 seconds: ttft={self.ttft}, tpot={self.tpot}")
        if not 0 < self.target <= 1:
            raise PlanningError(f"attainment target {self.target} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Placement:
    kind: str  # "colocated" | "disaggregated"
    tp_prefill: int  # colocated: the instances' TP degree
    num_prefill: int  # colocated: the instance count
    tp_decode: int = 0
    num_decode: int = 0

    @property
    def devices(self) -> int:
        return self.tp_prefill * self.num_prefill + self.tp_decode * self.num_decode

    def label(self) -> str:
        if self.kind == "colocated":
            return f"{self.num_prefill}x colocated TP{self.tp_prefill}"
        return f"{self.num_prefill}P TP{self.tp_prefill} + {self.num_decode}D TP{self.tp_decode}"


ModelFor = Callable[[int, str], LatencyModel]  # (TP degree, role) -> the instance's model


def simulate(
    placement: Placement, requests: Sequence[Request], model_for: ModelFor
) -> list[Outcome]:
    """Roles: "colocated", "prefill", "decode" (a role may use its own token budget)."""
    if placement.kind == "colocated":
        return simulate_colocated(
            requests, model_for(placement.tp_prefill, "colocated"), placement.num_prefill
        )
    if placement.kind == "disaggregated":
        return simulate_disaggregated(
            requests,
            model_for(placement.tp_prefill, "prefill"),
            model_for(placement.tp_decode, "decode"),
            placement.num_prefill,
            placement.num_decode,
        )
    raise PlanningError(f"unknown placement kind {placement.kind!r}")


def max_rate(
    run: Callable[[float], float],
    target: float,
    *,
    start: float = 1.0,
    rel_tol: float = 0.02,
    max_rate_limit: float = 1e5,
) -> float:
    """The highest rate r (within rel_tol) with run(r) >= target, where run(r) is the SLO
    attainment at rate r: doubling to bracket, then bisection. 0 when even a rate of
    start / 2^20 misses the target."""
    if start <= 0 or rel_tol <= 0:
        raise PlanningError(f"{start=} and {rel_tol=} must be > 0")
    lo, hi = 0.0, start
    while run(hi) >= target:
        lo, hi = hi, hi * 2
        if hi > max_rate_limit:
            raise PlanningError(f"attainment holds past {max_rate_limit} requests/s")
    if lo == 0.0:  # halve until a rate passes
        for _ in range(20):
            hi /= 2
            if run(hi) >= target:
                lo, hi = hi, hi * 2
                break
        else:
            return 0.0
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if run(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def goodput(
    placement: Placement,
    lengths: list[tuple[int, int]],
    gaps: list[float],
    slo: SLO,
    model_for: ModelFor,
    rel_tol: float = 0.02,
) -> float:
    """Requests/s the placement serves with slo.target of them within both SLOs."""

    def run(rate: float) -> float:
        outs = simulate(placement, poisson_requests(lengths, rate, gaps), model_for)
        return attainment(outs, slo.ttft, slo.tpot)

    return max_rate(run, slo.target, start=float(placement.devices), rel_tol=rel_tol)


def placements(
    max_devices: int, tps: Sequence[int] = (1, 2, 4, 8), max_instances: int = 4
) -> list[Placement]:
    """Colocated single instances of each TP degree (replicas have the same per-device
    goodput under Poisson arrivals) and every disaggregated mix within max_devices with at
    most max_instances of each role."""
    if max_devices < 1:
        raise PlanningError(f"{max_devices=} must be >= 1")
    out = [Placement("colocated", t, 1) for t in tps if t <= max_devices]
    for tp_p in tps:
        for tp_d in tps:
            for n_p in range(1, min(max_devices // tp_p, max_instances) + 1):
                for n_d in range(1, min((max_devices - tp_p * n_p) // tp_d, max_instances) + 1):
                    out.append(Placement("disaggregated", tp_p, n_p, tp_d, n_d))
    return out


def search(
    candidates: Sequence[Placement],
    lengths: list[tuple[int, int]],
    gaps: list[float],
    slo: SLO,
    model_for: ModelFor,
    rel_tol: float = 0.02,
) -> list[dict]:
    """Goodput of every candidate, best per-device goodput first."""
    rows = []
    for p in candidates:
        rate = goodput(p, lengths, gaps, slo, model_for, rel_tol)
        rows.append(
            dict(
                placement=dataclasses.asdict(p),
                label=p.label(),
                devices=p.devices,
                goodput_rps=rate,
                per_device_rps=rate / p.devices,
            )
        )
    rows.sort(key=lambda r: -r["per_device_rps"])
    return rows
