"""Quantizing a model end to end: calibration on real text, the algorithms of `quant/`, and
saving the result as a checkpoint `LLM(model=DIR)` loads.

Methods: rtn (any format of `quant.formats.FORMATS`, picked by `format` or `bits`), nf4, fp8,
smoothquant (W8A8), llm_int8, awq, gptq, qat. `search=True` gives the block formats (mxfp4,
nvfp4, q4k), fp8 and RTN's symmetric integer formats an importance-weighted scale search: per
input channel, the mean squared activation over the calibration tokens (the diagonal of X^T X)
weighs each weight's error.
Activations are captured with flax's method interception (`nn.intercept_methods` on every
`Linear`), so the model code is not changed for calibration.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.contiguous import StepMetadata
from jaxgen.model.decoder import DecoderLayer
from jaxgen.model.layers import Linear
from jaxgen.model.llama import Transformer
from jaxgen.quant import awq, gptq, qat, smoothquant
from jaxgen.quant.apply import get_path, linear_paths, map_linears, quantize_params, set_path
from jaxgen.quant.formats import (
    FIXED_GROUP,
    FORMATS,
    INTEGER_FORMATS,
    SCALE_DTYPES,
    QuantizationError,
    check_args,
    format_for_bits,
    from_codes,
    quantize_rtn,
)

log = logging.getLogger("jaxgen.quantize")

SEARCHED = ("mxfp4", "nvfp4", "q4k", "fp8", "int8", "int4", "int3", "int2")
# Fewer calibration tokens than this leave the statistics (X^T X, per-channel scales) too
# noisy to be worth the calibration: the run stops with a QuantizationError instead.
MIN_CALIB_TOKENS = 256
METHODS = ("rtn", "nf4", "fp8", "smoothquant", "llm_int8", "awq", "gptq", "qat")
ON_THE_FLY = {
    "int8": ("int8", None),
    "int4": ("int4", 128),
    "nf4": ("nf4", 64),
    "fp8": ("fp8", None),
}

# Linears that read the same input, and the parameter whose scaling scales that input
# (SmoothQuant / AWQ fold 1/s into it): the norms before attention and MLP, and up_proj's output
# columns before down_proj (act = silu(gate) * up is linear in up).
INPUT_GROUPS = (
    ("attn_norm", ("layers", "attn_norm", "scale"), ("q_proj", "k_proj", "v_proj")),
    ("mlp_norm", ("layers", "mlp_norm", "scale"), ("gate_proj", "up_proj")),
    ("act", ("layers", "mlp", "up_proj", "kernel"), ("down_proj",)),
)
LINEAR_PARENT = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def kernel_path(name):
    return ("layers", LINEAR_PARENT[name], name, "kernel")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    method: str = "rtn"
    bits: int | None = None
    group_size: int | None = None  # None: the method's default; -1: per channel
    symmetric: bool = True
    double_quant: bool = False  # nf4
    alpha: float = 0.5  # smoothquant migration strength
    act_order: bool = False  # gptq
    calib_seqs: int = 32
    calib_len: int = 256
    qat_steps: int = 60
    qat_lr: float = 2e-5
    format: str | None = None  # a name in quant.formats.FORMATS; overrides `bits`
    search: bool = False  # importance-weighted scale search (SEARCHED formats)
    # Linears (e.g. ("v_proj", "down_proj")) kept at int8 per channel in an rtn mixture, as
    # llama.cpp's _M presets spend more bits on the most sensitive tensors.
    int8_linears: tuple[str, ...] = ()
    # "float16": integer formats store their group scales in 16 bits (llama.cpp's Q8_0 is int8
    # at group 32 with f16 scales: 8.5 bits per weight). RTN-style methods only.
    scale_dtype: str = "float32"
    # llm_int8: activations above this magnitude take the float path (the paper's 6.0), or,
    # with `outlier_share`, a threshold per linear calibrated so that this share of its
    # calibration activations takes the float path (small models have no 6.0 outliers).
    outlier_threshold: float = 6.0
    outlier_share: float | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantizationError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.bits is not None and self.bits not in (2, 3, 4, 8):
            raise QuantizationError(f"bits must be 2, 3, 4 or 8, got {self.bits}")
        if self.format is not None and self.format not in FORMATS:
            raise QuantizationError(f"format must be one of {FORMATS}, got {self.format!r}")
        allowed = ("rtn", "awq", "gptq") if self.format in ("mxfp4", "q4k") else ("rtn", "awq")
        if self.format in FIXED_GROUP and self.method not in allowed:
            raise QuantizationError(
                f"{self.format} is applied by method {' or '.join(allowed)} (rtn optionally "
                f"with search=True), not {self.method!r}"
            )
        unknown = set(self.int8_linears) - set(LINEAR_PARENT)
        if unknown or (self.int8_linears and self.method != "rtn"):
            raise QuantizationError(
                f"int8_linears must name linears of {sorted(LINEAR_PARENT)} with method 'rtn'; "
                f"got {self.int8_linears} with {self.method!r}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantizationError(
                f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}"
            )
        if self.scale_dtype != "float32" and (
            self.fmt not in INTEGER_FORMATS or self.method in ("gptq", "nf4")
        ):
            raise QuantizationError(
                f"scale_dtype {self.scale_dtype!r} applies to integer formats "
                f"{INTEGER_FORMATS} quantized by rtn, awq, qat, smoothquant or llm_int8; got "
                f"method {self.method!r}, format {self.fmt!r}: keep scale_dtype='float32'"
            )
        if (self.outlier_threshold != 6.0 or self.outlier_share is not None) and (
            self.method != "llm_int8"
        ):
            raise QuantizationError(
                f"outlier_threshold / outlier_share apply to method 'llm_int8', not {self.method!r}"
            )
        if self.outlier_share is not None and not 0 < self.outlier_share < 0.5:
            raise QuantizationError(
                f"outlier_share is the share of activations on the float path, in (0, 0.5): "
                f"got {self.outlier_share} (e.g. 0.01)"
            )
        if not self.outlier_threshold > 0:
            raise QuantizationError(f"outlier_threshold must be > 0, got {self.outlier_threshold}")
        if self.search and self.fmt not in SEARCHED:
            raise QuantizationError(f"search=True applies to {SEARCHED}, not {self.fmt!r}")
        if self.search and self.fmt in INTEGER_FORMATS and self.method != "rtn":
            raise QuantizationError(
                f"search=True on integer formats is RTN's scale search, not {self.method!r}'s"
            )
        if self.search and self.fmt in INTEGER_FORMATS and not self.symmetric:
            raise QuantizationError("the integer scale search is symmetric: drop --asymmetric")

    @property
    def fmt(self) -> str:
        if self.format is not None:
            return self.format
        if self.method in ("nf4", "fp8"):
            return self.method
        if self.method in ("smoothquant", "llm_int8"):
            return "int8"
        default = 8 if self.method == "rtn" else 4
        return format_for_bits(self.bits or default)

    @property
    def group(self) -> int | None:
        if self.group_size == -1:
            return None
        if self.group_size is not None:
            return self.group_size
        if (
            self.method in ("smoothquant", "llm_int8", "fp8")
            or self.fmt in ("int8", "fp8")
            or self.fmt in FIXED_GROUP
        ):
            return None  # per channel
        return 64 if self.method == "nf4" else 128

    @property
    def needs_calibration(self) -> bool:
        return (
            self.search
            or self.outlier_share is not None
            or self.method in ("smoothquant", "awq", "gptq", "qat")
        )


def calibration_tokens(tokenizer, path: str, num_seqs: int, seq_len: int) -> np.ndarray:
    """[num_seqs, seq_len] consecutive token windows of a text file (no special tokens)."""
    from jaxgen.model.tokenizer import read_text_tokens

    if not os.path.isfile(path):
        raise QuantizationError(f"{path}: calibration file not found")
    if num_seqs * seq_len < MIN_CALIB_TOKENS:
        raise QuantizationError(
            f"calibration set of {num_seqs} x {seq_len} = {num_seqs * seq_len} tokens is too "
            f"small: use at least {MIN_CALIB_TOKENS} tokens (raise calib_seqs or calib_len)"
        )
    ids = read_text_tokens(tokenizer, path, num_seqs * seq_len)
    if len(ids) < num_seqs * seq_len:
        raise QuantizationError(
            f"{path}: {len(ids)} tokens, need {num_seqs * seq_len} ({num_seqs} x {seq_len})"
        )
    return np.asarray(ids, np.int32).reshape(num_seqs, seq_len)


# ------------------------------------------------------------------------------------------------
# Running the decoder one layer at a time, capturing linear inputs
# ------------------------------------------------------------------------------------------------
def _capture(next_fun, args, kwargs, context, store):
    if isinstance(context.module, Linear) and context.method_name == "__call__":
        store[context.module.path[-1]] = args[0]
    return next_fun(*args, **kwargs)


@functools.partial(jax.jit, static_argnames=("cfg", "capture"))
def run_layer(layer_params, x, *, cfg, capture: bool):
    """One decoder layer on hidden states x [B, T, D]; with `capture`, also the input of every
    linear (by name) -- through method interception, not model changes."""
    batch, num = x.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    md = StepMetadata(num_new=jnp.full((batch,), num, jnp.int32), fresh=True)
    store = {}
    interceptor = (
        functools.partial(_capture, store=store) if capture else (lambda f, a, k, c: f(*a, **k))
    )
    with nn.intercept_methods(interceptor):
        (y, _, _), _ = DecoderLayer(cfg).apply(
            {"params": layer_params}, (x, None, 0), positions, md
        )
    return y, dict(store)


def embed(params, tokens):
    return jnp.take(params["embed"], jnp.asarray(tokens), axis=0)


def layer_slice(params, layer):
    return jax.tree.map(lambda a: a[layer], params["layers"])


# ------------------------------------------------------------------------------------------------
# Methods
# ------------------------------------------------------------------------------------------------
def _fold(params, layer, group_name, scale_path, names, s):
    """W_i <- diag(s) W_i for the group's linears; the input's producer <- / s."""
    s = jnp.asarray(s, jnp.float32)
    for name in names:
        path = kernel_path(name)
        params = set_path(params, path, get_path(params, path).at[layer].multiply(s[:, None]))
    producer = get_path(params, scale_path)
    if group_name == "act":  # up_proj output columns (and its bias, if any)
        params = set_path(params, scale_path, producer.at[layer].divide(s[None, :]))
        bias_path = ("layers", "mlp", "up_proj", "bias")
        try:
            params = set_path(params, bias_path, get_path(params, bias_path).at[layer].divide(s))
        except KeyError:
            pass
    else:
        params = set_path(params, scale_path, producer.at[layer].divide(s))
    return params


def _layers(cfg, method: str, progress: bool):
    """The layer indices, under a progress bar (with tqdm's estimate) when asked."""
    if not progress:
        return range(cfg.num_layers)
    from tqdm import tqdm

    return tqdm(range(cfg.num_layers), desc=f"{method}: calibrating", unit="layer")


def _smooth_or_awq(cfg, params, tokens, spec: QuantSpec, method: str, report: dict, progress=False):
    x = embed(params, tokens)
    report["alphas"] = []
    for layer in _layers(cfg, method, progress):
        lp = layer_slice(params, layer)
        _, inputs = run_layer(lp, x, cfg=cfg, capture=True)
        inputs_of = {
            "attn_norm": inputs["q_proj"],
            "mlp_norm": inputs["gate_proj"],
            "act": inputs["down_proj"],
        }
        for group_name, scale_path, names in INPUT_GROUPS:
            xin = np.asarray(inputs_of[group_name]).reshape(-1, inputs_of[group_name].shape[-1])
            weights = [np.asarray(get_path(params, kernel_path(n))[layer]) for n in names]
            if method == "smoothquant":
                s = smoothquant.smooth_scales(np.abs(xin).max(axis=0), weights, spec.alpha)
            else:
                pick = np.random.RandomState(layer).choice(
                    len(xin), min(1024, len(xin)), replace=False
                )
                sample = xin[pick]
                s, alpha, _ = awq.awq_scales(sample, weights, spec.fmt, spec.group)
                report["alphas"].append(alpha)
            params = _fold(params, layer, group_name, scale_path, names, s)
        # Scaling leaves the float function unchanged: the next layer sees the same input.
        x, _ = run_layer(layer_slice(params, layer), x, cfg=cfg, capture=False)
    return params


def _gptq(cfg, params, tokens, spec: QuantSpec, report: dict, progress=False):
    x = embed(params, tokens)
    names = [p[2] for p in linear_paths(params)]
    quantized = {n: [] for n in names}
    report["gptq_relative_error"] = []
    for layer in _layers(cfg, "gptq", progress):
        lp = layer_slice(params, layer)
        _, inputs = run_layer(lp, x, cfg=cfg, capture=True)
        qlayer = lp
        for name in names:
            xin = np.asarray(inputs[name]).reshape(-1, inputs[name].shape[-1])
            h = gptq.Hessian(xin.shape[1])
            h.add(xin)
            w = np.asarray(get_path(lp, kernel_path(name)[1:]))
            if spec.fmt in FIXED_GROUP:
                qa = gptq.gptq_block_format(w, h.h, spec.fmt)
            else:
                codes, scales, zeros, group = gptq.gptq(
                    w,
                    h.h,
                    spec.fmt,
                    spec.group,
                    symmetric=spec.symmetric,
                    act_order=spec.act_order,
                )
                qa = from_codes(codes, scales, zeros, spec.fmt, group, w.shape[0])
            quantized[name].append(qa)
            qlayer = set_path(qlayer, kernel_path(name)[1:], qa)
            ref = xin[:512] @ w
            report["gptq_relative_error"].append(
                float(
                    np.linalg.norm(ref - xin[:512] @ np.asarray(qa.dequantize()))
                    / np.linalg.norm(ref)
                )
            )
        # GPTQ is sequential: the next layer is calibrated on this layer's quantized outputs.
        x, _ = run_layer(qlayer, x, cfg=cfg, capture=False)
    for name in names:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *quantized[name])
        params = set_path(params, kernel_path(name), stacked)
    return params


def _linear_inputs(cfg, params, tokens, what: str, progress=False):
    """Yields, layer by layer, {linear name: its input activations} of the float model on the
    calibration tokens."""
    x = embed(params, tokens)
    for layer in _layers(cfg, what, progress):
        x, inputs = run_layer(layer_slice(params, layer), x, cfg=cfg, capture=True)
        yield inputs


def _importance(cfg, params, tokens, progress=False) -> dict:
    """{linear name: f32 [layers, in]}: mean squared input activation per input channel over
    the calibration tokens (the float model's own activations, layer by layer)."""
    found = {}
    for inputs in _linear_inputs(cfg, params, tokens, "importance", progress):
        for name, xin in inputs.items():
            found.setdefault(name, []).append(jnp.mean(jnp.square(xin), axis=(0, 1)))
    return {name: jnp.stack(v) for name, v in found.items()}


def _outlier_thresholds(
    cfg, params, tokens, share: float, progress=False, per_layer: int = 1 << 18
) -> dict:
    """{linear name: threshold}: the (1 - share) quantile of the linear's input magnitudes
    over every layer's calibration activations (the float model's own, layer by layer), so
    that `share` of them exceed it (a layer with larger activations sends more of its entries
    to the float path, as the paper's fixed threshold does). The quantile is taken over an
    evenly strided sample of `per_layer` magnitudes per layer."""
    found: dict[str, list] = {}
    for inputs in _linear_inputs(cfg, params, tokens, "outlier thresholds", progress):
        for name, xin in inputs.items():
            flat = np.abs(np.asarray(xin, np.float32)).reshape(-1)
            found.setdefault(name, []).append(flat[:: max(1, flat.size // per_layer)])
    return {name: float(np.quantile(np.concatenate(v), 1 - share)) for name, v in found.items()}


def _qat(cfg, params, tokens, spec: QuantSpec, report: dict):
    model = Transformer(cfg)

    def loss_fn(p, batch):
        logits, _ = model.apply({"params": p}, batch)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))

    batches = [jnp.asarray(tokens[i : i + 4]) for i in range(0, len(tokens), 4)]
    trained, losses = qat.train(
        params,
        loss_fn,
        batches,
        spec.fmt,
        spec.group,
        learning_rate=spec.qat_lr,
        steps=spec.qat_steps,
    )
    report["qat_loss_first"], report["qat_loss_last"] = losses[0], losses[-1]
    return trained


def quantize_model(
    cfg,
    params,
    spec: QuantSpec,
    *,
    tokenizer=None,
    calib_path=None,
    progress: bool = False,
    importance: dict | None = None,
):
    """Quantizes every linear of `params` with `spec`; returns (params, report). `progress`:
    a progress bar over the layers of calibrated methods. `importance`: the report's
    "importance" of an earlier search=True run on the same params and calibration spec, to
    reuse instead of recomputing."""
    report = {"method": spec.method, "format": spec.fmt, "group_size": spec.group}
    for path in linear_paths(params):  # fail fast on group sizes no layer can use
        check_args(spec.fmt, spec.group, get_path(params, path).shape[-2])
    if spec.needs_calibration:
        if calib_path is None:
            raise QuantizationError(f"{spec.method} needs calibration text: pass --calib FILE")
        tokens = calibration_tokens(tokenizer, calib_path, spec.calib_seqs, spec.calib_len)
    if spec.method in ("smoothquant", "awq"):
        params = _smooth_or_awq(cfg, params, tokens, spec, spec.method, report, progress)
    elif spec.method == "gptq":
        return _gptq(cfg, params, tokens, spec, report, progress), report
    elif spec.method == "qat":
        params = _qat(cfg, params, tokens, spec, report)
    act = {"smoothquant": "int8", "llm_int8": "llm_int8"}.get(spec.method)
    kwargs = dict(symmetric=spec.symmetric, act_quant=act, scale_dtype=spec.scale_dtype)
    thresholds = {}
    if spec.method == "llm_int8" and spec.outlier_share is not None:
        thresholds = _outlier_thresholds(cfg, params, tokens, spec.outlier_share, progress)
        report["outlier_thresholds"] = thresholds
    elif spec.method == "llm_int8":
        kwargs["outlier_threshold"] = spec.outlier_threshold
    if spec.method == "nf4":
        kwargs["double_quant"] = spec.double_quant
    if spec.search:
        importance = importance or _importance(cfg, params, tokens, progress)
        report["importance"] = importance
    else:
        importance = {}

    def quantize(path, w):  # importance [layers, in] goes with the stacked kernel
        if path[2] in spec.int8_linears:
            return quantize_rtn(w, "int8", None)
        extra = {"outlier_threshold": thresholds[path[2]]} if path[2] in thresholds else {}
        return quantize_rtn(
            w, spec.fmt, spec.group, importance=importance.get(path[2]), **kwargs, **extra
        )

    return map_linears(params, quantize), report


def on_the_fly(params, name: str, group_size: int | None = None):
    """`LLM(quantization=...)`: RTN, per-channel for 8-bit, group 128 (nf4: 64) for 4-bit."""
    if name not in ON_THE_FLY:
        raise QuantizationError(f"quantization must be one of {sorted(ON_THE_FLY)}, got {name!r}")
    fmt, group = ON_THE_FLY[name]
    return quantize_params(params, fmt, group_size if group_size is not None else group)
