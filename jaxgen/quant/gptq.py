"""GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), Algorithm 1, for one linear layer.

Given calibration inputs X (tokens x in) and H = 2 X^T X, the input rows of W are quantized one
at a time; each row's rounding error, scaled by the inverse Hessian (through the upper Cholesky
factor of H^-1), is fed back into the rows not yet quantized. Updates are applied lazily in
blocks of `block_size` rows (§4 "Lazy Batch-Updates"); `act_order` processes rows in order of
decreasing H diagonal, with group scales fixed beforehand from the unpermuted weight ("static
groups") so groups stay contiguous.

Our weights are W [in, out] (input rows); the paper's columns are our rows.
"""

from __future__ import annotations

import numpy as np

from jaxgen.quant.formats import BITS, check_args


class Hessian:
    """Running H = 2/n X^T X over calibration batches."""

    def __init__(self, in_features: int):
        self.h = np.zeros((in_features, in_features), np.float64)
        self.n = 0

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64).reshape(-1, self.h.shape[0])
        total = self.n + x.shape[0]
        self.h *= self.n / total
        self.h += (2.0 / total) * (x.T @ x)
        self.n = total


def _group_params(w_group, bits, symmetric):
    """scale, zero per output channel for rows w_group [g, out]."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = np.abs(w_group).max(axis=0) / qmax
        return np.where(scale == 0, 1.0, scale), None
    levels = 2**bits - 1
    lo, hi = np.minimum(w_group.min(axis=0), 0), np.maximum(w_group.max(axis=0), 0)
    scale = (hi - lo) / levels
    scale = np.where(scale == 0, 1.0, scale)
    return scale, np.round(-lo / scale)


def _quantize_row(w, scale, zero, bits):
    if zero is None:
        qmax = 2 ** (bits - 1) - 1
        q = np.clip(np.round(w / scale), -qmax - 1, qmax)
        return q, q * scale
    levels = 2**bits - 1
    q = np.clip(np.round(w / scale) + zero, 0, levels)
    return q, (q - zero) * scale


def _prepare(w, hessian):
    """(W f64 copy, H f64 copy) with dead inputs (H_ii = 0) zeroed in W and given H_ii = 1."""
    w = np.array(w, np.float64)
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    return w, h


def _damped_inverse_factor(h, percdamp):
    """Upper Cholesky factor of (H + percdamp * mean(diag H) I)^-1 (the paper's "Cholesky
    reformulation"); damps `h` in place."""
    h[np.diag_indices(h.shape[0])] += percdamp * np.mean(np.diag(h))
    return np.linalg.cholesky(np.linalg.inv(h)).T


def gptq(
    w: np.ndarray,
    hessian: np.ndarray,
    fmt: str = "int4",
    group_size: int | None = 128,
    *,
    symmetric: bool = True,
    block_size: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
):
    """Quantizes W [in, out] with GPTQ.

    Returns:
      (codes int8 [in_padded, out] (signed, as `quant.formats` stores them), scales
       [groups, out], zeros [groups, out] or None, group size) -- ready for `from_codes`.
    """
    if fmt not in ("int8", "int4", "int3", "int2"):
        raise ValueError(f"GPTQ quantizes to integer formats (int8/4/3/2), not {fmt!r}")
    bits = BITS[fmt]
    w, h = _prepare(w, hessian)
    rows, out = w.shape
    group = check_args(fmt, group_size, rows)
    groups = -(-rows // group)
    scales = np.zeros((groups, out))
    zeros = None if symmetric else np.zeros((groups, out))
    if act_order:  # static groups: every group's scale from the original weight
        for g in range(groups):
            s, z = _group_params(w[g * group : (g + 1) * group], bits, symmetric)
            scales[g] = s
            if zeros is not None:
                zeros[g] = z
        perm = np.argsort(-np.diag(h), kind="stable")
    else:
        perm = np.arange(rows)
    w, h = w[perm], h[perm][:, perm]
    hinv = _damped_inverse_factor(h, percdamp)
    codes = np.zeros((rows, out))
    for i1 in range(0, rows, block_size):
        i2 = min(i1 + block_size, rows)
        w1 = w[i1:i2].copy()
        err1 = np.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = perm[i1 + i]  # original row index
            g = row // group
            if not act_order and row % group == 0:
                # The group's scale from the current (error-updated) weights, as in Alg. 1.
                current = np.concatenate([w1[i : i + group], w[i2 : max(i2, i1 + i + group)]])
                s, z = _group_params(current, bits, symmetric)
                scales[g] = s
                if zeros is not None:
                    zeros[g] = z
            q, deq = _quantize_row(w1[i], scales[g], None if zeros is None else zeros[g], bits)
            codes[row] = q
            err = (w1[i] - deq) / hinv1[i, i]
            w1[i:] -= np.outer(hinv1[i, i:], err)
            err1[i] = err
        w[i2:] -= hinv[i1:i2, i2:].T @ err1
    # Store like quant.formats: signed codes, padded rows for a ragged last group.
    if zeros is not None:
        codes = codes - 2 ** (bits - 1)
        zeros = zeros - 2 ** (bits - 1)
    pad = groups * group - rows
    if pad:
        codes = np.concatenate([codes, np.zeros((pad, out))])
    return (
        codes.astype(np.int8),
        scales.astype(np.float32),
        (None if zeros is None else zeros.astype(np.float32)),
        group,
    )


def gptq_block_format(
    w: np.ndarray,
    hessian: np.ndarray,
    fmt: str,
    *,
    block_size: int = 128,
    percdamp: float = 0.01,
):
    """GPTQ's error feedback with a block-scaled 4-bit format (mxfp4, q4k) as the quantizer.

    The format's own RTN (`quantize_rtn`, importance-weighted by diag(H)) fixes the scales of
    each parameter block (32 rows for mxfp4, a 256-row super-block for q4k) from the current,
    error-updated rows when GPTQ reaches it, as Algorithm 1 does for group scales; each row is
    then rounded to the nearest code under those scales and its error fed forward.

    Returns a QArray [in, out] of `fmt`.
    """
    import jax.numpy as jnp

    from jaxgen.quant.formats import QArray, pack_4bit, quantize_rtn
    from jaxgen.quant.lowbit import E2M1_CODE

    if fmt not in ("mxfp4", "q4k"):
        raise ValueError(f"gptq_block_format quantizes to mxfp4 or q4k, not {fmt!r}")
    w, h = _prepare(w, hessian)
    rows, out = w.shape
    check_args(fmt, None, rows)
    fit = 256 if fmt == "q4k" else 32
    importance = np.diag(h).astype(np.float32)
    hinv = _damped_inverse_factor(h, percdamp)
    codes = np.zeros((rows, out), np.uint8)
    parts, scale, offset = [], None, None
    grid = E2M1_CODE if fmt == "mxfp4" else np.arange(16, dtype=np.float32)  # value of code c
    for i1 in range(0, rows, block_size):
        i2 = min(i1 + block_size, rows)
        w1 = w[i1:i2].copy()
        err1 = np.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row = i1 + i
            if row % fit == 0:
                n = min(fit, rows - row)
                current = np.concatenate([w1[i : i + n], w[i2 : max(i2, row + n)]])
                qa = quantize_rtn(current, fmt, importance=importance[row : row + n])
                parts.append(qa)
                scale = np.repeat(np.asarray(qa.float_scales()), qa.group_size, axis=0)
                off = qa.float_offsets()
                offset = 0.0 if off is None else np.repeat(np.asarray(off), qa.group_size, 0)
            k = row % fit
            s = np.where(scale[k] > 0, scale[k], 1.0)
            o = offset if np.isscalar(offset) else offset[k]
            idx = np.abs((w1[i] + o) / s - grid[:, None]).argmin(axis=0)
            codes[row] = idx
            deq = grid[idx] * scale[k] - o
            err = (w1[i] - deq) / hinv1[i, i]
            w1[i:] -= np.outer(hinv1[i, i:], err)
            err1[i] = err
        w[i2:] -= hinv[i1:i2, i2:].T @ err1
    # The parameter blocks' scales with GPTQ's codes, joined along the rows (every field's
    # axis -2 counts row groups, sub-block pairs or super-blocks).
    merged = {"values": pack_4bit(jnp.asarray(codes))}
    for field in ("scales", "zeros", "scale_scales"):
        arrays = [getattr(p, field) for p in parts]
        merged[field] = None if arrays[0] is None else jnp.concatenate(arrays, axis=-2)
    return QArray(**merged, fmt=fmt, group_size=parts[0].group_size, rows=rows)
