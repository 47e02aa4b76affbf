"""Multi-head Latent Attention and the DeepSeek-V3 (and V2) model against transformers (PyTorch,
CPU, f32) on tiny random models: full forward, prefill (expanded) + chunk and decode (absorbed)
through the contiguous and the paged latent caches, absorbed equal to expanded, the cache's bytes
per token, tp/ep sharding, loading (orbax round-trip) and typed errors."""

import dataclasses
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.cache import KVCache, MLACache, PagedKVCache, PagedMetadata, PagedMLACache
from jaxgen.cache.mla import cache_size_report, latent_bytes_per_token, mha_bytes_per_token
from jaxgen.engine.runner.steps import decode, prefill
from jaxgen.model import ModelConfig, forward, load_model, save_checkpoint
from jaxgen.model.llama import Transformer, param_logical_axes
from jaxgen.model.loading import load_checkpoint
from jaxgen.sharding.placement import Placement
from tests.helpers import hf_logits, tiny_hf_model

TOL = 1e-4  # against transformers
SELF_TOL = 1e-5  # absorbed vs expanded, both ours
SEQ = 16

MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    moe_intermediate_size=16,
    num_hidden_layers=3,
)
CASES = {
    # q through the low-rank bottleneck, interleaved rope, group-limited sigmoid routing with a
    # correction bias, a shared expert and one dense first layer.
    "v3-q-lora-grouped": (
        "deepseek_v3",
        dict(
            MLA,
            q_lora_rank=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
    ),
    # a plain q_proj, rotate-half rope with DeepSeek's yarn scaling (attention factor on cos/sin
    # and mscale on the softmax scale), no groups, two shared experts, two dense layers,
    # attention biases, a value head wider than the query/key head.
    "v3-no-q-lora-yarn": (
        "deepseek_v3",
        dict(
            MLA,
            q_lora_rank=None,
            v_head_dim=16,
            qk_rope_head_dim=8,
            rope_interleave=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.5,
            ),
            attention_bias=True,
            n_routed_experts=6,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            first_k_dense_replace=2,
            num_hidden_layers=4,
        ),
    ),
    # DeepSeek-V2: softmax greedy routing scaled, no renormalisation (config-only differences).
    "v2-greedy": (
        "deepseek_v2",
        dict(
            MLA,
            q_lora_rank=24,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
        ),
    ),
}


@functools.cache
def _model(case):
    """(transformers model, its directory, cfg, params) of a case, built once."""
    import torch

    arch, overrides = CASES[case]
    directory = tempfile.mkdtemp(prefix=f"jaxgen-mla-{case}-")
    hf = tiny_hf_model(directory, arch, **overrides)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):  # decisive routing (see test_moe)
                p.normal_(0.0, 1.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection differs from plain top-k
                b.normal_(0.0, 0.3)
    hf.save_pretrained(directory)
    cfg, params = load_model(directory, show_progress=False)
    return hf, directory, cfg, params


def _tokens(cfg, seed=1, batch=2, seq=SEQ):
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    hf, _, cfg, params = _model(case)
    arch = CASES[case][0]
    assert cfg.arch == arch and cfg.mla is not None and cfg.moe is not None
    assert cfg.mla.q_lora_rank == CASES[case][1]["q_lora_rank"]
    rope = CASES[case][1].get("rope_parameters", {}).get("rope_type", "default")
    assert cfg.rope_scaling.rope_type == rope
    tokens = _tokens(cfg)
    err = np.abs(np.asarray(forward(cfg, params, tokens)) - hf_logits(hf, tokens)).max()
    assert err <= TOL, f"{case}: max |dlogit| = {err:.3g}"


@pytest.mark.parametrize("case", ["v3-q-lora-grouped", "v3-no-q-lora-yarn"])
def test_absorbed_equals_expanded(case):
    """The whole sequence attended absorbed (over the latent cache, not fresh) against the
    expanded form (one full forward, no cache)."""
    _, _, cfg, params = _model(case)
    tokens = _tokens(cfg, seed=4)
    expanded = np.asarray(forward(cfg, params, tokens))
    kv = MLACache.init(cfg, 2, SEQ)
    lengths = jnp.full((2,), SEQ, jnp.int32)
    absorbed, kv = prefill(
        params, jnp.asarray(tokens), lengths, kv, cfg=cfg, chunked=True, all_logits=True
    )
    err = np.abs(np.asarray(absorbed) - expanded).max()
    assert err <= SELF_TOL, f"{case}: absorbed vs expanded max |dlogit| = {err:.3g}"


@pytest.mark.parametrize("case", ["v3-q-lora-grouped", "v3-no-q-lora-yarn"])
def test_prefill_chunk_decode_match_transformers(case):
    """Right-padded prompts (padding poisoned with real ids) prefilled expanded, a 3-token chunk
    over the cached context and token-by-token decode absorbed, against one transformers
    forward over the whole sequence."""
    hf, _, cfg, params = _model(case)
    tokens = _tokens(cfg, seed=2)
    want = hf_logits(hf, tokens)
    prompt_lens = np.array([5, 8], np.int32)
    kv = MLACache.init(cfg, 2, SEQ)
    padded = np.where(np.arange(8)[None] < prompt_lens[:, None], tokens[:, :8], 3)
    logits, kv = prefill(params, jnp.asarray(padded), jnp.asarray(prompt_lens), kv, cfg=cfg)
    errs = [np.abs(np.asarray(logits) - want[[0, 1], prompt_lens - 1]).max()]
    pos = prompt_lens.copy()
    chunk = np.stack([tokens[row, p : p + 3] for row, p in enumerate(pos)])
    logits, kv = prefill(
        params,
        jnp.asarray(chunk),
        jnp.full((2,), 3, jnp.int32),
        kv,
        cfg=cfg,
        chunked=True,
        all_logits=True,
    )
    for row in range(2):
        errs.append(np.abs(np.asarray(logits[row]) - want[row, pos[row] : pos[row] + 3]).max())
    pos += 3
    while pos.min() < SEQ:
        active = pos < SEQ
        step = tokens[np.arange(2), np.minimum(pos, SEQ - 1)]
        logits, kv = decode(params, jnp.asarray(step), kv, jnp.asarray(active), cfg=cfg)
        for row in np.flatnonzero(active):
            errs.append(np.abs(np.asarray(logits[row]) - want[row, pos[row]]).max())
        pos += active
    np.testing.assert_array_equal(kv.lengths, [SEQ, SEQ])
    err = max(errs)
    assert err <= TOL, f"{case}: max |dlogit| = {err:.3g}"


def test_latent_cache_bytes_per_token():
    _, _, cfg, _ = _model("v3-q-lora-grouped")
    mla = cfg.mla
    for dtype in (jnp.float32, jnp.bfloat16):
        kv = MLACache.init(cfg, 3, 10, dtype)
        per_token = kv.nbytes // (3 * 10)
        itemsize = jnp.dtype(dtype).itemsize
        assert per_token == cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * itemsize
        assert per_token == latent_bytes_per_token(cfg, dtype)
    # DeepSeek-V3's own shapes, bf16: 61 x (512 + 64) x 2 = 70,272 B per token, against
    # 61 x 128 heads x (192 + 128) x 2 = 4,997,120 B for the expanded keys and values.
    full = ModelConfig.from_hf(
        dict(
            model_type="deepseek_v3",
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            n_shared_experts=1,
            first_k_dense_replace=3,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        )
    )
    report = cache_size_report(full, jnp.bfloat16)
    assert report["latent_bytes_per_token"] == 70_272
    assert report["mha_bytes_per_token"] == mha_bytes_per_token(full, jnp.bfloat16) == 4_997_120
    assert round(report["ratio"], 1) == 71.1


def test_orbax_round_trip(tmp_path):
    """A saved jaxgen checkpoint restores the same config and params (the MTP module's loading
    is tested in test_mtp)."""
    _, _, cfg, params = _model("v3-q-lora-grouped")
    save_checkpoint(str(tmp_path / "orbax"), cfg, params)
    cfg2, params2 = load_checkpoint(str(tmp_path / "orbax"))
    assert cfg2 == cfg and cfg2.mla == cfg.mla
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_unsupported_configs_are_typed_errors():
    _, _, cfg, params = _model("v3-q-lora-grouped")
    base = dict(
        model_type="deepseek_v3",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
    )
    linear = dict(rope_type="linear", factor=4.0, rope_theta=1e4)
    with pytest.raises(ValueError, match="supports 'default' and 'yarn' rope only"):
        ModelConfig.from_hf(dict(base, rope_parameters=linear))
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=1e4)
    with pytest.raises(ValueError, match="'yarn' is not supported for 'llama'"):
        ModelConfig.from_hf(dict(base, model_type="llama", rope_parameters=yarn))
    with pytest.raises(ValueError, match="group_limited_greedy"):
        ModelConfig.from_hf(
            dict(base, model_type="deepseek_v2", topk_method="group_limited_greedy")
        )
    with pytest.raises(ValueError, match="MLACache needs an MLA model config"):
        MLACache.init(dataclasses.replace(cfg, arch="llama", moe=None, mla=None), 1, 4)
    with pytest.raises(ValueError, match="build a cache.MLACache"):
        KVCache.init(cfg, 1, 8)
    with pytest.raises(ValueError, match="build a cache.PagedMLACache"):
        PagedKVCache.init(cfg, 4, 4)
    mha_shape = (cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    mha = KVCache(jnp.zeros(mha_shape), jnp.zeros(mha_shape), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="needs a latent cache"):
        prefill(params, jnp.zeros((1, 4), jnp.int32), jnp.array([4]), mha, cfg=cfg, chunked=True)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def _paged_apply(params, tokens, positions, kv, md, *, cfg):
    return Transformer(cfg).apply({"params": params}, tokens, positions, kv, md)


def test_paged_latent_cache_matches_transformers():
    """Pages of 4 permuted over the pool: right-padded prompts prefilled (expanded), a 3-token
    chunk over cached context, then decode (absorbed), against transformers."""
    hf, _, cfg, params = _model("v3-q-lora-grouped")
    rng = np.random.RandomState(5)
    tokens = _tokens(cfg, seed=5)
    want = hf_logits(hf, tokens)
    page_size, pages_per_row = 4, SEQ // 4
    tables = rng.permutation(2 * pages_per_row).reshape(2, pages_per_row).astype(np.int32)
    kv = PagedMLACache.init(cfg, 2 * pages_per_row, page_size)
    assert kv.nbytes == PagedMLACache.bytes_per_page(cfg, page_size) * 2 * pages_per_row

    def step(kv, lens, num_new, width, fresh=False):
        pos = lens[:, None] + np.arange(width, dtype=np.int32)[None]
        valid = np.arange(width)[None] < num_new[:, None]
        slots = tables[np.arange(2)[:, None], np.minimum(pos, SEQ - 1) // page_size] * page_size
        slots = np.where(valid, slots + pos % page_size, -1)
        md = PagedMetadata(
            jnp.asarray(slots, jnp.int32),
            jnp.asarray(tables),
            jnp.asarray(lens),
            jnp.asarray(num_new),
            fresh=fresh,
        )
        step_tokens = np.where(valid, tokens[np.arange(2)[:, None], np.minimum(pos, SEQ - 1)], 3)
        positions = jnp.asarray(np.minimum(pos, SEQ - 1))
        logits, kv = _paged_apply(params, jnp.asarray(step_tokens), positions, kv, md, cfg=cfg)
        errs = [
            np.abs(np.asarray(logits)[row, i] - want[row, pos[row, i]]).max()
            for row in range(2)
            for i in range(num_new[row])
        ]
        return kv, lens + num_new, max(errs)

    lens = np.zeros(2, np.int32)
    kv, lens, err = step(kv, lens, np.array([5, 8], np.int32), 8, fresh=True)
    errs = [err]
    kv, lens, err = step(kv, lens, np.array([3, 3], np.int32), 3)
    errs.append(err)
    while lens.min() < SEQ:
        kv, lens, err = step(kv, lens, (lens < SEQ).astype(np.int32), 1)
        errs.append(err)
    assert max(errs) <= TOL, f"paged: max |dlogit| = {max(errs):.3g}"


def test_tensor_parallel_logits_match_one_device():
    """Heads split over tp=2 after the low-rank bottlenecks (q_b_proj, kv_b_proj, o_proj), experts
    over ep=2."""
    _, _, cfg, params = _model("v3-q-lora-grouped")
    axes = param_logical_axes(params)
    assert axes["layers"]["attn"]["kv_b_proj"]["kernel"] == ("layers", None, "heads")
    tokens = _tokens(cfg, seed=3)
    want = np.asarray(forward(cfg, params, tokens))
    placement = Placement.from_spec(cfg, "tp=2,ep=2")
    with placement.context():
        got = np.asarray(forward(cfg, placement.params(params), tokens))
    np.testing.assert_allclose(got, want, atol=SELF_TOL, rtol=0)


def test_both_forms_run_through_the_flash_kernel():
    """Expanded (head dims padded to max(Hn + Hr, Hv)) and absorbed (one KV head of width
    R + Hr) attention through the dispatch's Pallas flash kernel, in interpret mode here."""
    _, _, cfg, params = _model("v3-no-q-lora-yarn")
    tokens = _tokens(cfg, seed=7)
    ref = np.asarray(forward(cfg, params, tokens))
    expanded = np.asarray(forward(cfg, params, tokens, attn_impl="interpret"))
    np.testing.assert_allclose(expanded, ref, atol=SELF_TOL, rtol=0)
    absorbed, _ = prefill(
        params,
        jnp.asarray(tokens),
        jnp.full((2,), SEQ, jnp.int32),
        MLACache.init(cfg, 2, SEQ),
        cfg=cfg,
        chunked=True,
        all_logits=True,
        attn_impl="interpret",
    )
    np.testing.assert_allclose(np.asarray(absorbed), ref, atol=SELF_TOL, rtol=0)
