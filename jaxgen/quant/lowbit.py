"""Block-scaled 4-bit formats: FP4 e2m1 (MXFP4, NVFP4) and a k-quant-style int4 ("q4k").

All three quantize W [..., in, out] along `in` in blocks and store two 4-bit codes per byte
(`formats.pack_4bit`). What differs is the block scaling:

  mxfp4  OCP Microscaling v1.0: blocks of 32, one e8m0 scale per block (a power of two, stored
         as its biased exponent in a uint8); element = e2m1 code x 2^(e - 127).
  nvfp4  NVIDIA's NVFP4: blocks of 16, one float8 e4m3 scale per block times one f32 scale per
         tensor (per stacked layer here), chosen so the largest block scale maps to e4m3's 448.
  q4k    asymmetric 4-bit codes in sub-blocks of 32 (w = s_j q - m_j), the sub-block scales s_j
         and mins m_j quantized to 6 bits against a per-super-block (256 rows) f16 scale d and
         min scale dmin: s_j = d * sc_j, m_j = dmin * mc_j. 4.5 bits per weight at in % 256 = 0.
         The 6-bit pairs are stored in 12 bits: `scales` holds sc | (mc & 3) << 6 and `zeros`
         the high nibbles mc >> 2, two sub-blocks per byte.

Scale search (`importance` given: a per-input-channel weight, e.g. mean x^2 over calibration
tokens, the diagonal of the layer Hessian X^T X): every block's scale (and min) is chosen to
minimise sum_i importance_i (w_i - deq(q(w))_i)^2 instead of mapping the absmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# e2m1 magnitudes (OCP MX v1.0 §5.3.3); a code is sign << 3 | index.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_CODE = np.concatenate([E2M1, -E2M1])
_E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
FP4_MAX = 6.0
E4M3_MAX = 448.0
SUPER_BLOCK = 256
SUB_BLOCK = 32


def fp4_encode(v: jax.Array) -> jax.Array:
    """Nearest e2m1 code (uint8 0..15) of v (already divided by its scale; |v| > 6 saturates)."""
    idx = jnp.searchsorted(jnp.asarray(_E2M1_MIDPOINTS), jnp.abs(v)).astype(jnp.uint8)
    return jnp.where(v < 0, idx | 8, idx)


def fp4_round(v: jax.Array) -> jax.Array:
    return jnp.asarray(E2M1_CODE)[fp4_encode(v).astype(jnp.int32)]


def _weighted_error(g, deq, importance):
    """[..., G, out]: importance-weighted squared error of each block."""
    err = (g - deq) ** 2
    if importance is not None:
        err = err * importance[..., :, :, None]
    return jnp.sum(err, axis=-2)


def importance_blocks(importance, rows_padded, block):
    """[in] -> [G, block] (padded rows get weight 0)."""
    if importance is None:
        return None
    imp = jnp.asarray(importance, jnp.float32)
    imp = jnp.pad(imp, [(0, 0)] * (imp.ndim - 1) + [(0, rows_padded - imp.shape[-1])])
    return imp.reshape(*imp.shape[:-1], rows_padded // block, block)


def _pick_best(best, cand, err):
    """Keeps, per block, the candidate with the lower error: best is (value, err) or None."""
    if best is None:
        return cand, err
    better = err < best[1]
    return jnp.where(better, cand, best[0]), jnp.where(better, err, best[1])


# ------------------------------------------------------------------------------------------------
# fp8 e4m3 scale search
# ------------------------------------------------------------------------------------------------
def fp8_search(g, importance, steps: int = 16):
    """Per-group scale [..., G, out] for fp8 e4m3 minimising the importance-weighted error.

    e4m3's grid is relative (3 mantissa bits), so scaling a channel by a factor in [1, 2) moves
    every weight to a different place between grid points; absmax / 448 is one of `steps`
    factors 2^(k / steps) tried (no factor saturates: all are >= 1)."""
    base = jnp.max(jnp.abs(g), axis=-2) / E4M3_MAX
    base = jnp.where(base > 0, base, 1.0)
    best = None
    for k in range(steps):
        s = base * 2.0 ** (k / steps)
        deq = (g / s[..., None, :]).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s[..., None, :]
        best = _pick_best(best, s, _weighted_error(g, deq, importance))
    return best[0]


def int_search(g, importance, qmax: int, scale_dtype=jnp.float32, steps: int = 8):
    """Per-group scale [..., G, out] for symmetric integer codes in [-qmax - 1, qmax] minimising
    the importance-weighted error: absmax / qmax times factors 1 - k / (4 qmax) for k < steps
    (each clips the group's largest weights a little more, for a finer step on the rest) and
    1 + k / (4 qmax) (the grid shifted, no clipping). Scales are rounded to `scale_dtype` before
    the codes are chosen, as they will be stored."""
    base = jnp.max(jnp.abs(g), axis=-2) / qmax
    base = jnp.where(base > 0, base, 1.0)
    best = None
    for k in range(-steps // 2, steps):
        s = (base * (1 - k / (4 * qmax))).astype(scale_dtype).astype(jnp.float32)
        deq = jnp.clip(jnp.round(g / s[..., None, :]), -qmax - 1, qmax) * s[..., None, :]
        best = _pick_best(best, s, _weighted_error(g, deq, importance))
    return best[0]


# ------------------------------------------------------------------------------------------------
# MXFP4
# ------------------------------------------------------------------------------------------------
def mxfp4_quantize(g, importance=None):
    """g [..., G, 32, out] -> (codes uint8 [..., G, 32, out], biased exponents uint8 [..., G, out]).

    RTN: the OCP rule, 2^(floor(log2 absmax) - 2) (e2m1's largest exponent is 2; values in
    (6, 8) x scale saturate to 6). With `importance`, each block also tries the next power of
    two (no saturation) and keeps the one with the lower weighted error."""
    amax = jnp.max(jnp.abs(g), axis=-2)
    e = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2
    if importance is not None:
        best = None
        for cand in (e, e + 1):
            deq = fp4_round(g / jnp.exp2(cand)[..., None, :]) * jnp.exp2(cand)[..., None, :]
            best = _pick_best(best, cand, _weighted_error(g, deq, importance))
        e = best[0]
    e = jnp.clip(e, -127, 127)
    codes = fp4_encode(g / jnp.exp2(e)[..., None, :])
    return codes, (e + 127).astype(jnp.uint8)


def mxfp4_scales(exponents):
    return jnp.exp2(exponents.astype(jnp.float32) - 127)


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------
def nvfp4_quantize(g, importance=None, grid=(1.0, 0.95, 0.9, 0.85, 0.8, 1.05, 1.1)):
    """g [..., G, 16, out] -> (codes, e4m3 block scales [..., G, out], f32 tensor scale [...]).

    RTN: block scale = absmax / 6 in units of the tensor scale absmax_tensor / (6 * 448). With
    `importance`, each block's scale is searched over `grid` x that value (rounded to e4m3)."""
    lead = g.shape[:-3]
    tensor_amax = jnp.max(jnp.abs(g).reshape(*lead, -1), axis=-1)
    tensor_scale = jnp.where(tensor_amax > 0, tensor_amax / (FP4_MAX * E4M3_MAX), 1.0)
    ts = tensor_scale[..., None, None]
    amax = jnp.max(jnp.abs(g), axis=-2)
    factors = grid if importance is not None else grid[:1]
    best = None
    for f in factors:
        s8 = jnp.clip(amax * f / FP4_MAX / ts, 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
        s = s8.astype(jnp.float32) * ts
        safe = jnp.where(s > 0, s, 1.0)[..., None, :]
        deq = fp4_round(g / safe) * safe
        best = _pick_best(best, s8, _weighted_error(g, deq, importance))
    s8 = best[0]
    s = s8.astype(jnp.float32) * ts
    codes = fp4_encode(g / jnp.where(s > 0, s, 1.0)[..., None, :])
    return codes, s8, tensor_scale.astype(jnp.float32)


# ------------------------------------------------------------------------------------------------
# k-quant-style int4
# ------------------------------------------------------------------------------------------------
def _fit_affine(x, q, wt):
    """Weighted least squares x ~ s q - m over axis -2 with m >= 0 (the min is an offset below
    zero); returns (s, m) [..., out]."""
    sw = jnp.sum(wt, axis=-2)
    sq = jnp.sum(wt * q, axis=-2)
    sx = jnp.sum(wt * x, axis=-2)
    sqq = jnp.sum(wt * q * q, axis=-2)
    sqx = jnp.sum(wt * q * x, axis=-2)
    det = sw * sqq - sq * sq
    s = jnp.where(det > 0, (sw * sqx - sq * sx) / jnp.where(det > 0, det, 1.0), 0.0)
    b = jnp.where(sw > 0, (sx - s * sq) / jnp.where(sw > 0, sw, 1.0), 0.0)
    # A positive offset is not representable (m >= 0): refit through zero.
    s_zero = jnp.where(sqq > 0, sqx / jnp.where(sqq > 0, sqq, 1.0), 0.0)
    s = jnp.where(b > 0, s_zero, s)
    m = jnp.where(b > 0, 0.0, -b)
    return jnp.maximum(s, 0.0), m


def q4k_search(g, importance=None, steps=(-0.1, -0.05, 0.0, 0.05, 0.1, 0.15, 0.2)):
    """Per-sub-block float (s, m) [..., G, out] for g [..., G, 32, out]: codes from a range
    slightly widened or narrowed around [min(w, 0), max(w)] (`steps` of 15 levels), then the
    weighted least-squares (s, m) for those codes; the lowest weighted error wins."""
    wt = (
        jnp.ones_like(g)
        if importance is None
        else jnp.broadcast_to(importance[..., :, :, None], g.shape)
    )
    lo = jnp.minimum(jnp.min(g, axis=-2), 0.0)
    hi = jnp.max(g, axis=-2)
    span = jnp.where(hi > lo, hi - lo, 1.0)
    best = None
    for step in steps:
        iscale = (15 + step * 15) / span
        q = jnp.clip(jnp.round((g - lo[..., None, :]) * iscale[..., None, :]), 0, 15)
        s, m = _fit_affine(g, q, wt)
        q = jnp.clip(
            jnp.round((g + m[..., None, :]) / jnp.where(s > 0, s, 1.0)[..., None, :]), 0, 15
        )
        err = _weighted_error(g, s[..., None, :] * q - m[..., None, :], importance)
        best = _pick_best(best, jnp.stack([s, m]), err)
    return best[0][0], best[0][1]


def _six_bit(x, num_super):
    """x [..., G, out] >= 0 -> (codes uint8 0..63 [..., G, out], f16 scale [..., num_super, out])
    with x ~ scale[j // 8] * code_j."""
    per = SUPER_BLOCK // SUB_BLOCK
    groups = x.shape[-2]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, num_super * per - groups), (0, 0)])
    blocks = padded.reshape(*x.shape[:-2], num_super, per, x.shape[-1])
    d = (jnp.max(blocks, axis=-2) / 63).astype(jnp.float16)
    df = d.astype(jnp.float32)
    codes = jnp.clip(jnp.round(blocks / jnp.where(df > 0, df, 1.0)[..., None, :]), 0, 63)
    codes = codes.reshape(*x.shape[:-2], num_super * per, x.shape[-1])[..., :groups, :]
    return codes.astype(jnp.uint8), d


def q4k_quantize(g, importance=None):
    """g [..., G, 32, out] -> (codes uint8 0..15 [..., G, 32, out], 6-bit scale codes, 6-bit min
    codes (uint8 [..., G, out]), f16 [..., 2, num_super, out] super-block scales (d, dmin))."""
    groups = g.shape[-3]
    num_super = -(-groups * SUB_BLOCK // SUPER_BLOCK)
    s, m = q4k_search(g, importance)
    sc, d = _six_bit(s, num_super)
    mc, dmin = _six_bit(m, num_super)
    sq, mq = q4k_expand(sc, d), q4k_expand(mc, dmin)
    # Codes again against the 6-bit scales the matmul will use.
    codes = jnp.round((g + mq[..., None, :]) / jnp.where(sq > 0, sq, 1.0)[..., None, :])
    return jnp.clip(codes, 0, 15).astype(jnp.uint8), sc, mc, jnp.stack([d, dmin], axis=-3)


def q4k_expand(codes, super_scale):
    """6-bit codes [..., G, out] x f16 super-block scale [..., S, out] -> f32 [..., G, out]."""
    per = SUPER_BLOCK // SUB_BLOCK
    idx = np.arange(codes.shape[-2]) // per
    return codes.astype(jnp.float32) * super_scale.astype(jnp.float32)[..., idx, :]


def q4k_pack_pairs(sc, mc):
    """6-bit (sc, mc) [..., G, out] -> 12 bits: uint8 [..., G, out] and uint8 [..., G/2, out]."""
    low = sc | ((mc & 3) << 6)
    high = mc >> 2
    if high.shape[-2] % 2:
        high = jnp.pad(high, [(0, 0)] * (high.ndim - 2) + [(0, 1), (0, 0)])
    return low, high[..., 0::2, :] | (high[..., 1::2, :] << 4)


def q4k_unpack_pairs(low, high_packed):
    groups = low.shape[-2]
    high = jnp.stack([high_packed & 0xF, high_packed >> 4], axis=-2)
    high = high.reshape(*high_packed.shape[:-2], -1, high_packed.shape[-1])[..., :groups, :]
    return low & 63, (low >> 6) | (high << 2)
