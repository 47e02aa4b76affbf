"""One full forward equals prefill + token-by-token cached decode (f32, <= 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.cache import KVCache
from jaxgen.engine.runner.steps import decode, prefill
from jaxgen.model import ModelConfig, forward, init_params, unroll_layers
from jaxgen.pallas_kernels import mosaic_interpret

TOL = 1e-5


def tiny(**kw):
    base = dict(
        arch="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize(
    "cfg",
    [
        tiny(),
        tiny(arch="mistral", sliding_window=4),
        tiny(arch="qwen3", qk_norm=True, num_kv_heads=1),
    ],
    ids=["llama", "mistral-window", "qwen3"],
)
def test_prefill_then_decode_equals_full_forward(cfg):
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (3, 14)).astype(np.int32)
    full = np.asarray(forward(cfg, params, tokens))
    prompt_lens = np.array([5, 1, 9], np.int32)
    kv = KVCache.init(cfg, 3, 16)
    # Right-padded prompts in a bucket of 9; the padding is poison that must not leak.
    padded = np.where(np.arange(9)[None] < prompt_lens[:, None], tokens[:, :9], cfg.vocab_size - 1)
    logits, kv = prefill(params, jnp.asarray(padded), jnp.asarray(prompt_lens), kv, cfg=cfg)
    for row, n in enumerate(prompt_lens):
        np.testing.assert_allclose(logits[row], full[row, n - 1], atol=TOL, rtol=0)
    pos = prompt_lens.copy()
    for _ in range(14 - prompt_lens.max()):
        step = jnp.asarray(tokens[np.arange(3), pos])
        logits, kv = decode(params, step, kv, cfg=cfg)
        for row in range(3):
            np.testing.assert_allclose(logits[row], full[row, pos[row]], atol=TOL, rtol=0)
        pos += 1
    np.testing.assert_array_equal(kv.lengths, pos)


def test_chunked_prefill_equals_full_forward():
    cfg = tiny()
    params = init_params(cfg, jax.random.key(1))
    tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    full = np.asarray(
        forward(
            cfg,
            params,
            tokens,
        )
    )
    kv = KVCache.init(cfg, 2, 12)
    _, kv = prefill(params, jnp.asarray(tokens[:, :5]), jnp.array([5, 5]), kv, cfg=cfg)
    logits, kv = prefill(
        params,
        jnp.asarray(tokens[:, 5:]),
        jnp.array([7, 7]),
        kv,
        cfg=cfg,
        chunked=True,
        all_logits=True,
    )
    np.testing.assert_allclose(logits, full[:, 5:], atol=TOL, rtol=0)


def test_inactive_rows_do_not_advance():
    cfg = tiny()
    params = init_params(cfg, jax.random.key(0))
    kv = KVCache.init(cfg, 2, 8)
    _, kv = prefill(params, jnp.ones((2, 3), jnp.int32), jnp.array([3, 2]), kv, cfg=cfg)
    before = np.asarray(kv.k[:, 1])
    _, kv = decode(params, jnp.array([1, 1]), kv, jnp.array([True, False]), cfg=cfg)
    np.testing.assert_array_equal(kv.lengths, [4, 2])
    np.testing.assert_array_equal(kv.k[:, 1], before)


def test_model_runs_through_the_flash_kernel():
    """The model's attention goes through the dispatch: the Pallas kernel (interpret mode here,
    compiled on GPU) gives the reference's logits."""
    cfg = tiny(arch="qwen3", qk_norm=True, num_kv_heads=1, sliding_window=None)
    params = init_params(cfg, jax.random.key(3))
    tokens = np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 21))
    ref = np.asarray(forward(cfg, params, tokens))
    kernel = np.asarray(forward(cfg, params, tokens, attn_impl="interpret"))
    np.testing.assert_allclose(kernel, ref, atol=TOL, rtol=0)


@pytest.mark.skipif(
    not mosaic_interpret.available(),
    reason="JAX 0.10's Mosaic GPU interpreter has no transposed wgmma operand",
)
def test_model_runs_through_the_hopper_kernel():
    """A bf16 model's prefill attention on the Hopper (Mosaic GPU) kernel, in JAX's Mosaic GPU
    interpreter, gives the Triton kernel's logits (both in interpret mode here). Unrolled layers
    (the GPU path): inside Flax's layer scan the Mosaic kernel fails Flax 0.12's broadcast check
    ("broadcasted variable has a data dependency on the scan body"), as the paged decode
    kernel did on the GPU in the 2026-12-04 run."""
    cfg = tiny(num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=128)
    params = unroll_layers(init_params(cfg, jax.random.key(5), dtype=jnp.bfloat16), cfg)
    tokens = np.random.RandomState(6).randint(0, cfg.vocab_size, (2, 21))
    triton = np.asarray(forward(cfg, params, tokens, attn_impl="interpret"), np.float32)
    hopper = np.asarray(forward(cfg, params, tokens, attn_impl="mosaic_interpret"), np.float32)
    np.testing.assert_allclose(hopper, triton, atol=0.05 * np.abs(triton).max(), rtol=0)
    assert (hopper.argmax(-1) == triton.argmax(-1)).mean() > 0.9
