"""The quantization table: every method on the default model, perplexity on real text.

    python -m benchmarks.quantization [--tokens 4096] [--quick] [--write-docs] [--out JSON]
    python -m benchmarks.quantization --from-json JSON --write-docs   (render a finished run)

Calibration: wikitext-2 valid; evaluation: the first N tokens of wikitext-2 test (the same for
every row), sliding windows of 1024 with stride 512. Per row: perplexity, change vs float32,
bits per linear weight (scales, mins and padding included), weight bytes (linear layers and in
all), KV-cache bytes per token, decode tokens/s at batch 1 on this machine (through the engine),
and method notes. Writes docs/quantization.md and a plot.

llama.cpp rows (when `llama-cpp-python`, the `peers` extra, is installed): our float32 weights
are written as a float32 GGUF, quantized by llama.cpp's own `llama_model_quantize`, read back
with our GGUF loader and evaluated by our engine on the same tokens. Their token embeddings are
replaced by our float32 ones, so in every row only the linear layers are quantized; their
decode tokens/s is llama.cpp's own runtime on the quantized file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

from jaxgen.bench import harness, llamacpp

DATA = os.path.join(harness.REPO, "..", "shared", "data", "wikitext-2")
DOC = os.path.join(harness.DOCS, "quantization.md")
PLOT = os.path.join(harness.DOCS, "img", "quantization.png")

# (label, QuantSpec kwargs or None for float32, KV cache dtype)
ROWS = [
    ("float32", None, None),
    ("int8 RTN per-channel", dict(method="rtn", bits=8), None),
    ("llama.cpp Q8_0", dict(llamacpp="Q8_0"), None),
    (
        "int8 RTN g32, f16 scales",
        dict(method="rtn", bits=8, group_size=32, scale_dtype="float16"),
        None,
    ),
    (
        "int8 g32, f16 scales, scale search",
        dict(method="rtn", bits=8, group_size=32, scale_dtype="float16", search=True),
        None,
    ),
    ("fp8 e4m3 per-channel", dict(method="fp8"), None),
    ("fp8 e4m3 per-channel, scale search", dict(method="fp8", search=True), None),
    ("LLM.int8() (threshold 6)", dict(method="llm_int8"), None),
    ("LLM.int8() (thresholds for 1% outliers)", dict(method="llm_int8", outlier_share=0.01), None),
    ("int4 RTN g16", dict(method="rtn", bits=4, group_size=16), None),
    ("NVFP4 RTN", dict(method="rtn", format="nvfp4"), None),
    ("NVFP4 scale search", dict(method="rtn", format="nvfp4", search=True), None),
    ("MXFP4 RTN", dict(method="rtn", format="mxfp4"), None),
    ("MXFP4 scale search", dict(method="rtn", format="mxfp4", search=True), None),
    ("llama.cpp MXFP4", dict(llamacpp="MXFP4"), None),
    ("q4k RTN", dict(method="rtn", format="q4k"), None),
    ("q4k importance search", dict(method="rtn", format="q4k", search=True), None),
    (
        "q4k search + int8 v/down (mix)",
        dict(method="rtn", format="q4k", search=True, int8_linears=("v_proj", "down_proj")),
        None,
    ),
    ("llama.cpp Q4_K_M", dict(llamacpp="Q4_K_M"), None),
    ("llama.cpp Q4_0", dict(llamacpp="Q4_0"), None),
    ("llama.cpp IQ4_NL", dict(llamacpp="IQ4_NL"), None),
    ("int4 RTN g32 asym", dict(method="rtn", bits=4, group_size=32, symmetric=False), None),
    ("NVFP4 AWQ", dict(method="awq", format="nvfp4"), None),
    ("SmoothQuant W8A8 (alpha 0.5)", dict(method="smoothquant"), None),
    ("int4 RTN g128", dict(method="rtn", bits=4, group_size=128), None),
    ("int4 GPTQ g128", dict(method="gptq", bits=4, group_size=128), None),
    ("int4 AWQ g128", dict(method="awq", bits=4, group_size=128), None),
    ("int4 QAT g128", dict(method="qat", bits=4, group_size=128), None),
    ("int4 RTN g64", dict(method="rtn", bits=4, group_size=64), None),
    ("NF4 g64", dict(method="nf4", group_size=64), None),
    ("NF4 g64 + double quant", dict(method="nf4", group_size=64, double_quant=True), None),
    ("int3 GPTQ g128", dict(method="gptq", bits=3, group_size=128), None),
    ("int3 RTN g128", dict(method="rtn", bits=3, group_size=128), None),
    ("KV cache int8 (weights f32)", None, "int8"),
    ("KV cache fp8 (weights f32)", None, "fp8"),
]


def int8_activation_stats(
    cfg, params, tokenizer, seqs: int = 2, seq_len: int = 256, threshold: float = 6.0
) -> dict:
    """Why LLM.int8() costs what it does on this model: per linear kind, the share of
    activations above the threshold, the median ratio of a token's inlier absmax to its RMS,
    and the relative output error of weight-only int8 and of LLM.int8() (calibration text)."""
    import jax.numpy as jnp

    from jaxgen.model.quantize import (
        calibration_tokens,
        embed,
        kernel_path,
        layer_slice,
        run_layer,
    )
    from jaxgen.quant.apply import get_path
    from jaxgen.quant.formats import quantize_rtn
    from jaxgen.quant.matmul import matmul

    tokens = calibration_tokens(tokenizer, os.path.join(DATA, "valid.txt"), seqs, seq_len)
    x = embed(params, tokens)
    found: dict[str, list] = {}
    for layer in range(cfg.num_layers):
        x_next, inputs = run_layer(layer_slice(params, layer), x, cfg=cfg, capture=True)
        for name in ("q_proj", "o_proj", "gate_proj", "down_proj"):
            xin = inputs[name].reshape(-1, inputs[name].shape[-1])
            w = get_path(params, kernel_path(name))[layer]
            ref = xin @ w
            outlier = jnp.abs(xin) > threshold
            inlier_max = jnp.max(jnp.abs(jnp.where(outlier, 0, xin)), axis=-1)
            rms = jnp.sqrt(jnp.mean(xin**2, axis=-1))
            errors = [
                jnp.linalg.norm(
                    matmul(xin, quantize_rtn(w, "int8", act_quant=a, outlier_threshold=threshold))
                    - ref
                )
                / jnp.linalg.norm(ref)
                for a in (None, "llm_int8")
            ]
            found.setdefault(name, []).append(
                [float(jnp.mean(outlier)), float(jnp.median(inlier_max / rms))]
                + [float(e) for e in errors]
            )
        x = x_next
    keys = ("outlier_share", "absmax_over_rms", "weight_only_error", "llm_int8_error")
    return {n: dict(zip(keys, np.mean(v, axis=0).tolist(), strict=True)) for n, v in found.items()}


def _int8_stats_text(stats: dict) -> str:
    return "; ".join(
        f"{name}: {100 * s['outlier_share']:.3f} % of activations above 6, token absmax "
        f"{s['absmax_over_rms']:.1f}x its RMS, output error {100 * s['weight_only_error']:.2f} % "
        f"(int8 weights only) vs {100 * s['llm_int8_error']:.2f} % (LLM.int8())"
        for name, s in stats.items()
    )


# llama.cpp's quantizer as a peer of ours (the table's llama.cpp rows).
# Our row label -> (llama_ftype constant, pure): `pure` quantizes every tensor to the file type's
# base type (no per-tensor mixture); MXFP4 and NVFP4 file types are mixtures meant for MoE
# experts otherwise. (LLAMA_FTYPE_MOSTLY_NVFP4 exists in llama-cpp-python 0.3.36, but its
# llama_model_quantize answers "invalid output file type 39".)
QUANT_TYPES = {
    "Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", False),
    "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
    "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", False),
    "IQ4_NL": ("LLAMA_FTYPE_MOSTLY_IQ4_NL", False),
    "MXFP4": ("LLAMA_FTYPE_MOSTLY_MXFP4_MOE", True),
}


def quantize_gguf(source: str, destination: str, quant_type: str) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`) from a float GGUF file."""
    import llama_cpp

    const, pure = QUANT_TYPES[quant_type]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, const)
    params.nthread = os.cpu_count() or 1
    params.pure = pure
    rc = llama_cpp.llama_model_quantize(
        source.encode(), destination.encode(), llama_cpp.byref(params)
    )
    if rc != 0 or not os.path.isfile(destination):
        raise RuntimeError(f"llama_model_quantize({quant_type}) failed with code {rc}")


def linear_tensor_stats(path: str) -> dict:
    """Bits per weight of a GGUF file's linear layers (blk.*.attn_{q,k,v,output} and
    blk.*.ffn_*, block scales and mins included) and the count of each tensor type."""
    import gguf

    nbytes = elements = 0
    types: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and "norm" not in t.name:
            nbytes += int(t.n_bytes)
            elements += int(t.n_elements)
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"bits_per_weight": 8 * nbytes / elements, "linear_bytes": nbytes, "types": types}


def llamacpp_row(cfg, params, quant_type: str, workdir: str):
    """(params, report) of llama.cpp's quantizer: our float32 weights -> float32 GGUF ->
    `llama_model_quantize` -> our GGUF loader, with our float32 token embeddings."""
    from jaxgen.model import load_model
    from jaxgen.model.gguf_io import write_gguf
    from jaxgen.model.loading import default_gguf_path

    source = os.path.join(workdir, "f32.gguf")
    if not os.path.isfile(source):
        write_gguf(source, cfg, params, metadata_from=default_gguf_path())
    path = os.path.join(workdir, f"{quant_type}.gguf")
    quantize_gguf(source, path, quant_type)
    qcfg, qparams = load_model(path, show_progress=False)
    if qcfg != cfg:
        raise RuntimeError(f"{path}: config {qcfg} differs from the source model's {cfg}")
    qparams["embed"] = params["embed"]
    if "lm_head" in params:
        qparams["lm_head"] = params["lm_head"]
    stats = linear_tensor_stats(path)
    return qparams, {"gguf": path, **stats}


def llamacpp_tok_s(path: str, new_tokens: int = 32, repeats: int = 3) -> float:
    """llama.cpp's own decode tokens/s at batch 1 on the quantized file."""
    llm = llamacpp.load(path)
    step = llamacpp.decode_step_s(llm, [1] * 16, new_tokens, repeats)
    llm.close()
    return 1.0 / step


def linear_bits(params) -> float:
    """Stored bits per weight of the linear layers (32 for float32)."""
    from jaxgen.quant.apply import get_path, linear_paths, weight_bytes

    elements = sum(int(np.prod(get_path(params, p).shape)) for p in linear_paths(params))
    return 8 * weight_bytes(params)["linear_bytes"] / elements


def decode_tok_s(cfg, params, tokenizer, kv_quant, new_tokens=32, repeats=3) -> float:
    """Decode tokens/s at batch 1 through the engine (median of `repeats` runs)."""
    from jaxgen import LLM, SamplingParams

    llm = LLM.from_parts(
        cfg,
        params,
        tokenizer,
        max_model_len=512,
        max_num_seqs=1,
        kv_cache_dtype=kv_quant,
        warmup=False,
    )
    p = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    llm.generate([[1] * 16], p)  # compile
    rates = []
    for _ in range(repeats):
        out = llm.generate([[1] * 16], p)[0].metrics
        rates.append((new_tokens - 1) / (out.last_token_time - out.first_token_time))
    return float(np.median(rates))


def quantize_row(cfg, params, tokenizer, spec_kwargs, overrides=None, workdir=None, stats=None):
    """(params, report) of one row's method (spec_kwargs None: float32 as it is;
    {"llamacpp": type}: llama.cpp's quantizer, files under `workdir`). `stats`: a dict kept
    across rows, where the calibration importance of the first search=True row is reused."""
    from jaxgen.model.quantize import QuantSpec, quantize_model

    if spec_kwargs is None:
        return params, {}
    if "llamacpp" in spec_kwargs:
        return llamacpp_row(cfg, params, spec_kwargs["llamacpp"], workdir)
    spec = QuantSpec(**spec_kwargs, **(overrides or {}))
    stats = {} if stats is None else stats
    qparams, report = quantize_model(
        cfg,
        params,
        spec,
        tokenizer=tokenizer,
        calib_path=os.path.join(DATA, "valid.txt"),
        importance=stats.get("importance"),
    )
    if "importance" in report:
        stats["importance"] = report.pop("importance")
    return qparams, report


def measure_speeds(result: dict) -> dict:
    """Re-measures every row's decode speed in one pass with nothing else running.

    Speed depends only on the stored format, not on how the values were chosen, so this pass
    calibrates with a little text (2 x 64 tokens, 2 QAT steps); the perplexities stay those of
    the full run."""
    from jaxgen.model import load_model, load_tokenizer

    cfg, params = load_model(None)
    tokenizer = load_tokenizer(None)
    quick = dict(calib_seqs=4, calib_len=64, qat_steps=2)
    by_label = {label: (spec, kv) for label, spec, kv in ROWS}
    workdir, stats = tempfile.mkdtemp(prefix="jaxgen-quant-"), {}
    for row in result["rows"]:
        spec_kwargs, kv_quant = by_label[row["method"]]
        qparams, report = quantize_row(cfg, params, tokenizer, spec_kwargs, quick, workdir, stats)
        row["decode_tok_s"] = (
            llamacpp_tok_s(report["gguf"])
            if "gguf" in report
            else decode_tok_s(cfg, qparams, tokenizer, kv_quant)
        )
        print(f"{row['method']}: {row['decode_tok_s']:.1f} tok/s", file=sys.stderr)
        del qparams
        jax.clear_caches()
    result["speed_pass"] = harness.machine_info()["date"]
    return result


def run(tokens: int = 4096, quick: bool = False, out: str | None = None, only=None) -> dict:
    """Every row in turn; with `out`, the JSON so far is rewritten after each row (a process
    that dies in a late row keeps the earlier rows). `only`: labels of the rows to run (the
    float32 row, the base of every delta, always runs first)."""
    from jaxgen.engine.roofline import kv_bytes_per_token
    from jaxgen.entrypoints.perplexity import perplexity
    from jaxgen.model import load_model, load_tokenizer
    from jaxgen.model.tokenizer import read_text_tokens
    from jaxgen.quant.apply import weight_bytes

    cfg, params = load_model(None)
    tokenizer = load_tokenizer(None)
    rows = ROWS
    spec_overrides = {}
    if quick:
        tokens = 256
        rows = [
            r
            for r in ROWS
            if r[0]
            in (
                "float32",
                "int8 RTN per-channel",
                "int4 GPTQ g128",
                "int4 AWQ g128",
                "KV cache int8 (weights f32)",
            )
        ]
        spec_overrides = dict(calib_seqs=4, calib_len=64, qat_steps=2)
    if only:
        unknown = set(only) - {r[0] for r in ROWS}
        if unknown:
            raise ValueError(f"unknown rows {sorted(unknown)}; rows are: {[r[0] for r in ROWS]}")
        rows = [r for r in rows if r[0] == "float32" or r[0] in only]
    if not llamacpp.available():
        print("llama-cpp-python is not installed: no llama.cpp rows", file=sys.stderr)
        rows = [r for r in rows if not (r[1] or {}).get("llamacpp")]
    ids = read_text_tokens(tokenizer, os.path.join(DATA, "test.txt"), tokens)
    results = []
    base = None
    workdir, stats = tempfile.mkdtemp(prefix="jaxgen-quant-"), {}
    for label, spec_kwargs, kv_quant in rows:
        t0 = time.perf_counter()
        qparams, report = quantize_row(
            cfg, params, tokenizer, spec_kwargs, spec_overrides, workdir, stats
        )
        quantize_s = time.perf_counter() - t0
        ppl = perplexity(
            cfg,
            qparams,
            ids,
            max_length=min(1024, tokens),
            stride=min(512, tokens // 2),
            kv_quant=kv_quant,
        )["perplexity"]
        base = base or ppl
        sizes = weight_bytes(qparams)
        row = {
            "method": label,
            "perplexity": ppl,
            "delta_pct": 100 * (ppl / base - 1),
            "bits_per_weight": report.get("bits_per_weight") or linear_bits(qparams),
            "linear_mb": (report.get("linear_bytes") or sizes["linear_bytes"]) / 1e6,
            "total_mb": sizes["total_bytes"] / 1e6,
            "kv_bytes_per_token": kv_bytes_per_token(cfg, 1 if kv_quant else 4)
            + (2 * cfg.num_layers * cfg.num_kv_heads * 4 if kv_quant else 0),
            "decode_tok_s": (
                llamacpp_tok_s(report["gguf"])
                if "gguf" in report
                else decode_tok_s(cfg, qparams, tokenizer, kv_quant, new_tokens=8 if quick else 32)
            ),
            "quantize_s": quantize_s,
        }
        if "types" in report:
            row["gguf_types"] = report["types"]
            os.remove(report["gguf"])
        for key in ("alphas", "gptq_relative_error"):
            if report.get(key):
                row[f"mean_{key}"] = float(np.mean(report[key]))
        for key in ("qat_loss_first", "qat_loss_last"):
            if key in report:
                row[key] = report[key]
        results.append(row)
        print(f"{label}: ppl {ppl:.3f} ({row['delta_pct']:+.2f}%)", file=sys.stderr)
        if out:
            harness.dump_json({"tokens": len(ids) - 1, "rows": results, "partial": True}, out)
        del qparams
        jax.clear_caches()
    shutil.rmtree(workdir, ignore_errors=True)
    verdicts(results)
    grid = source_grid_share(params)
    if not quick:
        for row in results:
            if row["method"] == "LLM.int8() (threshold 6)":
                row["int8_activation_stats"] = int8_activation_stats(cfg, params, tokenizer)
    return {
        "machine": harness.machine_info(),
        "tokens": len(ids) - 1,
        "rows": results,
        "source_grid_share": grid,
    }


# The targets: a ΔPPL bound, or "beats" another row (lower perplexity).
# "matches": Δ no higher than another row's at no more bits per weight.
TARGETS = {
    "int8 RTN per-channel": [("delta", 1.0), ("matches", "llama.cpp Q8_0")],
    "int8 RTN g32, f16 scales": [("delta", 1.0), ("matches", "llama.cpp Q8_0")],
    "int8 g32, f16 scales, scale search": [("delta", 1.0), ("matches", "llama.cpp Q8_0")],
    "fp8 e4m3 per-channel": ("delta", 1.0),
    "fp8 e4m3 per-channel, scale search": ("delta", 1.0),
    "SmoothQuant W8A8 (alpha 0.5)": ("delta", 3.0),
    "LLM.int8() (threshold 6)": ("delta", 1.0),
    "LLM.int8() (thresholds for 1% outliers)": ("delta", 1.0),
    "NVFP4 RTN": ("beats", "int4 RTN g16"),
    "NVFP4 scale search": ("beats", "NVFP4 RTN"),
    "MXFP4 scale search": ("beats", "MXFP4 RTN"),
    "q4k importance search": [("beats", "q4k RTN"), ("matches", "llama.cpp Q4_K_M")],
    "q4k search + int8 v/down (mix)": ("matches", "llama.cpp Q4_K_M"),
    "int4 GPTQ g128": ("beats", "int4 RTN g128"),
    "int4 AWQ g128": ("beats", "int4 RTN g128"),
    "int4 QAT g128": ("beats", "int4 RTN g128"),
    "NF4 g64": ("beats", "int4 RTN g64"),
    "KV cache int8 (weights f32)": ("delta", 1.0),
}

# Why a target can be missed on a 135M model (printed only for the rows that miss).
WHY_MISSED = {
    "fp8 e4m3 per-channel": "fp8 e4m3 keeps 3 mantissa bits, so every weight is rounded with "
    "up to 6 % relative error, where per-channel int8 spends its 8 bits uniformly over a range "
    "that this model's rows fill well.",
    "LLM.int8() (threshold 6)": "LLM.int8() quantizes activations per token to int8 as well as "
    "weights. The 6.0 threshold was set for the emergent outliers of 6.7B+ models; here few "
    "activations exceed it, while each token's remaining absmax is many times its RMS, so the "
    "per-token int8 step is coarse for the typical activation (measured below).",
    "int8 RTN per-channel": "llama.cpp's Q8_0 keeps one scale per 32 weights (8.5 bits per "
    "weight); per-channel int8 keeps one per output channel (fewer bits, coarser scales).",
    "SmoothQuant W8A8 (alpha 0.5)": "W8A8 rounds activations per token as well as weights.",
    "int8 RTN g32, f16 scales": "the same layout and bits as Q8_0 (int8 codes, one f16 scale per "
    "32 weights); only the rounding of single codes differs (llama.cpp rounds against the "
    "unrounded scale, we against the stored f16 one), and equally valid roundings move the "
    "result by more than the gap (the weighted scale search: +0.09 pt).",
    "int8 g32, f16 scales, scale search": "minimising the calibration-weighted rounding error "
    "per group does not lower perplexity at 8 bits, where every rounding error is already small "
    "(compare the RTN row).",
}

NOTES = [
    "Bits/weight count every stored byte of the linear layers (codes, scales, mins, padding) "
    "over their weights, the same way for our rows and llama.cpp's (from the GGUF tensor "
    "sizes). Token embeddings, norms and the tied output head stay float32 in every row: the "
    "llama.cpp rows' dequantized embeddings are replaced by ours.",
    "llama.cpp rows: our float32 weights written as a float32 GGUF, quantized by "
    "llama.cpp's own llama_model_quantize (llama-cpp-python 0.3.36, no imatrix), loaded with "
    "our GGUF loader and run by our engine on the same tokens. Their decode tok/s is "
    "llama.cpp's own runtime on the quantized file (2 threads), not our engine's. llama.cpp's "
    "k-quants need rows divisible by 256; at hidden size 576 its Q4_K_M falls back to other "
    "types for those tensors (listed below), which is why it spends more than 4.5 bits. "
    "MXFP4 is written with `pure` (every linear MXFP4); llama.cpp's NVFP4 file type is not "
    "accepted by this build's quantizer.",
    "Scale search (fp8, NVFP4, MXFP4, q4k): per input channel, the mean squared calibration "
    "activation weighs each weight's rounding error (the diagonal of X^T X), and each block's "
    "scale (and min) minimises that weighted error instead of mapping the absmax.",
    "LLM.int8() decomposes per token at run time: each token's activations above the "
    "threshold (6.0, or each linear's calibrated threshold) go through the float path, the "
    "rest through int8 x int8. The calibrated row sets each linear's threshold to the 99th "
    "percentile of its input magnitudes over all layers on the calibration text, so 1 % of its "
    "calibration activations take the float path.",
    "int4 at group 128 is hard on a model this small; the papers' 7B+ models lose a few percent.",
    "QAT fine-tunes on the calibration text (wikitext-2 valid), the same domain as the "
    "evaluation text, so part of its gain over RTN is adaptation to wikitext, not only "
    "robustness to rounding.",
    "int3 codes are stored at 3 bits (bit planes, 8 rows per byte and plane); the bits/weight "
    "column adds their f32 scales and the padding of a ragged last group.",
    "Decode speed is this CPU's, where only W8A8 (SmoothQuant) has a native integer matmul: "
    "XLA:CPU converts the other formats' codes to f32 before each dot instead of fusing the "
    "dequantization, and emulates fp8 conversions in software. On this CPU they therefore "
    "save memory, not time; on a GPU the dequantization belongs inside the matmul kernel.",
]


def _verdict(row, kind, value, by_name) -> tuple[str, str] | None:
    if kind == "delta":
        met = row["delta_pct"] <= value
        return f"≤ {value:g} %", "met" if met else f"missed by {row['delta_pct'] - value:.2f} pt"
    if value not in by_name:
        return None
    other = by_name[value]
    if kind == "beats":
        margin = other["perplexity"] - row["perplexity"]
        return f"beats {value}", (
            f"met: {margin:.2f} lower" if margin > 0 else f"missed: {-margin:.2f} higher"
        )
    gap = row["delta_pct"] - other["delta_pct"]
    bits_ok = row["bits_per_weight"] <= other["bits_per_weight"]
    verdict = "met" if gap <= 0 and bits_ok else "missed"
    return f"Δ ≤ {value}'s at ≤ its bits", (
        f"{verdict}: Δ {gap:+.2f} pt, {row['bits_per_weight']:.3f} vs "
        f"{other['bits_per_weight']:.3f} bits"
    )


def verdicts(rows: list[dict]) -> None:
    """Adds "target" and "verdict" to each row that has a target."""
    by_name = {r["method"]: r for r in rows}
    for row in rows:
        targets = TARGETS.get(row["method"], [])
        found = [
            v
            for v in (
                _verdict(row, kind, value, by_name)
                for kind, value in (targets if isinstance(targets, list) else [targets])
            )
            if v
        ]
        if found:
            row["target"] = "; ".join(t for t, _ in found)
            row["verdict"] = "; ".join(v for _, v in found)


COLUMNS = [
    ("method", "method"),
    ("ppl", "perplexity"),
    ("delta", "Δ vs f32"),
    ("target", "target"),
    ("verdict", "verdict"),
    ("bits", "bits/weight (linears)"),
    ("linear_mb", "linear weights MB"),
    ("total_mb", "all weights MB"),
    ("kv_bytes_per_token", "KV bytes/token"),
    ("decode_tok_s", "decode tok/s (B=1)"),
]


def plot(result: dict, path: str) -> None:
    """Perplexity (log scale) against linear-layer size, one marker per method, legend aside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r["method"].startswith("KV")]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    markers = "osD^v<>pP*Xhd8H"
    for i, r in enumerate(rows):
        ax.scatter(
            r["linear_mb"],
            r["perplexity"],
            marker=markers[i % len(markers)],
            s=45,
            label=f"{r['method']} ({r['perplexity']:.2f})",
        )
    ax.set_yscale("log")
    ax.set_xlabel("linear-layer weight MB")
    ax.set_ylabel("perplexity, wikitext-2 test (log)")
    ax.set_title("SmolLM2-135M-Instruct: size against perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _gguf_total_mb(rows: list[dict]) -> None:
    """A llama.cpp row's weights are dequantized on load, so its "all weights" is the float32
    row's non-linear bytes plus the GGUF's linear bytes."""
    base = next((r for r in rows if r["method"] == "float32"), None)
    for row in rows:
        if base and "gguf_types" in row:
            row["total_mb"] = base["total_mb"] - base["linear_mb"] + row["linear_mb"]


def source_grid_share(params, block: int = 32) -> float:
    """Share of the linears' `block`-row groups (along the input, per output column) holding
    at most 16 distinct values: groups that a 4-bit affine format with blocks of 32 (Q4_1, int4
    g32 asym, q4k) stores exactly. The default model's float32 weights are its Q4_1 GGUF
    dequantized, so this share is what makes 4-bit rows aligned with that grid look lossless."""
    from jaxgen.quant.apply import get_path, linear_paths

    exact = total = 0
    for path in linear_paths(params):
        w = np.asarray(get_path(params, path))
        w = w.reshape(-1, *w.shape[-2:])
        rows = w.shape[1] // block * block
        g = np.sort(w[:, :rows].reshape(w.shape[0], -1, block, w.shape[2]), axis=2)
        distinct = 1 + (np.diff(g, axis=2) != 0).sum(axis=2)
        exact += int((distinct <= 16).sum())
        total += distinct.size
    return exact / total


def to_markdown(result: dict, image: str = "quantization") -> str:
    _gguf_total_mb(result["rows"])
    m = result["machine"]
    done = {r["method"] for r in result["rows"]}
    missing = [label for label, _, _ in ROWS if label not in done]
    return (
        f"## Quantization of the default model\n\n"
        f"SmolLM2-135M-Instruct (float32 from its Q4_1 GGUF). Perplexity over the first "
        f"{result['tokens'] + 1} tokens of wikitext-2 test (windows of 1024, stride 512, the "
        f"same tokens for every row); calibration on wikitext-2 valid (32 x 256 tokens). "
        f"Embeddings and norms stay float32 in every row (their bytes are in 'all weights'). "
        f"Decode tokens/s at batch 1 through the engine (median of 3 runs of 32 tokens) on "
        f"{m['cpu']} ({m['cores']} cores), {result.get('speed_pass', m['date'])}"
        + (
            " (a separate pass over all rows with nothing else running; speed depends only on "
            "the stored format)"
            if "speed_pass" in result
            else ""
        )
        + ".\n\n"
        + (
            f"**Caveat: the float32 baseline is itself a 4-bit model.** The default model's "
            f"weights come from a Q4_1 GGUF (4-bit codes, blocks of 32, scale and min): "
            f"{100 * result['source_grid_share']:.1f} % of the linears' 32-row groups hold at "
            f"most 16 distinct values, so a 4-bit affine format on the same blocks (q4k, int4 "
            f"g32 asym) stores them almost exactly, while formats on other grids (symmetric "
            f"int4, FP4, llama.cpp's Q4_K_M with its Q5_0 fallback) pay a second rounding. "
            f"4-bit rows compared here measure alignment with that grid as much as the "
            f"format; a fair 4-bit comparison needs full-precision weights.\n\n"
            if "source_grid_share" in result
            else ""
        )
        + (
            f"Partial run: it stopped before these rows: {', '.join(missing)}.\n\n"
            if result.get("partial") and missing
            else ""
        )
        + harness.markdown_table(
            [
                dict(
                    r,
                    ppl=f"{r['perplexity']:.3f}",
                    delta=f"{r['delta_pct']:+.2f} %",
                    bits=f"{r['bits_per_weight']:.2f}",
                )
                for r in result["rows"]
            ],
            COLUMNS,
        )
        + f"\n\n![size vs perplexity](img/{image}.png)\n\n"
        + "".join(
            f"- **{r['method']}** ({r['verdict']}): {WHY_MISSED[r['method']]}"
            + (
                f" Per linear (mean over layers, {_int8_stats_text(r['int8_activation_stats'])})."
                if "int8_activation_stats" in r
                else ""
            )
            + "\n"
            for r in result["rows"]
            if "missed" in r.get("verdict", "") and r["method"] in WHY_MISSED
        )
        + "\n"
        + "".join(f"- {note}\n" for note in NOTES)
        + "".join(
            f"- {r['method']} tensor types (linears): "
            + ", ".join(f"{t} x{n}" for t, n in sorted(r["gguf_types"].items()))
            + "\n"
            for r in result["rows"]
            if "gguf_types" in r
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quantization",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument(
        "--rows",
        default=None,
        help="';'-separated row labels to run (with float32 as the base); default: all",
    )
    p.add_argument(
        "--doc",
        default=DOC,
        help="with --write-docs: the Markdown file to write (its plot goes beside it in img/)",
    )
    p.add_argument(
        "--from-json", default=None, help="render a finished run's JSON (--out) instead of running"
    )
    p.add_argument(
        "--speeds",
        action="store_true",
        help="with --from-json: re-measure the decode speed column in one quiet pass",
    )
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        if result.get("partial"):  # a run stopped early: render the rows it finished
            result.setdefault("machine", harness.machine_info())
        if "source_grid_share" not in result:
            from jaxgen.model import load_model

            result["source_grid_share"] = source_grid_share(
                load_model(None, show_progress=False)[1]
            )
        for row in result["rows"]:
            if row["method"] == "LLM.int8() (threshold 6)" and "int8_activation_stats" not in row:
                from jaxgen.model import load_model, load_tokenizer

                cfg, params = load_model(None, show_progress=False)
                row["int8_activation_stats"] = int8_activation_stats(
                    cfg, params, load_tokenizer(None)
                )
        verdicts(result["rows"])
        if args.speeds:
            result = measure_speeds(result)
    else:
        only = [r.strip() for r in args.rows.split(";")] if args.rows else None
        result = run(args.tokens, args.quick, args.out, only)
    if args.out:
        harness.dump_json(result, args.out)
    name = os.path.splitext(os.path.basename(args.doc))[0]
    markdown = to_markdown(result, name)
    print(markdown)
    if args.write_docs:
        plot(result, os.path.join(os.path.dirname(args.doc), "img", name + ".png"))
        with open(args.doc, "w") as f:
            title = "# Quantization" + (": a subset of the rows (--rows)" if args.rows else "")
            f.write(harness.wrap_prose(title + "\n\n" + markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
