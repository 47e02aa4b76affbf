"""Block-scaled 4-bit formats (MXFP4, NVFP4, k-quant-style q4k) and the fp8 scale search:
packing, scale encodings, error bounds, the importance-weighted search, the matmul, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.quant import lowbit
from jaxgen.quant.formats import QuantizationError, quantize_rtn
from jaxgen.quant.matmul import llm_int8_matmul, matmul

RNG = np.random.RandomState(1)
# Heavy-tailed like real weights (Student t), 512 rows: two q4k super-blocks.
W = (RNG.standard_t(4, (2, 512, 40)) * 0.02).astype(np.float32)
IMPORTANCE = (RNG.lognormal(0, 1.5, 512) ** 2).astype(np.float32)


def _weighted_error(q, importance=IMPORTANCE):
    d = np.asarray(q.dequantize()) - W
    return float(np.sum(importance[:, None] * d**2))


def test_e2m1_codes_round_trip_and_round_to_nearest():
    codes = lowbit.fp4_encode(jnp.asarray(lowbit.E2M1_CODE))
    np.testing.assert_array_equal(lowbit.E2M1_CODE[np.asarray(codes)], lowbit.E2M1_CODE)
    v = RNG.uniform(-7, 7, 1000).astype(np.float32)
    got = np.asarray(lowbit.fp4_round(jnp.asarray(v)))
    nearest = np.abs(v[:, None] - lowbit.E2M1_CODE[None]).min(axis=1)
    np.testing.assert_allclose(np.abs(got - v), nearest, atol=1e-6)


@pytest.mark.parametrize("fmt,bits", [("mxfp4", 4.25), ("nvfp4", 4.5), ("q4k", 4.5)])
def test_packed_sizes_and_bits_per_weight(fmt, bits):
    q = quantize_rtn(W, fmt)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (2, 256, 40)  # two codes a byte
    # nvfp4's one f32 per tensor adds 32 bits to 512 x 40 weights.
    assert q.bits_per_weight == pytest.approx(bits, abs=0.01)


def test_mxfp4_scales_are_powers_of_two_and_error_bounded():
    q = quantize_rtn(W, "mxfp4")
    scales = np.asarray(q.float_scales())
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(scales))), scales)
    err = np.abs(np.asarray(q.dequantize()) - W)
    step = np.repeat(scales, 32, axis=-2)
    # Half of e2m1's widest gap (4 -> 6), or the saturation of (6, 8) x scale to 6.
    assert np.all(err <= 2 * step + 1e-7)


def test_nvfp4_scales_are_e4m3_under_a_tensor_scale():
    q = quantize_rtn(W, "nvfp4")
    assert q.scales.dtype == jnp.float8_e4m3fn and q.scale_scales.shape == (2,)
    amax = np.abs(W).reshape(2, -1).max(axis=1)
    np.testing.assert_allclose(np.asarray(q.scale_scales), amax / (6 * 448), rtol=1e-6)
    rel = np.linalg.norm(np.asarray(q.dequantize()) - W) / np.linalg.norm(W)
    assert rel < 0.12


def test_q4k_six_bit_pairs_round_trip():
    sc = jnp.asarray(RNG.randint(0, 64, (3, 18, 5)), jnp.uint8)
    mc = jnp.asarray(RNG.randint(0, 64, (3, 18, 5)), jnp.uint8)
    low, high = lowbit.q4k_pack_pairs(sc, mc)
    assert high.shape == (3, 9, 5)  # 12 bits per sub-block
    got_sc, got_mc = lowbit.q4k_unpack_pairs(low, high)
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_mc, mc)


def test_q4k_beats_int4_at_fewer_bits():
    q4k = quantize_rtn(W, "q4k")
    int4 = quantize_rtn(W, "int4", 32)
    assert q4k.bits_per_weight < int4.bits_per_weight
    ones = np.ones_like(IMPORTANCE)
    assert _weighted_error(q4k, ones) < _weighted_error(int4, ones)


@pytest.mark.parametrize(
    "fmt,kwargs",
    [
        ("mxfp4", {}),
        ("nvfp4", {}),
        ("q4k", {}),
        ("fp8", {}),
        ("int8", dict(group_size=32, scale_dtype="float16")),
        ("int4", dict(group_size=32)),
    ],
)
def test_importance_search_lowers_the_weighted_error(fmt, kwargs):
    plain = quantize_rtn(W, fmt, **kwargs)
    searched = quantize_rtn(W, fmt, importance=IMPORTANCE, **kwargs)
    assert _weighted_error(searched) < _weighted_error(plain)
    assert searched.scales.dtype == plain.scales.dtype


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "q4k"])
def test_matmul_equals_dequantized_weight(fmt):
    q = quantize_rtn(W[0], fmt, importance=IMPORTANCE)
    x = jnp.asarray(RNG.randn(4, 3, 512), jnp.float32)
    np.testing.assert_allclose(matmul(x, q), x @ q.dequantize(), rtol=1e-5, atol=1e-4)


def test_block_formats_reject_shapes_and_groups_they_cannot_take():
    with pytest.raises(QuantizationError, match="fixed block of 32"):
        quantize_rtn(W, "mxfp4", 64)
    with pytest.raises(QuantizationError, match="divisible by its block of 16"):
        quantize_rtn(W[:, :200], "nvfp4")


def test_llm_int8_decomposes_per_token():
    """A token's result does not depend on the other tokens in its batch, and its own
    outliers go through the float path."""
    w = quantize_rtn(W[0], "int8", act_quant="llm_int8")
    x = RNG.randn(4, 512).astype(np.float32)
    x[0, 3] = 30.0  # an outlier in token 0 only
    together = np.asarray(llm_int8_matmul(jnp.asarray(x), w))
    alone = np.asarray(llm_int8_matmul(jnp.asarray(x[1:2]), w))
    np.testing.assert_array_equal(together[1], alone[0])
    exact = x @ np.asarray(w.dequantize())
    assert np.abs(together[0] - exact[0]).max() < 0.05 * np.abs(exact[0]).max()


@pytest.mark.parametrize("fmt", ["mxfp4", "q4k"])
def test_gptq_with_a_block_format_lowers_the_output_error(fmt):
    """GPTQ's error feedback around the format's own quantizer beats that quantizer alone
    (with the same diag(H) importance) on correlated calibration inputs."""
    from jaxgen.quant import gptq

    mix = RNG.randn(512, 512) * 0.3 + np.eye(512)
    x = (RNG.randn(1024, 512) @ mix * RNG.lognormal(0, 1, 512)).astype(np.float32)
    h = gptq.Hessian(512)
    h.add(x)
    q = gptq.gptq_block_format(W[0], h.h, fmt)
    rtn = quantize_rtn(W[0], fmt, importance=np.diag(h.h).astype(np.float32))
    assert (
        q.fmt == fmt and q.values.shape == rtn.values.shape and q.scales.shape == rtn.scales.shape
    )

    def out_err(qa):
        return np.linalg.norm(x @ W[0] - x @ np.asarray(qa.dequantize()))

    assert out_err(q) < 0.9 * out_err(rtn)
