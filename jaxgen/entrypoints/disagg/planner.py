"""A latency model of one serving instance, and its least-squares fit to measured steps.

Functional forms (documented in docs/benchmarks.md, section disagg-sim):

  prefill step  = a + b * sum(L_i) + c * sum(L_i^2)        L_i: prompt tokens of row i
  decode step   = a + b * batch + c * sum(context_i)       context_i: KV tokens row i reads
  KV transfer   = a + bytes / bandwidth

The quadratic prefill term is causal attention (a prompt of L tokens scores ~L^2/2 pairs); a
chunk of c tokens after p cached ones costs c * (2p + c), so the chunks of one prompt sum to L^2.
The decode context term is the KV bytes a step reads (roofline.step_cost's bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxgen.errors import JaxgenError


class PlanningError(JaxgenError):
    """A latency model, trace, SLO or search bound is out of range."""


@dataclasses.dataclass(frozen=True)
class Fit:
    """Least-squares coefficients of one functional form and how well they explain the data."""

    coef: tuple[float, ...]
    names: tuple[str, ...]
    rel_rms: float  # sqrt(mean(((pred - y) / y)^2)) over the samples
    rel_max: float  # max |pred - y| / y
    num_samples: int

    def to_dict(self) -> dict:
        return dict(
            coef=dict(zip(self.names, self.coef, strict=True)),
            rel_rms=self.rel_rms,
            rel_max=self.rel_max,
            num_samples=self.num_samples,
        )


def fit_least_squares(
    features: Sequence[Sequence[float]], seconds: Sequence[float], names: Sequence[str]
) -> Fit:
    """Fits seconds ~ features @ coef, weighting each sample by 1/seconds (relative error, so
    a 2 ms step counts as much as a 2 s one); coefficients are clipped at 0 (a negative cost
    term would predict negative times outside the profiled range)."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(names) or len(y) != len(x):
        raise PlanningError(f"features {x.shape} and {len(y)} times for {len(names)} terms")
    if len(y) < len(names):
        raise PlanningError(f"{len(y)} samples cannot fit {len(names)} coefficients")
    if (y <= 0).any():
        raise PlanningError("measured times must be > 0")
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    if (coef < 0).any():  # refit without the negative terms (non-negative least squares, one pass)
        keep = coef > 0
        coef = np.zeros_like(coef)
        if keep.any():
            coef[keep], *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        coef = np.maximum(coef, 0.0)
    rel = (x @ coef - y) / y
    return Fit(
        coef=tuple(float(c) for c in coef),
        names=tuple(names),
        rel_rms=float(np.sqrt(np.mean(rel**2))),
        rel_max=float(np.max(np.abs(rel))),
        num_samples=len(y),
    )


def fit_prefill(samples: Sequence[tuple[Sequence[int], float]]) -> Fit:
    """samples: (prompt lengths of one prefill step, seconds)."""
    feats = [(1.0, sum(lens), sum(n * n for n in lens)) for lens, _ in samples]
    return fit_least_squares(feats, [s for _, s in samples], ("a", "b_per_token", "c_per_token2"))


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> Fit:
    """samples: (batch, summed context tokens, seconds) of decode-only steps."""
    feats = [(1.0, b, ctx) for b, ctx, _ in samples]
    return fit_least_squares(
        feats, [s for *_, s in samples], ("a", "b_per_seq", "c_per_context_token")
    )


def fit_steps(records: Sequence[dict]) -> Fit:
    """Steps of any mix, as an engine logs them (`serve --step-log`: "chunks" [(tokens,
    cached before them)], "decode_rows", "decode_context", "seconds"), fitted jointly to
    `LatencyModel.mixed_seconds`' form with one fixed cost: a + b_p sum(n) + c_p sum(n (2p + n))
    + b_d batch + c_d context. `LatencyModel.from_steps` makes the model."""
    feats = [
        (
            1.0,
            sum(n for n, _ in r["chunks"]),
            sum(n * (2 * p + n) for n, p in r["chunks"]),
            r["decode_rows"],
            r["decode_context"],
        )
        for r in records
    ]
    return fit_least_squares(
        feats,
        [r["seconds"] for r in records],
        ("a", "b_per_token", "c_per_token2", "b_per_seq", "c_per_context_token"),
    )


def fit_transfer(samples: Sequence[tuple[int, float]]) -> Fit:
    """samples: (bytes, seconds). Coefficients: latency a and seconds per byte."""
    feats = [(1.0, n) for n, _ in samples]
    return fit_least_squares(feats, [s for _, s in samples], ("a", "s_per_byte"))


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Step times of one instance (one TP group). Seconds; see the module docstring."""

    prefill: tuple[float, float, float]  # a, b per token, c per token^2
    decode: tuple[float, float, float]  # a, b per sequence, c per context token
    transfer: tuple[float, float]  # a, seconds per byte
    kv_bytes_per_token: int
    max_kv_tokens: int  # KV tokens the instance's pool holds (admission stops there)
    max_num_seqs: int = 256  # sequences decoded together at most
    max_batched_tokens: int = 2048  # token budget of one step (prefill rows + decode rows)

    def __post_init__(self):
        coefs = (*self.prefill, *self.decode, *self.transfer)
        if len(self.prefill) != 3 or len(self.decode) != 3 or len(self.transfer) != 2:
            raise PlanningError("prefill/decode need 3 coefficients, transfer 2")
        if any(c < 0 for c in coefs) or self.prefill[0] + self.decode[0] <= 0:
            raise PlanningError(f"coefficients must be >= 0 with a fixed cost > 0: {coefs}")
        if min(self.kv_bytes_per_token, self.max_kv_tokens, self.max_num_seqs) < 1:
            raise PlanningError("kv_bytes_per_token, max_kv_tokens, max_num_seqs must be >= 1")
        if self.max_batched_tokens < 1:
            raise PlanningError(f"{self.max_batched_tokens=} must be >= 1")

    @classmethod
    def from_steps(cls, fit: Fit, **kwargs) -> LatencyModel:
        """The model of a `fit_steps` fit (its fixed cost shared by prefill and decode);
        kwargs: the other fields."""
        a, bp, cp, bd, cd = fit.coef
        return cls(prefill=(a, bp, cp), decode=(a, bd, cd), **kwargs)

    def prefill_seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """chunks: (tokens, cached tokens before them) per row; a whole prompt is (L, 0)."""
        a, b, c = self.prefill
        return a + sum(b * n + c * n * (2 * p + n) for n, p in chunks)

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        a, b, c = self.decode
        return a + b * batch + c * context_tokens

    def mixed_seconds(self, chunks, batch: int, context_tokens: int) -> float:
        """A step holding prefill chunks and decode rows: both variable costs, and the larger
        fixed cost once (one launch, one weight read)."""
        if not chunks:
            return self.decode_seconds(batch, context_tokens)
        if not batch:
            return self.prefill_seconds(chunks)
        fixed = max(self.prefill[0], self.decode[0])
        return (
            fixed
            + self.prefill_seconds(chunks)
            - self.prefill[0]
            + self.decode_seconds(batch, context_tokens)
            - self.decode[0]
        )

    def transfer_seconds(self, num_tokens: int) -> float:
        a, s_per_byte = self.transfer
        return a + s_per_byte * num_tokens * self.kv_bytes_per_token

    def with_tp(
        self,
        tp: int,
        *,
        layers: int,
        hidden: int,
        act_bytes: int,
        allreduce_latency: float,
        link_bytes_per_s: float,
        kv_tokens: int,
    ) -> LatencyModel:
        """This model (measured on one device) run with tensor parallelism `tp`.

        Assumption (Megatron-style TP, read off roofline.step_cost): every term of the step
        (weight bytes, KV bytes, matmul and attention FLOPs) splits evenly over the tp devices,
        so each coefficient divides by tp, and each layer adds two ring all-reduces of the
        step's activations: 2 * layers * (latency + 2 (tp-1)/tp * tokens * hidden * act_bytes
        / link bandwidth). The per-token all-reduce cost goes into the b coefficients. kv_tokens:
        the KV pool of the tp devices together (the caller subtracts the weights)."""
        if tp < 1:
            raise PlanningError(f"{tp=} must be >= 1")
        if tp == 1:
            return dataclasses.replace(self, max_kv_tokens=kv_tokens)
        per_token = 2 * layers * 2 * (tp - 1) / tp * hidden * act_bytes / link_bytes_per_s
        fixed = 2 * layers * allreduce_latency
        pa, pb, pc = self.prefill
        da, db, dc = self.decode
        return dataclasses.replace(
            self,
            prefill=(pa / tp + fixed, pb / tp + per_token, pc / tp),
            decode=(da / tp + fixed, db / tp + per_token, dc / tp),
            max_kv_tokens=kv_tokens,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LatencyModel:
        """`to_dict`'s inverse, also after a JSON round trip (lists back to tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
