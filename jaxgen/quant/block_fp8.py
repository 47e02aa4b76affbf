"""Block-scaled FP8 weights as DeepSeek-V3 ships them: each linear's weight W [out, in] is stored
as float8_e4m3fn values q with one f32 scale per 128 x 128 block, `weight_scale_inv`
[ceil(out / 128), ceil(in / 128)], and W = q * scale_inv[i // 128, j // 128]
(config.json: quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}).

Two ways in:
  `dequantize_block_fp8`  the full-precision weight (the CPU path: f32 / bf16 params).
  `block_fp8_qarray`      the FP8 values kept, with their scales, as a `quant.QArray` ("fp8"
                          format, groups of block_in input rows, each block's scale repeated over
                          its block_out output columns), so `quant.matmul` multiplies them
                          without a full-precision copy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxgen.quant.formats import QArray

FP8_MAX = 448.0  # largest float8_e4m3fn value
DEFAULT_BLOCK = (128, 128)


def block_size(config: dict) -> tuple[int, int] | None:
    """(block_out, block_in) from a config.json's quantization_config, or None when the
    checkpoint is not block-scaled FP8. Other quantization methods are typed errors."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"quantization_config {qc!r}: only block-scaled e4m3 FP8 checkpoints (DeepSeek-V3's "
            "quant_method 'fp8') load"
        )
    block = tuple(qc.get("weight_block_size") or DEFAULT_BLOCK)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"weight_block_size must be [out, in] block sides, got {block}")
    return block


def _check(values, scale_inv, block):
    out, inp = values.shape[-2:]
    want = (-(-out // block[0]), -(-inp // block[1]))
    if values.dtype != np.dtype(jnp.float8_e4m3fn) or tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(
            f"block FP8 needs float8_e4m3fn values and scales of {want} blocks for {block}: "
            f"{values.dtype=} {values.shape=} {scale_inv.shape=}"
        )


def dequantize_block_fp8(values, scale_inv, block=DEFAULT_BLOCK) -> np.ndarray:
    """W [..., out, in] f32 from FP8 values [..., out, in] and scales [..., out/bo, in/bi]."""
    values, scale_inv = np.asarray(values), np.asarray(scale_inv, np.float32)
    _check(values, scale_inv, block)
    out, inp = values.shape[-2:]
    scales = np.repeat(np.repeat(scale_inv, block[0], axis=-2), block[1], axis=-1)
    return values.astype(np.float32) * scales[..., :out, :inp]


def quantize_block_fp8(w, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(values float8_e4m3fn [..., out, in], scale_inv f32 [..., out/bo, in/bi]) of W [..., out,
    in]: each block scaled so its absmax is FP8's largest value (DeepSeek-V3's recipe)."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape[-2:]
    bo, bi = block
    po, pi = -out % bo, -inp % bi
    padded = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, po), (0, pi)])
    lead = padded.shape[:-2]
    blocks = padded.reshape(*lead, (out + po) // bo, bo, (inp + pi) // bi, bi)
    scale = np.abs(blocks).max(axis=(-3, -1)) / FP8_MAX
    safe = np.where(scale == 0, 1.0, scale)
    q = (blocks / safe[..., :, None, :, None]).reshape(padded.shape)[..., :out, :inp]
    return q.astype(jnp.float8_e4m3fn), scale.astype(np.float32)


def block_fp8_qarray(values, scale_inv, block=DEFAULT_BLOCK) -> QArray:
    """A `QArray` holding W^T [..., in, out] as the FP8 values themselves, groups of block_in
    input rows; each (row group, output column) scale is its block's scale_inv."""
    values, scale_inv = np.asarray(values), np.asarray(scale_inv, np.float32)
    _check(values, scale_inv, block)
    out, inp = values.shape[-2:]
    bo, bi = block
    pad = -inp % bi
    codes = np.swapaxes(values, -1, -2)  # [..., in, out]
    if pad:  # zero rows: zero weight whatever the scale
        zero = np.zeros((*codes.shape[:-2], pad, out), codes.dtype)
        codes = np.concatenate([codes, zero], axis=-2)
    scales = np.repeat(np.swapaxes(scale_inv, -1, -2), bo, axis=-1)[..., :out]
    return QArray(
        values=jnp.asarray(codes),
        scales=jnp.asarray(scales),
        fmt="fp8",
        group_size=bi,
        rows=inp,
    )
