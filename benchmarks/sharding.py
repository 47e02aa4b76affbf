"""Communication of tensor / sequence / pipeline parallel steps: bytes moved by the collectives
in the compiled HLO against the analytical count, and step time (on the CPU devices of this
machine it is reported but not judged).

    python -m benchmarks sharding [--json]
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.bench import harness

_OP = re.compile(
    r"=\s+(?P<types>\(?[a-z0-9]+\[[^=]*?)\s+(?P<op>all-reduce|all-gather|"
    r"collective-permute|reduce-scatter|all-to-all)(?:-start)?\("
)
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


_WHILE = re.compile(r"\bwhile\(.*?\bbody=%?([\w.\-]+)[^\n]*")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def computations(hlo: str) -> dict[str, str]:
    """HLO text split into its named computations."""
    parts = re.split(r"\n(?=\S.*\{\s*$)", hlo, flags=re.M)
    return {p.split()[0].lstrip("%"): p for p in parts if p.strip()}


def loop_multipliers(comps: dict[str, str]) -> dict[str, int]:
    """How many times each while body runs per call: the compiler's known trip count, times
    that of any loop around it (a computation with no known count is taken once)."""
    parent: dict[str, tuple[str, int]] = {}
    for name, text in comps.items():
        for m in _WHILE.finditer(text):
            trips = _TRIPS.search(m.group(0))
            parent[m.group(1)] = (name, int(trips.group(1)) if trips else 1)

    def mult(name: str) -> int:
        if name not in parent:
            return 1
        outer, trips = parent[name]
        return trips * mult(outer)

    return {name: mult(name) for name in parent}


def collective_bytes(hlo: str) -> dict:
    """Bytes of each kind of collective per call; an op inside a loop counts once per trip."""
    comps = computations(hlo)
    mult = loop_multipliers(comps)
    totals: dict[str, float] = {}
    for name, part in comps.items():
        for m in _OP.finditer(part):
            size = 0
            for dtype, dims in _SHAPE.findall(m.group("types")):
                if dtype in _BYTES:
                    size += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            totals[m.group("op")] = totals.get(m.group("op"), 0) + size * mult.get(name, 1)
    return totals


def run(quick: bool = False) -> dict:
    from jaxgen.cache import KVCache
    from jaxgen.engine.runner import steps
    from jaxgen.model import ModelConfig, init_params
    from jaxgen.sharding.placement import Placement

    cfg = ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
    )
    params = init_params(cfg, jax.random.key(0))
    batch, prompt = 8, 64 if quick else 256
    d, kv_width = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    rows = []
    cases = [("tp=8", "decode"), ("tp=4", "prefill"), ("sp=4", "prefill"), ("pp=4", "decode")]
    for spec, kind in cases:
        placement = Placement.from_spec(cfg, spec, microbatches=4)
        sharded = placement.params(params)
        kv = placement.cache(KVCache.init(cfg, batch, prompt + 8))
        with placement.context():
            if kind == "decode":
                args = (sharded, jnp.zeros(batch, jnp.int32), kv)
                lowered = steps.decode.lower(*args, cfg=cfg, pipeline=placement.pipeline)
                tokens = batch
            else:
                args = (
                    sharded,
                    jnp.zeros((batch, prompt), jnp.int32),
                    jnp.full((batch,), prompt, jnp.int32),
                    kv,
                )
                lowered = steps.prefill.lower(*args, cfg=cfg, pipeline=placement.pipeline)
                tokens = batch * prompt
            compiled = lowered.compile()
            measured = collective_bytes(compiled.as_text())
            out = compiled(*args)
            jax.block_until_ready(out)
            kv_fresh = placement.cache(KVCache.init(cfg, batch, prompt + 8))
            args = args[:-1] + (kv_fresh,)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            seconds = time.perf_counter() - t0
        if spec.startswith("tp"):
            # Megatron: one all-reduce of the [tokens, D] activations after attention and one
            # after the MLP, per layer (payload bytes; a ring moves ~2(n-1)/n of them per device),
            # plus one after the lookup in the vocabulary-split embedding table.
            formula = (2 * cfg.num_layers + 1) * tokens * d * 4
            what = "(2 x L + 1) x tokens x D x 4 (all-reduce payload; +1: embedding)"
        elif spec.startswith("sp"):
            formula = 2 * cfg.num_layers * tokens * kv_width * 4
            what = "2 x L x tokens x K*H x 4 (K and V all-gathered)"
        else:
            s, m = placement.pipeline.stages, placement.pipeline.microbatches
            formula = (m + s - 1) * (batch // m) * d * 4 + batch * d * 4
            what = "(M+S-1) x microbatch x D x 4 (stage hand-offs) + B x D x 4 (output)"
        rows.append(
            {
                "mesh": spec,
                "step": kind,
                "hlo_bytes": float(sum(measured.values())),
                "formula_bytes": float(formula),
                "formula": what,
                "ratio": sum(measured.values()) / formula if formula else None,
                "collectives": measured,
                "seconds": seconds,
            }
        )
    return {
        "machine": harness.machine_info(),
        "model": "tiny (D=256, 4 layers, 8 heads / 4 KV)",
        "batch": batch,
        "prompt": prompt,
        "rows": rows,
    }


COLUMNS = [
    ("mesh", "mesh"),
    ("step", "step"),
    ("hlo_bytes", "HLO collective bytes"),
    ("formula_bytes", "analytical bytes"),
    ("ratio", "HLO / formula"),
    ("formula", "formula"),
    ("seconds", "step s (CPU, not judged)"),
]


def to_markdown(result: dict) -> str:
    m = result["machine"]
    return (
        f"### Parallelism: communication per step ({m['device']})\n\n"
        f"`python -m benchmarks sharding` on 8 host devices; {result['model']}, batch "
        f"{result['batch']}, prompt {result['prompt']}; {m['date']}. Bytes are the result "
        f"sizes of the collectives in the compiled HLO, each op inside a loop counted once per "
        f"trip (the compiler's known trip counts).\n\n"
        + harness.markdown_table(result["rows"], COLUMNS)
    )
