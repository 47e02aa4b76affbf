"""dispatch.cached_attention: decode over a layered contiguous cache [L, B, S, K, H] through the
paged decode kernel (the cache viewed as a page pool), against slicing the layer out and running
the reference; the fallback for shapes the view does not fit; CUDA lowering with no copy of the
layer's slice."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.flash_attention import flash_attention_reference
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.tolerances import tol


def make(dtype, *, layers=3, batch=3, seq=48, heads=4, kv_heads=2, head_dim=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shape = (layers, batch, seq, kv_heads, head_dim)
    k = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    v = jax.random.normal(ks[1], shape, jnp.float32).astype(dtype)
    q = jax.random.normal(ks[2], (batch, 1, heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v


def reference(q, k, v, layer, lengths, window=None):
    return flash_attention_reference(
        q.astype(jnp.float32),
        k[layer].astype(jnp.float32),
        v[layer].astype(jnp.float32),
        kv_lens=lengths + 1,
        q_offsets=lengths,
        sliding_window=window,
    )


CASES = [
    ("float32", 48, None, 1),  # page 16
    ("float32", 40, None, 2),  # page 8
    ("bfloat16", 48, None, 0),
    ("float32", 48, 5, 1),  # sliding window
]


def check_paged_view(dtype, seq, window, layer, impl):
    q, k, v = make(jnp.dtype(dtype), seq=seq)
    # A full row, a row one token in, and one in the middle of a page.
    lengths = jnp.array([seq - 1, 0, seq // 2 + 3], jnp.int32)
    out = dispatch.cached_attention(
        q,
        k,
        v,
        layer,
        kv_lens=lengths + 1,
        q_offsets=lengths,
        sliding_window=window,
        impl=impl,
    )
    ref = reference(q, k, v, layer, lengths, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref), atol=tol(dtype), rtol=tol(dtype)
    )


@pytest.mark.parametrize("dtype,seq,window,layer", CASES)
def test_paged_view_matches_reference(dtype, seq, window, layer):
    check_paged_view(dtype, seq, window, layer, "interpret")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,seq,window,layer", CASES)
def test_paged_view_matches_reference_gpu(dtype, seq, window, layer):
    check_paged_view(dtype, seq, window, layer, "pallas")


def test_poisoned_slots_past_the_row_are_never_read():
    q, k, v = make(jnp.float32)
    lengths = jnp.array([5, 17, 30], jnp.int32)
    pos = jnp.arange(k.shape[2])[None, :, None, None]
    poison = lambda c: jnp.where(pos > lengths[:, None, None, None], jnp.nan, c)
    k, v = poison(k), poison(v)
    out = dispatch.cached_attention(
        q, k, v, 1, kv_lens=lengths + 1, q_offsets=lengths, impl="interpret"
    )
    assert np.isfinite(np.asarray(out)).all()
    ref = reference(q, jnp.nan_to_num(k), jnp.nan_to_num(v), 1, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_a_traced_layer_takes_the_slice():
    # Inside a layer scan the index is traced: the slice path (no paged kernel) runs.
    q, k, v = make(jnp.float32)
    lengths = jnp.array([3, 20, 30], jnp.int32)
    f = lambda layer: dispatch.cached_attention(
        q, k, v, layer, kv_lens=lengths + 1, q_offsets=lengths, impl="interpret"
    )
    jaxpr = str(jax.make_jaxpr(f)(jnp.int32(1)))
    assert "paged_attention" not in jaxpr and "dynamic_slice" in jaxpr
    static = str(jax.make_jaxpr(lambda: f(1))())
    assert "paged_attention" in static


def test_shapes_the_view_does_not_fit_fall_back_to_the_slice():
    # 36 slots is no multiple of 8; head_dim 24 is not a padded head dim: both take the slice.
    for seq, head_dim in ((36, 16), (48, 24)):
        q, k, v = make(jnp.float32, seq=seq, head_dim=head_dim)
        lengths = jnp.array([3, 20, 30], jnp.int32)
        out = dispatch.cached_attention(
            q, k, v, 2, kv_lens=lengths + 1, q_offsets=lengths, impl="xla"
        )
        np.testing.assert_allclose(
            np.asarray(out), np.asarray(reference(q, k, v, 2, lengths)), atol=1e-6
        )


def _lowered(impl):
    q, k, v = make(jnp.bfloat16, layers=4, batch=2, seq=1024, heads=32, kv_heads=8, head_dim=128)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    f = lambda q, k, v, n: dispatch.cached_attention(
        q, k, v, 2, kv_lens=n + 1, q_offsets=n, impl=impl
    )
    return lower_for_cuda(f, spec(q), spec(k), spec(v), lens).as_text()


def _kernels(text):
    """Names of the Triton kernels a lowered module calls (not its debug strings: JAX 0.12
    embeds source paths in the kernel IR, so a file name can appear in any kernel)."""
    return re.findall(r'name = "(\w+)", num_stages', text)


def test_decode_lowers_for_cuda_reading_the_cache_in_place():
    paged = _lowered("pallas")
    assert _kernels(paged) == ["paged_attention"]
    # The layer is an operand of the kernel, not a dynamic_slice of the cache before it.
    assert "dynamic_slice" not in paged
    flash = _lowered("flash")
    assert "stablehlo.slice" in flash and _kernels(flash) == ["flash_attention_fwd"]
