"""model.unroll_layers: per-layer params run the layers one after another and give the scanned
model's logits and cache; the compiled decode step then holds no copy of a layer's weights (the
scan's dynamic slices materialise one per linear), and no copy of the whole cache (donation)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.bench.profile import hlo_ops, large_copies
from jaxgen.cache import KVCache
from jaxgen.engine.runner import steps
from jaxgen.model import ModelConfig, init_params, unroll_layers
from jaxgen.quant.apply import quantize_params

CFG = ModelConfig(
    arch="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    name="tiny",
)


def _decode_twice(params, kv):
    tokens = jnp.array([3, 7], jnp.int32)
    prompt = jnp.array([[5, 9, 11, 2], [4, 4, 8, 1]], jnp.int32)
    logits, kv = steps.prefill(params, prompt, jnp.array([4, 3], jnp.int32), kv, cfg=CFG)
    out = [logits]
    for _ in range(2):
        logits, kv = steps.decode(params, tokens, kv, cfg=CFG)
        out.append(logits)
    return out, kv


def test_unrolled_matches_scanned():
    params = init_params(CFG, jax.random.key(0))
    unrolled = unroll_layers(params, CFG)
    assert "layers" not in unrolled and sorted(k for k in unrolled if k.startswith("layers_")) == [
        "layers_0",
        "layers_1",
        "layers_2",
    ]
    assert unroll_layers(unrolled, CFG) is unrolled  # idempotent
    np.testing.assert_array_equal(
        unrolled["layers_1"]["mlp"]["up_proj"]["kernel"],
        params["layers"]["mlp"]["up_proj"]["kernel"][1],
    )
    ref, kv_ref = _decode_twice(params, KVCache.init(CFG, 2, 16))
    got, kv_got = _decode_twice(unrolled, KVCache.init(CFG, 2, 16))
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kv_ref.k), np.asarray(kv_got.k), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kv_ref.lengths), np.asarray(kv_got.lengths))


def test_quantized_params_unroll():
    params = quantize_params(init_params(CFG, jax.random.key(1)), "int8")
    unrolled = unroll_layers(params, CFG)
    ref, _ = _decode_twice(params, KVCache.init(CFG, 2, 16))
    got, _ = _decode_twice(unrolled, KVCache.init(CFG, 2, 16))
    np.testing.assert_allclose(np.asarray(ref[-1]), np.asarray(got[-1]), atol=1e-5, rtol=1e-5)


def _decode_copies(params):
    kv = KVCache.init(CFG, 2, 64)
    fn = jax.jit(functools.partial(steps.decode_step, cfg=CFG), donate_argnums=2)
    compiled = fn.lower(params, jnp.zeros((2,), jnp.int32), kv, jnp.ones((2,), bool)).compile()
    ops = hlo_ops(compiled.as_text())
    # An MLP kernel (f32) is larger than anything else a layer copies (its K/V slice for XLA
    # attention is 2 x 64 x 2 x 16 x 4 = 16 KiB).
    mlp_kernel = CFG.hidden_size * CFG.intermediate_size * 4
    return large_copies(ops, mlp_kernel), large_copies(ops, kv.k.nbytes), compiled


def test_decode_step_reads_weights_and_cache_in_place():
    params = init_params(CFG, jax.random.key(0))
    scanned_copies, _, _ = _decode_copies(params)
    # The audit sees the scan's weight copies (so it can fail) ...
    assert scanned_copies, "expected the scan's per-layer weight slices to be copies"
    copies, cache_copies, compiled = _decode_copies(unroll_layers(params, CFG))
    # ... and none once the layers are unrolled; never a copy of the whole cache.
    assert copies == []
    assert cache_copies == []
    assert "input_output_alias" in compiled.as_text()  # the donated cache is aliased


@pytest.mark.gpu
def test_unrolled_paged_decode_matches_scanned_on_gpu():
    """Compiled: unrolled layers with paged decode attention (the GPU default for unrolled
    params) against the scanned model with the flash kernel on the layer's slice."""
    cfg = ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        name="small",
    )
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    prompt = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)
    tokens = jnp.array([3, 7], jnp.int32)

    def run(p, impl):
        kv = KVCache.init(cfg, 2, 64, jnp.bfloat16)
        _, kv = steps.prefill(p, prompt, jnp.array([40, 33], jnp.int32), kv, cfg=cfg)
        logits = []
        for _ in range(3):
            out, kv = steps.decode(p, tokens, kv, cfg=cfg, attn_impl=impl)
            logits.append(out)
        return jnp.stack(logits)

    ref = run(params, "flash")
    got = run(unroll_layers(params, cfg), "pallas")
    err = float(jnp.max(jnp.abs(ref - got)) / jnp.max(jnp.abs(ref)))
    assert err < 2e-2, err
