"""The device-side page pool: writes through slot mappings, copy-on-write copies, int8 pages,
the memory-budget formula, and the model decoding through pages exactly as through the
contiguous cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.cache import KVCache, PagedKVCache, PagedMetadata
from jaxgen.cache.block_manager import BlockManager
from jaxgen.model import ModelConfig, init_params
from jaxgen.model.llama import Transformer

CFG = ModelConfig(
    arch="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
)


def test_budget_formula():
    per_page = 2 * CFG.num_layers * 16 * CFG.num_kv_heads * 16 * 4  # head_dim 8 padded to 16
    assert PagedKVCache.bytes_per_page(CFG, 16) == per_page
    assert PagedKVCache.pages_for_budget(CFG, 10 * per_page + 5, 16) == 10
    int8 = PagedKVCache.bytes_per_page(CFG, 16, kv_quant="int8")
    assert int8 == 2 * 2 * 16 * 2 * 16 * 1 + 2 * 2 * 16 * 2 * 4


def test_write_and_copy_pages_exact():
    kv = PagedKVCache.init(CFG, num_pages=6, page_size=4)
    rng = np.random.RandomState(0)
    k_new = jnp.asarray(rng.randn(2, 3, 2, 8), jnp.float32)
    slots = jnp.asarray([[5, 6, -1], [20, 21, 22]])  # -1: padding, not written
    kv = kv.write(1, k_new, k_new, slots)
    flat = np.asarray(kv.k[1]).reshape(24, 2, 16)
    np.testing.assert_array_equal(flat[[5, 6]][..., :8], k_new[0, :2])
    np.testing.assert_array_equal(flat[[20, 21, 22]][..., :8], k_new[1])
    written = {5, 6, 20, 21, 22}
    assert not flat[[s for s in range(24) if s not in written]].any()  # nothing else touched
    assert not np.asarray(kv.k[0]).any()  # other layers untouched
    kv = kv.copy_pages(jnp.asarray([1]), jnp.asarray([3]))
    np.testing.assert_array_equal(np.asarray(kv.k[:, 3]), np.asarray(kv.k[:, 1]))


@pytest.mark.parametrize("kv_quant,bound", [("int8", 0.5 / 127), ("fp8", 0.07)])
def test_quantized_pages_round_trip(kv_quant, bound):
    kv = PagedKVCache.init(CFG, num_pages=4, page_size=4, kv_quant=kv_quant)
    x = jnp.asarray(np.random.RandomState(1).randn(1, 4, 2, 8), jnp.float32)
    kv = kv.write(0, x, x, jnp.arange(4)[None])
    deq = kv.pages[0][0, 0, :, :, :8].astype(jnp.float32) * kv.k_scales[0, 0][..., None]
    amax = jnp.max(jnp.abs(x[0]), axis=-1, keepdims=True)
    assert float(jnp.max(jnp.abs(deq - x[0]) / amax)) <= bound


@pytest.mark.parametrize("kv_quant", ["int8", "fp8"])
def test_quantized_write_is_in_place(kv_quant):
    """A write must not convert the whole pool (XLA:CPU upcasts fp8 arrays it scatters into,
    which cost 0.5 s per step on a real pool): the compiled write has no pool-sized convert."""
    kv = PagedKVCache.init(CFG, num_pages=8, page_size=4, kv_quant=kv_quant)
    x = jnp.ones((1, 1, 2, 8), jnp.float32)
    write = jax.jit(lambda kv, x: kv.write(1, x, x, jnp.asarray([[5]])), donate_argnums=0)
    hlo = write.lower(kv, x).compile().as_text()
    pool = ",".join(map(str, kv.k.shape))
    converts = [line for line in hlo.splitlines() if f"[{pool}]" in line and "convert(" in line]
    assert not converts, converts


def run_paged(params, tokens, prompt_lens, page_size=4, num_pages=40):
    """Prefill then decode through pages laid out by a BlockManager (permuted free list)."""
    bm = BlockManager(num_pages, page_size, enable_prefix_caching=False)
    bm._free = type(bm._free)(np.random.RandomState(0).permutation(num_pages).tolist())
    kv = PagedKVCache.init(CFG, num_pages, page_size)
    model = Transformer(CFG)
    batch, total = tokens.shape
    max_pages = bm.pages_needed(total)
    logits_out = []
    t = int(prompt_lens.max())
    slot_map = np.full((batch, t), -1, np.int32)
    for b in range(batch):
        bm.allocate(b, tokens[b, : prompt_lens[b]].tolist())
        slot_map[b, : prompt_lens[b]] = bm.slots(b, 0, prompt_lens[b])

    def tables():
        out = np.zeros((batch, max_pages), np.int32)
        for b in range(batch):
            out[b, : len(bm.tables[b])] = bm.tables[b]
        return jnp.asarray(out)

    md = PagedMetadata(
        jnp.asarray(slot_map),
        tables(),
        jnp.zeros(batch, jnp.int32),
        jnp.asarray(prompt_lens),
        fresh=True,
    )
    padded = np.where(np.arange(t)[None] < prompt_lens[:, None], tokens[:, :t], 0)
    positions = np.broadcast_to(np.arange(t), (batch, t))
    logits, kv = model.apply(
        {"params": params}, jnp.asarray(padded), jnp.asarray(positions), kv, md
    )
    logits_out.append([logits[b, prompt_lens[b] - 1] for b in range(batch)])
    pos = prompt_lens.copy()
    while pos.max() < total:
        slots = np.array([[bm.append(b, int(tokens[b, pos[b]])).slot] for b in range(batch)])
        md = PagedMetadata(
            jnp.asarray(slots, jnp.int32), tables(), jnp.asarray(pos), jnp.ones(batch, jnp.int32)
        )
        step = tokens[np.arange(batch), pos][:, None]
        logits, kv = model.apply(
            {"params": params}, jnp.asarray(step), jnp.asarray(pos[:, None]), kv, md
        )
        logits_out.append([logits[b, 0] for b in range(batch)])
        pos = pos + 1
    return logits_out


def test_paged_decode_equals_contiguous():
    params = init_params(CFG, jax.random.key(0))
    tokens = np.random.RandomState(2).randint(0, CFG.vocab_size, (2, 15)).astype(np.int32)
    prompt_lens = np.array([9, 9], np.int32)
    paged = run_paged(params, tokens, prompt_lens)
    from jaxgen.engine.runner.steps import decode, prefill

    kv = KVCache.init(CFG, 2, 16)
    logits, kv = prefill(params, jnp.asarray(tokens[:, :9]), jnp.asarray(prompt_lens), kv, cfg=CFG)
    contiguous = [[logits[0], logits[1]]]
    for i in range(9, 15):
        logits, kv = decode(params, jnp.asarray(tokens[:, i]), kv, cfg=CFG)
        contiguous.append([logits[0], logits[1]])
    assert len(paged) == len(contiguous)
    for a, b in zip(paged, contiguous, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
