"""`python -m benchmarks disagg-sim`: the disaggregation planner (issue 25's planning part).

1. Measures a latency model of our own engine here (the default model, f32, on this machine's
   CPU; skipped with --quick): prefill and decode step times from the engine's own per-step
   timer (`EngineCore.last_step`), fitted to the forms in benchmarks/disagg/planner.py; and a
   host-side copy of page-sized buffers as the stand-in for the KV transfer (the Mooncake
   transfer figure comes with the roles).
2. Builds an H200 latency model of the Llama-3-8B shape from the step times committed in
   docs/gpu/ (e2e.json: prefill/decode at B=1 and 64; paged.json / flash.json: attention per
   layer), and projects per-device goodput to 8-64 GPUs with the simulator and DistServe's
   placement search. Everything after step 1 is SIMULATED.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from benchmarks.disagg import planner, search, traces
from benchmarks.disagg.planner import LatencyModel, PlanningError
from jaxgen.bench import harness

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")

# Llama-3-8B's public config (the shape docs/gpu/e2e.json measured), bf16.
LLAMA3_8B = dict(
    layers=32, hidden=4096, mlp=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256
)
H200_BYTES = 141e9
# Assumptions of the projection (stated in the docs section):
MEMORY_FRACTION = 0.9  # of device memory for weights + KV
ALLREDUCE_LATENCY_S = 10e-6  # one small NCCL all-reduce over NVLink
NVLINK_BYTES_PER_S = 450e9  # H200 NVLink, per direction
KV_LINK_BYTES_PER_S = 25e9  # prefill -> decode KV link (a 200 Gb/s NIC), latency 1 ms
KV_LINK_LATENCY_S = 1e-3
COLOCATED_CHUNK = 512  # chunked prefill's token budget per step (Sarathi-Serve's default)
PREFILL_BUDGET = 8192  # tokens of whole prompts a prefill instance batches
MAX_NUM_SEQS = 256
SLOS = {  # seconds; chosen around the measured 8B step times (B=1 decode step 13 ms)
    "summarization": search.SLO(ttft=1.0, tpot=0.04),
    "chat": search.SLO(ttft=0.25, tpot=0.04),
}
GPUS = (8, 16, 32, 64)


def llama8b_bytes() -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of the bf16 Llama-3-8B shape."""
    c = LLAMA3_8B
    attn = c["hidden"] * c["head_dim"] * (2 * c["heads"] + 2 * c["kv_heads"])
    per_layer = attn + 3 * c["hidden"] * c["mlp"]
    params = c["layers"] * per_layer + 2 * c["vocab"] * c["hidden"]
    kv = 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * 2
    return 2 * params, kv


def h200_model(docs: str = DOCS) -> tuple[LatencyModel, dict]:
    """The TP=1 latency model of the 8B shape on one H200, from the committed GPU results, and
    how each coefficient was derived. Two measured points per phase fix a and b exactly (no
    residual: the fit error is unknown there); c comes from the attention kernels' times."""
    layers = LLAMA3_8B["layers"]
    e2e = json.load(open(os.path.join(docs, "gpu", "e2e.json")))
    rows = {r["batch"]: r for r in e2e["rows"] if r["model"] == "llama3-8b-shape"}
    if not {1, 64} <= rows.keys():
        raise PlanningError("docs/gpu/e2e.json lacks the llama3-8b-shape rows at B=1 and 64")
    paged = json.load(open(os.path.join(docs, "gpu", "paged.json")))["rows"]
    # Decode attention is bandwidth-bound at large batch x context: per KV token per layer.
    big = [r for r in paged if r["kernel"] == "jaxgen" and r["batch"] * r["context"] >= 1 << 20]
    c_dec = layers * statistics.median(r["us"] * 1e-6 / (r["batch"] * r["context"]) for r in big)
    flash = json.load(open(os.path.join(docs, "gpu", "flash.json")))["rows"]
    fl = [r for r in flash if r["kernel"] == "jaxgen"]
    c_pre = layers * statistics.median(
        r["fwd_ms"] * 1e-3 / (r["batch"] * r["seq"] ** 2) for r in fl
    )
    p, n = e2e["prompt_len"], e2e["new_tokens"]
    ctx = p + n / 2  # e2e.py's mean context of a decode step

    def solve(t1, t64, x1, x64):  # t = a + b x at two points
        b = max((t64 - t1) / (x64 - x1), 0.0)
        return max(t1 - b * x1, 0.0), b

    dt = {b: rows[b]["decode_step_ms"] * 1e-3 - c_dec * b * ctx for b in (1, 64)}
    da, db = solve(dt[1], dt[64], 1, 64)
    pt = {b: b * p / rows[b]["prefill_tok_s"] - c_pre * b * p * p for b in (1, 64)}
    pa, pb = solve(pt[1], pt[64], p, 64 * p)
    weights, kv = llama8b_bytes()
    model = LatencyModel(
        prefill=(pa, pb, c_pre),
        decode=(da, db, c_dec),
        transfer=(KV_LINK_LATENCY_S, 1 / KV_LINK_BYTES_PER_S),
        kv_bytes_per_token=kv,
        max_kv_tokens=int((MEMORY_FRACTION * H200_BYTES - weights) // kv),
        max_num_seqs=MAX_NUM_SEQS,
    )
    source = dict(
        device=e2e["machine"]["device"],
        date=e2e["machine"]["date"],
        dtype=e2e["dtype"],
        prompt_len=p,
        decode_context=ctx,
        decode_step_ms={b: rows[b]["decode_step_ms"] for b in (1, 64)},
        prefill_tok_s={b: rows[b]["prefill_tok_s"] for b in (1, 64)},
        c_decode_from="paged.json jaxgen rows with batch*context >= 2^20, median per token-layer",
        c_prefill_from="flash.json jaxgen causal fwd rows, median per token^2-layer",
        weight_bytes=weights,
    )
    return model, source


def model_for_factory(base: LatencyModel):
    """(tp, role) -> the instance's model: TP as in LatencyModel.with_tp, role token budgets."""
    weights = llama8b_bytes()[0]

    def model_for(tp: int, role: str) -> LatencyModel:
        kv_tokens = int((tp * MEMORY_FRACTION * H200_BYTES - weights) // base.kv_bytes_per_token)
        m = base.with_tp(
            tp,
            layers=LLAMA3_8B["layers"],
            hidden=LLAMA3_8B["hidden"],
            act_bytes=2,
            allreduce_latency=ALLREDUCE_LATENCY_S,
            link_bytes_per_s=NVLINK_BYTES_PER_S,
            kv_tokens=kv_tokens,
        )
        budget = COLOCATED_CHUNK if role == "colocated" else PREFILL_BUDGET
        return type(m)(**{**m.to_dict(), "max_batched_tokens": budget})

    return model_for


# ----------------------------------------------------------------------------------------------
# Measured here: our engine's step times and a host copy of KV pages
# ----------------------------------------------------------------------------------------------
def measure_host_copy(page_bytes: int, pages=(1, 4, 16, 64, 256), repeats: int = 5) -> dict:
    """Seconds to copy n page-sized buffers host-to-host (numpy, one core): the loopback
    stand-in for a KV transfer, fitted as a + bytes / bandwidth."""
    samples = []
    for n in pages:
        src = [np.ones(page_bytes // 4, np.float32) for _ in range(n)]
        dst = [np.empty_like(s) for s in src]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for s, d in zip(src, dst, strict=True):
                np.copyto(d, s)
            times.append(time.perf_counter() - t0)
        samples.append((n * page_bytes, statistics.median(times)))
    fit = planner.fit_transfer(samples)
    return dict(
        page_bytes=page_bytes,
        samples=[dict(bytes=b, seconds=s) for b, s in samples],
        fit=fit.to_dict(),
        gbps=1 / fit.coef[1] / 1e9 if fit.coef[1] > 0 else None,
    )


def _run_steps(llm, prompts, max_tokens: int) -> list[dict]:
    """Runs the prompts through the engine together; returns each landed step's own record."""
    from jaxgen import SamplingParams

    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_requests(llm.processor.make_requests(prompts, sp, stream=False))
    steps, last = [], engine.last_step
    while engine.has_work:
        engine.step()
        if engine.last_step is not last:
            last = engine.last_step
            steps.append(dict(last))
    return steps


def profile_engine(
    llm,
    *,
    prefill=((1, 32), (1, 128), (1, 256), (1, 512), (4, 128)),
    decode_batches=(1, 4, 16),
    decode_prompt=64,
    decode_tokens=24,
) -> dict:
    """Step times of `llm`'s paged engine, fitted. prefill: (prompts, tokens each) per step;
    every shape runs twice and only the second run counts (the first compiles)."""
    from jaxgen.engine import roofline

    engine = llm.engine
    kv_per_token = roofline.kv_bytes_per_token(engine.cfg, engine.kv_itemsize)
    pre, dec = [], []
    for n, length in prefill:
        prompts = [[100 + i + j for j in range(length)] for i in range(n)]
        for run in range(2):
            llm.reset_prefix_cache()
            steps = _run_steps(llm, prompts, 1)
            first = steps[0]
            if run and first["decode_rows"] == 0 and first["tokens"] == n * length:
                pre.append(([length] * n, first["seconds"]))
    for b in decode_batches:
        prompts = [[200 + i + j for j in range(decode_prompt)] for i in range(b)]
        for run in range(2):
            llm.reset_prefix_cache()
            steps = _run_steps(llm, prompts, decode_tokens)
            if run:
                for s in steps:
                    if s["prefill_rows"] == 0 and s["decode_rows"] > 0:
                        ctx = round((s["bytes"] - engine.weight_bytes) / kv_per_token)
                        dec.append((s["decode_rows"], ctx, s["seconds"]))
    pre_fit, dec_fit = planner.fit_prefill(pre), planner.fit_decode(dec)
    return dict(
        prefill_samples=[dict(prompt_lens=lens, seconds=s) for lens, s in pre],
        decode_samples=[dict(batch=b, context=c, seconds=s) for b, c, s in dec],
        prefill_fit=pre_fit.to_dict(),
        decode_fit=dec_fit.to_dict(),
        kv_bytes_per_token=kv_per_token,
    )


# ----------------------------------------------------------------------------------------------
# Simulated: placement search and projection
# ----------------------------------------------------------------------------------------------
def project(
    model_for,
    *,
    num_requests: int,
    seed: int,
    max_unit: int,
    tps,
    rel_tol: float,
    gpus=GPUS,
    slos=SLOS,
) -> dict:
    """Per trace: the goodput of every placement within max_unit devices, the best colocated and
    disaggregated ones, their SLO attainment vs rate, and the projection to `gpus` devices by
    replicating the best unit (Poisson arrivals split evenly over replicas stay Poisson, so a
    replica keeps its per-device goodput; DistServe section 4.2 replicates the same way)."""
    out = {}
    for name, spec in traces.TRACES.items():
        lengths = traces.sample_lengths(spec, num_requests, seed)
        gaps = traces.unit_gaps(num_requests, seed)
        slo = slos[name]
        cands = search.placements(max_unit, tps)
        rows = search.search(cands, lengths, gaps, slo, model_for, rel_tol)
        best = {
            k: next(r for r in rows if r["placement"]["kind"] == k)
            for k in ("colocated", "disaggregated")
        }
        curves = {}
        for kind, r in best.items():
            p = search.Placement(**r["placement"])
            top = max(r["per_device_rps"], 1e-3) * 2
            rates = [top * (i + 1) / 8 for i in range(8)]
            att = [
                search.attainment(
                    search.simulate(
                        p, traces.poisson_requests(lengths, x * p.devices, gaps), model_for
                    ),
                    slo.ttft,
                    slo.tpot,
                )
                for x in rates
            ]
            curves[kind] = dict(label=r["label"], per_device_rps=rates, attainment=att)
        proj = []
        for n in gpus:
            for kind in ("colocated", "disaggregated"):
                fits = [r for r in rows if r["placement"]["kind"] == kind and r["devices"] <= n]
                unit = max(fits, key=lambda r: (n // r["devices"]) * r["goodput_rps"])
                total = (n // unit["devices"]) * unit["goodput_rps"]
                proj.append(
                    dict(
                        gpus=n,
                        kind=kind,
                        unit=unit["label"],
                        replicas=n // unit["devices"],
                        goodput_rps=total,
                        per_device_rps=total / n,
                    )
                )
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        out[name] = dict(
            slo=dict(ttft=slo.ttft, tpot=slo.tpot, target=slo.target),
            lengths=dict(
                mean_prompt=mean([p for p, _ in lengths]), mean_output=mean([o for _, o in lengths])
            ),
            placements=rows,
            best=best,
            ratio=(
                best["disaggregated"]["per_device_rps"] / best["colocated"]["per_device_rps"]
                if best["colocated"]["per_device_rps"]
                else None
            ),
            curves=curves,
            projection=proj,
        )
    return out


def run(*, quick: bool = False, llm_factory=None, seed: int = 0) -> dict:
    """quick: no engine profiling, 120 requests, TP 1/2, units of up to 4 devices."""
    result = dict(machine=harness.machine_info(), simulated="everything under 'h200' and 'sim'")
    _, kv = llama8b_bytes()
    result["host_copy"] = measure_host_copy(16 * kv // 32)  # one 16-token page of one layer
    if not quick and llm_factory is not None:
        result["engine_profile"] = profile_engine(llm_factory())
    base, source = h200_model()
    result["h200"] = dict(model=base.to_dict(), source=source)
    model_for = model_for_factory(base)
    result["h200"]["tp_models"] = {tp: model_for(tp, "decode").to_dict() for tp in (1, 2, 4, 8)}
    result["sim"] = project(
        model_for,
        num_requests=120 if quick else 2000,
        seed=seed,
        max_unit=4 if quick else 8,
        tps=(1, 2) if quick else (1, 2, 4, 8),
        rel_tol=0.05 if quick else 0.02,
    )
    return result


def plot(result: dict) -> dict:
    """SLO attainment vs per-device rate of the best placements, and the projection."""
    out = {}
    series = {}
    for name, sim in result["sim"].items():
        for c in sim["curves"].values():
            series[f"{name}: {c['label']}"] = (c["per_device_rps"], c["attainment"])
    out["attainment"] = harness.plot(
        "disagg_sim_attainment.png",
        series,
        xlabel="requests/s per device",
        ylabel="fraction within TTFT and TPOT SLOs",
        title="SIMULATED: Llama-3-8B shape on H200 (from docs/gpu step times)",
    )
    series = {}
    for name, sim in result["sim"].items():
        for kind in ("colocated", "disaggregated"):
            rows = [r for r in sim["projection"] if r["kind"] == kind]
            series[f"{name}: {kind}"] = (
                [r["gpus"] for r in rows],
                [r["goodput_rps"] for r in rows],
            )
    out["projection"] = harness.plot(
        "disagg_sim_projection.png",
        series,
        xlabel="GPUs",
        ylabel="goodput (requests/s, 90% within SLOs)",
        title="SIMULATED goodput, 8-64 H200s",
        logx=True,
        logy=True,
    )
    return out


def _fit_line(name: str, fit: dict, unit: dict) -> str:
    coef = ", ".join(f"{k} = {v * unit.get(k, 1):.4g}" for k, v in fit["coef"].items())
    return (
        f"- {name}: {coef}; relative error rms {fit['rel_rms']:.1%}, max {fit['rel_max']:.1%} "
        f"over {fit['num_samples']} steps"
    )


def to_markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["### Disaggregation planner (`python -m benchmarks disagg-sim`)", ""]
    lines.append(
        "Issue 25's planning part: a latency model, a discrete-event simulator and DistServe's "
        "placement search (benchmarks/disagg). **Measured** here: our engine's step times and a "
        "host-side copy; **SIMULATED**: every goodput below."
    )
    lines += ["", f"#### Measured on {m['cpu']} ({m['cores']} cores), {m['date']}", ""]
    prof = result.get("engine_profile")
    if prof:
        lines.append(
            "Default model (SmolLM2-135M, f32) through the paged engine, times from the engine's "
            "own per-step timer; forms `prefill = a + b*sum(L) + c*sum(L^2)`, "
            "`decode = a + b*batch + c*sum(context)` (seconds):"
        )
        lines.append(_fit_line("prefill", prof["prefill_fit"], {}))
        lines.append(_fit_line("decode", prof["decode_fit"], {}))
    elif result.get("engine_profile_skipped"):
        lines.append(f"Engine profiling not run: {result['engine_profile_skipped']}.")
    else:
        lines.append("Engine profiling skipped (--quick).")
    hc = result["host_copy"]
    gbps = f"{hc['gbps']:.1f} GB/s" if hc["gbps"] else "n/a"
    lines.append(
        f"- KV transfer stand-in (numpy copy of {hc['page_bytes']}-byte pages on the host, not "
        f"Mooncake): {gbps}; " + _fit_line("fit", hc["fit"], {})[len("- fit: ") :]
    )
    h = result["h200"]
    mod, src = h["model"], h["source"]
    lines += [
        "",
        f"#### SIMULATED: Llama-3-8B shape, bf16, on {src['device']} (step times of "
        f"{src['date']} in docs/gpu)",
        "",
        f"TP=1 model: prefill a = {mod['prefill'][0] * 1e3:.2f} ms, b = "
        f"{mod['prefill'][1] * 1e6:.2f} us/token, c = {mod['prefill'][2] * 1e9:.3f} ns/token^2; "
        f"decode a = {mod['decode'][0] * 1e3:.2f} ms, b = {mod['decode'][1] * 1e6:.1f} us/seq, "
        f"c = {mod['decode'][2] * 1e9:.1f} ns/context token. a and b solve the two measured "
        "points (B=1, 64) of docs/gpu/e2e.json exactly (so no fit error can be stated); c comes "
        "from the attention kernels (paged.json, flash.json) per layer x 32 layers.",
        "",
        "Assumptions: TP t divides every coefficient by t (weights, KV and FLOPs shard evenly, "
        "as roofline.step_cost's bytes and FLOPs do) and adds two ring all-reduces per layer "
        f"({ALLREDUCE_LATENCY_S * 1e6:.0f} us each + 2(t-1)/t x tokens x 4096 x 2 bytes at "
        f"{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s NVLink); KV pool = {MEMORY_FRACTION:.0%} of "
        f"t x 141 GB less the weights; prefill->decode KV over a "
        f"{KV_LINK_BYTES_PER_S / 1e9:.0f} GB/s link + {KV_LINK_LATENCY_S * 1e3:.0f} ms "
        "(counted in TTFT); colocated instances chunk prefill at "
        f"{COLOCATED_CHUNK} tokens per step, prefill instances batch whole prompts up to "
        f"{PREFILL_BUDGET} tokens; at most {MAX_NUM_SEQS} sequences per instance; Poisson "
        "arrivals; units of at most 8 GPUs replicated to fill 8-64 (per-device goodput is "
        "that of the unit); every step program compiled before serving (no compile stalls, "
        "which `benchmarks disagg` measures and models on this host) and no engine time on handed-"
        "off KV beyond the link (the handoff `benchmarks disagg` measures here is host-side work "
        "whose GPU cost no run has measured yet).",
        "",
    ]
    for name, sim in result["sim"].items():
        spec = traces.TRACES[name]
        slo = sim["slo"]
        lines.append(
            f"**{name}** (prompts log-normal median {spec.prompt.median:.0f}, sigma "
            f"{spec.prompt.sigma}, {spec.prompt.low}..{spec.prompt.high}; outputs median "
            f"{spec.output.median:.0f}, sigma {spec.output.sigma}, "
            f"{spec.output.low}..{spec.output.high}; sampled means "
            f"{sim['lengths']['mean_prompt']:.0f} / {sim['lengths']['mean_output']:.0f}): SLOs "
            f"TTFT {slo['ttft']} s, TPOT {slo['tpot'] * 1e3:.0f} ms, {slo['target']:.0%}. Best "
            f"colocated {sim['best']['colocated']['label']} "
            f"{sim['best']['colocated']['per_device_rps']:.2f} req/s/GPU; best disaggregated "
            f"{sim['best']['disaggregated']['label']} "
            f"{sim['best']['disaggregated']['per_device_rps']:.2f} req/s/GPU"
            + (f" (x{sim['ratio']:.2f})." if sim["ratio"] else ".")
        )
        lines.append("")
        lines.append(
            harness.markdown_table(
                sim["projection"],
                [
                    ("gpus", "GPUs"),
                    ("kind", "deployment"),
                    ("unit", "unit"),
                    ("replicas", "units"),
                    ("goodput_rps", "goodput req/s (SIMULATED)"),
                    ("per_device_rps", "req/s per GPU (SIMULATED)"),
                ],
            )
        )
        lines.append("")
    plots = result.get("plots") or {}
    for key, path in plots.items():
        if path:
            lines.append(f"![{key}]({path})")
    lines.append("")
    lines.append(
        "Validation: `python -m benchmarks disagg` (section below) compares the simulator with "
        "runs measured on this host and gives its goodput error per trace and deployment. Numbers "
        "here are the model's, not the hardware's."
    )
    return "\n".join(lines)
