"""Mixture-of-Experts against transformers (PyTorch, CPU, f32) on tiny random models: Mixtral
and Qwen3-MoE logits through a full forward, prefill + decode through the paged cache and the
engine's greedy tokens; DeepSeek-V3's routed + shared expert block on its own (the whole
DeepSeek-V3 model, with its MLA attention, is tested in test_mla.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.cache import PagedKVCache, PagedMetadata
from jaxgen.model import ModelConfig, forward, load_model, save_checkpoint
from jaxgen.model.config import MoEConfig
from jaxgen.model.llama import Transformer, param_logical_axes
from jaxgen.model.loading import load_checkpoint
from jaxgen.model.moe import MoE, grouped_matmul, route
from jaxgen.sharding.placement import Placement
from tests.helpers import hf_logits, tiny_hf_model

TOL = 1e-4
LAYERS = 3
SEQ = 24

CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-window": (
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=7),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False),
    ),
    # A dense first layer (mlp_only_layers) before the sparse ones: two layer scans.
    "qwen3_moe-dense-first": (
        "qwen3_moe",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
}


def _decisive_routers(model, std=1.0):
    """Router weights at normal(std): transformers' normal(0.02) leaves near-ties that top-k
    may break either way, and a routing that barely depends on the token."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, std)


@functools.cache
def _model(case):
    """(transformers model, its directory, cfg, params) of a case, built once."""
    import tempfile

    arch, overrides = CASES[case]
    directory = tempfile.mkdtemp(prefix=f"jaxgen-moe-{case}-")
    hf = tiny_hf_model(directory, arch, num_hidden_layers=LAYERS, **overrides)
    _decisive_routers(hf)
    hf.save_pretrained(directory)
    cfg, params = load_model(directory, show_progress=False)
    return hf, directory, cfg, params


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    hf, _, cfg, params = _model(case)
    assert cfg.arch == CASES[case][0] and cfg.moe is not None
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, SEQ))
    err = np.abs(np.asarray(forward(cfg, params, tokens)) - hf_logits(hf, tokens)).max()
    assert err <= TOL, f"{case}: max |dlogit| = {err:.3g}"


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_apply(params, tokens, positions, kv, md, *, cfg):
    return Transformer(cfg).apply({"params": params}, tokens, positions, kv, md)


@pytest.mark.parametrize("case", ["mixtral-window", "qwen3_moe-dense-first"])
def test_paged_prefill_then_decode_match_transformers(case):
    """Right-padded prompts of different lengths (padding poisoned with real token ids routed to
    experts too), then token-by-token decode, pages of 4 permuted over the pool."""
    hf, _, cfg, params = _model(case)
    rng = np.random.RandomState(2)
    tokens = rng.randint(0, cfg.vocab_size, (2, SEQ)).astype(np.int32)
    want = hf_logits(hf, tokens)
    page_size, pages_per_row = 4, SEQ // 4
    tables = rng.permutation(2 * pages_per_row).reshape(2, pages_per_row).astype(np.int32)
    kv = PagedKVCache.init(cfg, 2 * pages_per_row, page_size)

    def slots(rows_pos):
        return tables[np.arange(2)[:, None], rows_pos // page_size] * page_size + (
            rows_pos % page_size
        )

    prompt_lens = np.array([5, 11], np.int32)
    width = int(prompt_lens.max())
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), (2, width))
    valid = pos < prompt_lens[:, None]
    md = PagedMetadata(
        jnp.asarray(np.where(valid, slots(pos), -1), jnp.int32),
        jnp.asarray(tables),
        jnp.zeros(2, jnp.int32),
        jnp.asarray(prompt_lens),
        fresh=True,
    )
    padded = np.where(valid, tokens[:, :width], 3)
    logits, kv = _paged_apply(params, jnp.asarray(padded), jnp.asarray(pos), kv, md, cfg=cfg)
    errs = [np.abs(np.asarray(logits)[[0, 1], prompt_lens - 1] - want[[0, 1], prompt_lens - 1])]
    lens = prompt_lens.copy()
    while lens.max() < SEQ:
        step_pos = np.minimum(lens, SEQ - 1)[:, None]
        active = lens < SEQ
        md = PagedMetadata(
            jnp.asarray(np.where(active[:, None], slots(step_pos), -1), jnp.int32),
            jnp.asarray(tables),
            jnp.asarray(lens),
            jnp.asarray(active.astype(np.int32)),
        )
        step = tokens[np.arange(2), step_pos[:, 0]][:, None]
        logits, kv = _paged_apply(params, jnp.asarray(step), jnp.asarray(step_pos), kv, md, cfg=cfg)
        rows = np.flatnonzero(active)
        errs.append(np.abs(np.asarray(logits)[rows, 0] - want[rows, step_pos[rows, 0]]))
        lens = lens + active
    err = max(e.max() for e in errs)
    assert err <= TOL, f"{case}: max |dlogit| = {err:.3g}"


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-dense-first"])
def test_engine_greedy_tokens_match_transformers(case, tmp_path, default_tokenizer):
    """jaxgen.LLM on a saved jaxgen (orbax) checkpoint: greedy tokens equal transformers'
    greedy generate."""
    import torch

    hf, _, cfg, params = _model(case)
    save_checkpoint(str(tmp_path), cfg, params, default_tokenizer)
    prompts = [[5, 9, 17, 33, 2, 64], [100, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    new = 12
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new
            )
        want.append(out[0, len(p) :].tolist())
    llm = LLM(model=str(tmp_path), max_model_len=64, max_num_seqs=4, warmup=False)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want


def test_orbax_round_trip_keeps_moe_config_and_params(tmp_path):
    _, _, cfg, params = _model("qwen3_moe-dense-first")
    save_checkpoint(str(tmp_path), cfg, params)
    cfg2, params2 = load_checkpoint(str(tmp_path))
    assert cfg2 == cfg and cfg2.moe.first_dense_layers == 1
    assert set(params2) == {"embed", "dense_layers", "layers", "final_norm", "lm_head"}
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_tensor_parallel_logits_match_one_device():
    """The expert and shared-expert widths split over tp=2 (experts stay whole on each device)."""
    _, _, cfg, params = _model("qwen3_moe-dense-first")
    axes = param_logical_axes(params)
    assert axes["layers"]["moe"]["experts"]["down_proj"] == (
        "layers",
        "experts",
        "expert_mlp",
        "embed",
    )
    tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 12))
    want = np.asarray(forward(cfg, params, tokens))
    placement = Placement.from_spec(cfg, "tp=2")
    with placement.context():
        got = np.asarray(forward(cfg, placement.params(params), tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_unsupported_layouts_are_typed_errors():
    base = dict(
        model_type="qwen3_moe",
        num_hidden_layers=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    with pytest.raises(ValueError, match="dense layers must all come before"):
        MoEConfig.from_hf(dict(base, decoder_sparse_step=2))
    with pytest.raises(ValueError, match="no sparse layer"):
        MoEConfig.from_hf(dict(base, mlp_only_layers=[0, 1, 2, 3]))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(num_experts=4, num_experts_per_tok=5, intermediate_size=8)
    with pytest.raises(ValueError, match="multiple of n_group"):
        MoEConfig(4, 2, 8, scoring_func="sigmoid", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="topk_method"):
        MoEConfig.from_hf(dict(base, model_type="deepseek_v3", topk_method="greedy"))
    widths = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="needs a MoEConfig"):
        ModelConfig(arch="mixtral", **widths, num_kv_heads=1, head_dim=4)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3's MoE block (routing, bias correction, groups, scaling, shared experts)
# ---------------------------------------------------------------------------------------------
DEEPSEEK = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
)


def _deepseek_block(**overrides):
    import torch
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    hf_cfg = transformers.DeepseekV3Config(**dict(DEEPSEEK, **overrides))
    torch.manual_seed(0)
    block = ds.DeepseekV3MoE(hf_cfg).eval().to(torch.float32)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.normal_(0.0, 0.5)
        # A bias of the scores' size, so selection differs from the unbiased top-k.
        block.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return hf_cfg, block


def _params_of(block, moe: MoEConfig):
    def t(x):
        return x.detach().numpy()

    f = moe.intermediate_size
    gate_up = t(block.experts.gate_up_proj)  # [E, 2F, D]
    params = {
        "router": t(block.gate.weight).T,
        "experts": {
            "gate_proj": gate_up[:, :f].transpose(0, 2, 1),
            "up_proj": gate_up[:, f:].transpose(0, 2, 1),
            "down_proj": t(block.experts.down_proj).transpose(0, 2, 1),
        },
    }
    if moe.score_correction_bias:
        params["e_score_correction_bias"] = t(block.gate.e_score_correction_bias)
    if moe.shared_intermediate_size:
        params["shared_experts"] = {
            name: {"kernel": t(getattr(block.shared_experts, name).weight).T}
            for name in ("gate_proj", "up_proj", "down_proj")
        }
    return params


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)],
    ids=["grouped-normalised-scaled", "ungrouped-raw"],
)
def test_deepseek_v3_block_matches_transformers(overrides):
    import torch

    hf_cfg, block = _deepseek_block(**overrides)
    moe = MoEConfig.from_hf(hf_cfg.to_dict())
    assert moe.scoring_func == "sigmoid" and moe.shared_intermediate_size == 32
    x = np.random.RandomState(0).randn(3, 7, hf_cfg.hidden_size).astype(np.float32)
    with torch.no_grad():
        want = block(torch.as_tensor(x)).numpy()
        _, want_w, want_e = block.gate(torch.as_tensor(x))
    cfg = ModelConfig(
        arch="qwen3_moe",  # any MoE architecture: the block reads only cfg.moe and widths
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        intermediate_size=hf_cfg.intermediate_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        moe=moe,
    )
    params = _params_of(block, moe)
    got = np.asarray(MoE(cfg).apply({"params": params}, jnp.asarray(x)))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    # The selection itself, and each chosen expert's weight (top-k order is not specified).
    logits = x.reshape(-1, hf_cfg.hidden_size) @ params["router"]
    weights, experts = route(jnp.asarray(logits), moe, params.get("e_score_correction_bias"))
    order, want_order = np.argsort(experts, -1), np.argsort(want_e.numpy(), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(experts), order, -1),
        np.take_along_axis(want_e.numpy(), want_order, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(want_w.numpy(), want_order, -1),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize(
    "sizes",
    [
        [0, 1, 0, 0, 1, 0, 0, 0],  # decode, batch 1, top-2: two experts read
        [3, 0, 5, 2, 0, 4, 1, 1],  # batch 8, top-2: JAX's single GEMM
        [20, 0, 25, 3, 6, 0, 3, 0],  # prefill-sized groups, 2 rows past them (come out zero)
    ],
)
def test_grouped_matmul_on_the_cpu_reads_only_the_experts_in_use(sizes):
    """The CPU grouped GEMM equals each row times its own expert's matrix. Fewer rows than
    experts, or at least 8 per expert: a loop over row tiles of the experts in use, with no
    all-experts product (JAX's ragged_dot fallback on the CPU multiplies every row by every
    expert); in between, that fallback's one GEMM (faster there on XLA:CPU)."""
    e = len(sizes)
    m = sum(sizes) + (2 if sum(sizes) > 8 * e else 0)
    rng = np.random.RandomState(e)
    lhs = rng.randn(m, 24).astype(np.float32)
    rhs = rng.randn(e, 24, 40).astype(np.float32)
    expert_of_row = np.repeat(np.arange(e), sizes)
    want = np.zeros((m, 40), np.float32)
    want[: len(expert_of_row)] = np.einsum("mi,mio->mo", lhs[: len(expert_of_row)],
                                           rhs[expert_of_row])  # fmt: skip
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(grouped_matmul)(lhs, rhs, gs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.lax.ragged_dot(lhs, rhs, gs)), want, rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    ours = jax.jit(grouped_matmul).lower(lhs, rhs, gs).compile()
    dense = jax.jit(jax.lax.ragged_dot).lower(lhs, rhs, gs).compile()
    tiled = m < e or m >= 8 * e
    assert ("while" in ours.as_text()) == tiled
    # JAX's fallback: every row times every expert. The loop: a tile times one expert per
    # step (counted once or per step, well under half of that).
    flops = 2 * m * 24 * 40
    assert dense.cost_analysis()["flops"] >= e * flops
    if tiled:
        assert ours.cost_analysis()["flops"] < e * flops / 2
