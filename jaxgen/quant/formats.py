"""Quantized weight formats as pytrees, and round-to-nearest (RTN) quantization into them.

A linear weight W [..., in, out] (leading axes: e.g. the stacked `layers` axis) is quantized
along its input (contraction) dimension in groups of `group_size` rows, one scale per group and
output channel. When the group size does not divide `in` the last group is shorter (it is
stored padded with copies of its own rows, which leave its statistics unchanged, and the
matmul pads the activations with zeros), as in GPTQ's algorithm; e.g. SmolLM2's 576-wide
layers at group 128 have four groups of 128 and one of 64.

  int8/int4/int3/int2  symmetric (q = round(w / s), s = absmax / qmax) or asymmetric
                       (q = round(w / s) + z, s = (max - min) / (2^b - 1)); int4 is packed two
                       per byte along the input axis, int3 / int2 at their real widths as bit
                       planes (plane k holds bit k of 8 consecutive rows' codes in one byte)
  nf4                  QLoRA's NormalFloat-4 code book (quantiles of N(0, 1)) times a per-group
                       absmax scale; optionally double-quantized scales (int8 with one f32 scale
                       per 256 groups)
  fp8                  float8 e4m3 values with per-channel (or per-group) scales
  mxfp4 / nvfp4 / q4k  block-scaled 4-bit formats, packed two per byte (see `quant.lowbit`):
                       FP4 e2m1 with e8m0 scales per 32 rows (MXFP4) or e4m3 scales per 16 rows
                       and an f32 scale per tensor (NVFP4); k-quant-style asymmetric int4 with
                       6-bit sub-block scales and mins under f16 super-block scales

`FORMATS` is the one registry of weight formats: every name in it quantizes through
`quantize_rtn`, round-trips through orbax as a QArray and multiplies through `quant.matmul`.

`act_quant` marks weights whose matmul also quantizes activations: "int8" (SmoothQuant W8A8,
per-token int8 activations, int32 accumulation) or "llm_int8" (LLM.int8(): outlier feature
columns stay in floating point).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxgen.quant import lowbit

FORMATS = ("int8", "int4", "int3", "int2", "nf4", "fp8", "mxfp4", "nvfp4", "q4k")
BITS = {
    "int8": 8,
    "int4": 4,
    "int3": 3,
    "int2": 2,
    "nf4": 4,
    "fp8": 8,
    "mxfp4": 4,
    "nvfp4": 4,
    "q4k": 4,
}
INTEGER_FORMATS = ("int8", "int4", "int3", "int2")
SCALE_DTYPES = ("float32", "float16")  # how an integer format stores its per-group scales
BIT_PLANES = ("int3", "int2")  # stored as bit planes, 8 rows per byte and plane
PACKED_4BIT = ("int4", "nf4", "mxfp4", "nvfp4", "q4k")
# Formats whose block size is part of the format (rows per scale).
FIXED_GROUP = {"mxfp4": 32, "nvfp4": 16, "q4k": 32}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _nf4_code() -> np.ndarray:
    """NF4 (Dettmers et al., QLoRA §3): 8 positive and 7 negative quantiles of N(0, 1) plus an
    exact zero, normalised to [-1, 1]."""
    # The standard library's inverse normal CDF: importing scipy.stats costs ~0.7 s of start-up.
    ppf = np.vectorize(statistics.NormalDist().inv_cdf)
    offset = 0.9677083  # as in the paper's reference construction
    positive = ppf(np.linspace(offset, 0.5, 9)[:-1])
    negative = -ppf(np.linspace(offset, 0.5, 8)[:-1])
    code = np.sort(np.concatenate([positive, [0.0], negative]))
    return (code / np.abs(code).max()).astype(np.float32)


NF4_CODE = _nf4_code()


class QuantizationError(ValueError):
    """Bad quantization arguments (bits, group size, format)."""


@struct.dataclass
class QArray:
    values: (
        jax.Array
    )  # int8 [..., in, out]; uint8 [..., in/2, out] for packed 4-bit; fp8 [..., in, out]
    scales: jax.Array  # f32 or f16 [..., in/group, out] (int8 when double-quantized)
    zeros: jax.Array | None = None  # f32 or f16 [..., in/group, out]: asymmetric zero points
    scale_scales: jax.Array | None = None  # f32 [..., ceil(groups*out/256)]: double quantization
    fmt: str = struct.field(pytree_node=False, default="int8")
    group_size: int = struct.field(pytree_node=False, default=0)  # rows per scale group
    rows: int = struct.field(pytree_node=False, default=0)  # real input rows (the rest is padding)
    act_quant: str | None = struct.field(pytree_node=False, default=None)
    outlier_threshold: float = struct.field(pytree_node=False, default=6.0)

    @property
    def bits(self) -> int:
        return BITS[self.fmt]

    @property
    def padded_rows(self) -> int:
        if self.fmt in BIT_PLANES:
            return self.values.shape[-2] * 8 // self.bits
        return self.values.shape[-2] * (2 if self.fmt in PACKED_4BIT else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.values.shape[:-2], self.rows, self.values.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))

    def float_scales(self) -> jax.Array:
        """Per-group scales as f32 [..., groups, out] (undoing double quantization / block
        scalings)."""
        if self.fmt == "mxfp4":
            return lowbit.mxfp4_scales(self.scales)
        if self.fmt == "nvfp4":
            return self.scales.astype(jnp.float32) * self.scale_scales[..., None, None]
        if self.fmt == "q4k":
            sc, _ = lowbit.q4k_unpack_pairs(self.scales, self.zeros)
            return lowbit.q4k_expand(sc, self.scale_scales[..., 0, :, :])
        if self.scale_scales is None:
            return self.scales.astype(jnp.float32)  # f32, or f16 (scale_dtype="float16")
        flat = self.scales.reshape(*self.scales.shape[:-2], -1).astype(jnp.float32)
        blocks = -(-flat.shape[-1] // 256)
        flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, blocks * 256 - flat.shape[-1])])
        flat = flat.reshape(*flat.shape[:-1], blocks, 256) * self.scale_scales[..., None]
        flat = flat.reshape(*flat.shape[:-2], -1)[..., : np.prod(self.scales.shape[-2:])]
        return flat.reshape(self.scales.shape)

    def float_offsets(self) -> jax.Array | None:
        """Per-group offsets o [..., groups, out] with w = value(code) * scale - o, or None."""
        if self.fmt == "q4k":
            _, mc = lowbit.q4k_unpack_pairs(self.scales, self.zeros)
            return lowbit.q4k_expand(mc, self.scale_scales[..., 1, :, :])
        if self.zeros is None:
            return None
        return self.zeros.astype(jnp.float32) * self.float_scales()

    def codes(self) -> jax.Array:
        """Unpacked integer codes [..., in, out] (int8) or fp8 values."""
        if self.fmt in PACKED_4BIT:
            return unpack_4bit(self.values, signed=self.fmt == "int4")
        if self.fmt in BIT_PLANES:
            return unpack_bit_planes(self.values, self.bits)
        return self.values

    def code_values(self, dtype=jnp.float32) -> jax.Array:
        """[..., padded rows, out]: what each code stands for, before its group's scale."""
        codes = self.codes()
        table = {"nf4": NF4_CODE, "mxfp4": lowbit.E2M1_CODE, "nvfp4": lowbit.E2M1_CODE}
        if self.fmt in table:
            return jnp.asarray(table[self.fmt], dtype)[codes.astype(jnp.int32)]
        return codes.astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The full-precision weight (tests and QAT export; matmuls never call this)."""
        w = self.code_values()
        *lead, rows, out = w.shape
        groups = rows // self.group_size
        w = w.reshape(*lead, groups, self.group_size, out) * self.float_scales()[..., None, :]
        offsets = self.float_offsets()
        if offsets is not None:
            w = w - offsets[..., None, :]
        return w.reshape(*lead, rows, out)[..., : self.rows, :].astype(dtype)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits (codes, scales, mins, padding) per real weight."""
        return 8 * self.nbytes / float(np.prod(self.shape))


def pack_4bit(q: jax.Array) -> jax.Array:
    """int8 codes in [-8, 7] (or [0, 15]) [..., in, out] -> uint8 [..., in/2, out], two rows per
    byte (even row in the low nibble)."""
    u = (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    return u[..., 0::2, :] | (u[..., 1::2, :] << 4)


def unpack_4bit(packed: jax.Array, signed: bool) -> jax.Array:
    lo = (packed & 0xF).astype(jnp.int8)
    hi = (packed >> 4).astype(jnp.int8)
    if signed:
        lo = jnp.where(lo > 7, lo - 16, lo)
        hi = jnp.where(hi > 7, hi - 16, hi)
    out = jnp.stack([lo, hi], axis=-2)  # [..., in/2, 2, out]
    return out.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def pack_bit_planes(q: jax.Array, bits: int) -> jax.Array:
    """Signed codes [..., in, out] (in % 8 == 0) -> uint8 [..., bits * in / 8, out]: plane k
    (rows k * in/8 ...) holds bit k of rows 8r..8r+7 in byte r (row 8r + j in bit j)."""
    u = q.astype(jnp.int32) & ((1 << bits) - 1)
    *lead, rows, out = u.shape
    u = u.reshape(*lead, rows // 8, 8, out)
    weights = (1 << jnp.arange(8, dtype=jnp.int32))[:, None]
    planes = [jnp.sum(((u >> k) & 1) * weights, axis=-2) for k in range(bits)]
    return jnp.concatenate(planes, axis=-2).astype(jnp.uint8)


def unpack_bit_planes(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_bit_planes`: signed int8 codes [..., in, out]."""
    *lead, nbytes, out = packed.shape
    per_plane = nbytes // bits
    planes = packed.astype(jnp.int32).reshape(*lead, bits, per_plane, 1, out)
    bit_of_row = (planes >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1  # [..., b, R, 8, out]
    u = jnp.sum(bit_of_row << jnp.arange(bits, dtype=jnp.int32)[:, None, None, None], axis=-4)
    u = u.reshape(*lead, per_plane * 8, out)
    half = 1 << (bits - 1)
    return jnp.where(u >= half, u - 2 * half, u).astype(jnp.int8)


def _pack(q, fmt):
    if fmt == "int4":
        return pack_4bit(q)
    if fmt in BIT_PLANES:
        return pack_bit_planes(q, BITS[fmt])
    return q


def check_args(fmt: str, group_size: int | None, in_features: int, bits: int | None = None) -> int:
    """Validates format / bits / group size; returns the effective group size.

    group_size None (or -1) means per-channel: one group of all `in_features` rows."""
    if fmt not in FORMATS:
        raise QuantizationError(f"format must be one of {FORMATS}, got {fmt!r}")
    if bits is not None and bits != BITS[fmt]:
        raise QuantizationError(f"{fmt} has {BITS[fmt]} bits, not {bits}")
    if fmt in FIXED_GROUP:
        block = FIXED_GROUP[fmt]
        if group_size not in (None, -1, block):
            raise QuantizationError(
                f"{fmt} has a fixed block of {block} rows; got group size {group_size} "
                f"(pass None or {block})"
            )
        if in_features % block:
            raise QuantizationError(
                f"{fmt} needs an input dimension divisible by its block of {block}, got "
                f"{in_features}; pick a group-wise integer format (e.g. int4 with group 64) "
                "for this model"
            )
        return block
    group = in_features if group_size in (None, -1) else group_size
    if not isinstance(group, int) or group < 2 or group > in_features:
        raise QuantizationError(
            f"group size {group_size} is not valid for an input dimension of {in_features}: use "
            f"an even number in [2, {in_features}] (e.g. 32, 64, 128) or -1 for per-channel"
        )
    if fmt in ("int4", "nf4") and group % 2:
        raise QuantizationError(
            f"{fmt} packs two rows per byte: group size must be even, got {group}"
        )
    if fmt in BIT_PLANES and group % 8:
        raise QuantizationError(
            f"{fmt} packs 8 rows per byte and bit plane: group size must be a multiple of 8, "
            f"got {group}"
        )
    return group


def format_for_bits(bits: int) -> str:
    table = {8: "int8", 4: "int4", 3: "int3", 2: "int2"}
    if bits not in table:
        raise QuantizationError(f"bits must be 2, 3, 4 or 8 for integer formats, got {bits}")
    return table[bits]


def pad_rows(w, group):
    """Pads the input rows to a multiple of `group` with copies of the last row (a group's
    absmax / min / max are unchanged by repeating its own values)."""
    rows = w.shape[-2]
    extra = -rows % group
    if not extra:
        return w
    widths = [(0, 0)] * (w.ndim - 2) + [(0, extra), (0, 0)]
    return jnp.pad(w, widths, mode="edge")


def _grouped(w, group):
    *lead, rows, out = w.shape
    return w.reshape(*lead, rows // group, group, out)


def quantize_rtn(
    w,
    fmt: str = "int8",
    group_size: int | None = None,
    *,
    symmetric: bool = True,
    double_quant: bool = False,
    act_quant: str | None = None,
    importance=None,
    scale_dtype: str = "float32",
    outlier_threshold: float = 6.0,
) -> QArray:
    """Round-to-nearest quantization of W [..., in, out] along `in` (see the module docstring).

    Error bound (integer formats): |w - deq(q(w))| <= scale / 2 per element.
    `scale_dtype` "float16" (integer formats) stores each group's scale (and zero point) in
    16 bits, as llama.cpp's Q8_0 / Q4_0 do: int8 at group 32 then costs 8.5 bits per weight.
    Codes are rounded against the stored (rounded) scale, so the bound still holds.
    `outlier_threshold`: act_quant="llm_int8" only, the activation magnitude above which an
    entry takes the floating-point path (the paper's 6.0).
    `importance` ([in] or [..., in], e.g. mean x^2 per input channel over calibration tokens)
    turns the block formats' (mxfp4, nvfp4, q4k), fp8's and the symmetric integer formats'
    absmax scales into a weighted error search (`quant.lowbit`).
    """
    w = jnp.asarray(w, jnp.float32)
    rows = w.shape[-2]
    group = check_args(fmt, group_size, rows)
    if scale_dtype not in SCALE_DTYPES:
        raise QuantizationError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    if scale_dtype != "float32" and (fmt not in INTEGER_FORMATS or double_quant):
        raise QuantizationError(
            f"scale_dtype {scale_dtype!r} applies to the integer formats {INTEGER_FORMATS} "
            f"without double quantization, not {fmt!r}: keep scale_dtype='float32'"
        )
    narrow = jnp.dtype(scale_dtype)
    if not outlier_threshold > 0:
        raise QuantizationError(f"outlier_threshold must be > 0, got {outlier_threshold}")
    if fmt in FIXED_GROUP:
        return _quantize_block_format(w, fmt, importance, act_quant)
    w = pad_rows(w, group)
    g = _grouped(w, group)  # [..., G, group, out]
    zeros = None
    if fmt == "fp8" and importance is not None:
        imp = lowbit.importance_blocks(importance, w.shape[-2], group)
        scale = lowbit.fp8_search(g, imp)
        values = (g / scale[..., None, :]).astype(jnp.float8_e4m3fn).reshape(w.shape)
    elif fmt == "fp8":
        scale = jnp.max(jnp.abs(g), axis=-2) / FP8_MAX
        safe = jnp.where(scale == 0, 1.0, scale)
        values = (g / safe[..., None, :]).astype(jnp.float8_e4m3fn).reshape(w.shape)
    elif fmt == "nf4":
        scale = jnp.max(jnp.abs(g), axis=-2)
        safe = jnp.where(scale == 0, 1.0, scale)
        normed = g / safe[..., None, :]
        code = jnp.asarray(NF4_CODE)
        idx = jnp.argmin(jnp.abs(normed[..., None] - code), axis=-1).astype(jnp.int8)
        values = pack_4bit(idx.reshape(w.shape))
    else:
        bits = BITS[fmt]
        if symmetric:
            qmax = 2 ** (bits - 1) - 1
            scale = (jnp.max(jnp.abs(g), axis=-2) / qmax).astype(narrow).astype(jnp.float32)
            if importance is not None:
                imp = lowbit.importance_blocks(importance, w.shape[-2], group)
                scale = lowbit.int_search(g, imp, qmax, narrow)
            safe = jnp.where(scale == 0, 1.0, scale)
            q = jnp.clip(jnp.round(g / safe[..., None, :]), -qmax - 1, qmax)
        else:
            if importance is not None:
                raise QuantizationError(
                    f"the scale search of {fmt} is symmetric: drop symmetric=False or search"
                )
            levels = 2**bits - 1
            lo, hi = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
            scale = ((hi - lo) / levels).astype(narrow).astype(jnp.float32)
            safe = jnp.where(scale == 0, 1.0, scale)
            zeros = jnp.round(-lo / safe)  # an integer in [0, levels]: exact in f16 too
            q = jnp.clip(jnp.round(g / safe[..., None, :]) + zeros[..., None, :], 0, levels)
            # Stored signed (centered) so the same int8 / packed paths apply.
            q = q - 2 ** (bits - 1)
            zeros = zeros - 2 ** (bits - 1)
        values = _pack(q.astype(jnp.int8).reshape(w.shape), fmt)
    scale_scales = None
    if double_quant:
        scale, scale_scales = _double_quantize(scale)
    return QArray(
        values=values,
        scales=scale.astype(narrow) if not double_quant else scale,
        zeros=None if zeros is None else zeros.astype(narrow),
        scale_scales=scale_scales,
        fmt=fmt,
        group_size=group,
        rows=rows,
        act_quant=act_quant,
        outlier_threshold=float(outlier_threshold),
    )


def _quantize_block_format(w, fmt, importance, act_quant) -> QArray:
    rows = w.shape[-2]
    block = FIXED_GROUP[fmt]
    g = _grouped(w, block)
    imp = lowbit.importance_blocks(importance, rows, block)
    zeros = scale_scales = None
    if fmt == "mxfp4":
        codes, scales = lowbit.mxfp4_quantize(g, imp)
    elif fmt == "nvfp4":
        codes, scales, scale_scales = lowbit.nvfp4_quantize(g, imp)
    else:
        codes, sc, mc, scale_scales = lowbit.q4k_quantize(g, imp)
        scales, zeros = lowbit.q4k_pack_pairs(sc, mc)
    return QArray(
        values=pack_4bit(codes.reshape(w.shape)),
        scales=scales,
        zeros=zeros,
        scale_scales=scale_scales,
        fmt=fmt,
        group_size=block,
        rows=rows,
        act_quant=act_quant,
    )


def _double_quantize(scale):
    """QLoRA double quantization: f32 scales -> int8 with one f32 scale per 256 of them."""
    flat = scale.reshape(*scale.shape[:-2], -1)
    blocks = -(-flat.shape[-1] // 256)
    padded = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, blocks * 256 - flat.shape[-1])])
    padded = padded.reshape(*padded.shape[:-1], blocks, 256)
    s2 = jnp.max(jnp.abs(padded), axis=-1) / 127.0
    q = jnp.round(padded / jnp.where(s2 == 0, 1.0, s2)[..., None]).astype(jnp.int8)
    q = q.reshape(*q.shape[:-2], -1)[..., : flat.shape[-1]].reshape(scale.shape)
    return q, s2


def from_codes(codes, scales, zeros, fmt, group, rows, act_quant=None) -> QArray:
    """A QArray from integer codes [..., padded rows, out] already computed (GPTQ)."""
    values = _pack(jnp.asarray(codes).astype(jnp.int8), fmt)
    return QArray(
        values=values,
        scales=jnp.asarray(scales, jnp.float32),
        zeros=None if zeros is None else jnp.asarray(zeros, jnp.float32),
        fmt=fmt,
        group_size=group,
        rows=rows,
        act_quant=act_quant,
    )
