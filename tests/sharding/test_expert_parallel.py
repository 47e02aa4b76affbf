"""Expert parallelism on 8 CPU devices: experts split over the mesh's "expert" axis, tokens
exchanged with all-to-all (in the compiled program, with the bytes the buffers' formula gives),
the same logits and greedy tokens as one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.sharding import computations, loop_multipliers
from jaxgen import LLM, SamplingParams
from jaxgen.cache import KVCache
from jaxgen.engine.runner import steps
from jaxgen.model import ModelConfig, forward, init_params
from jaxgen.model.config import MoEConfig
from jaxgen.sharding.placement import Placement

CFG = ModelConfig(
    arch="mixtral",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=96),
)
# DeepSeek-style routing and a dense first layer: two layer scans, shared experts beside.
GROUPED = ModelConfig(
    **{
        **CFG.__dict__,
        "arch": "qwen3_moe",
        "qk_norm": True,
        "moe": MoEConfig(
            num_experts=8,
            num_experts_per_tok=3,
            intermediate_size=48,
            shared_intermediate_size=32,
            scoring_func="sigmoid",
            score_correction_bias=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
            first_dense_layers=1,
        ),
    }
)
TOL = 1e-5


def _params(cfg, seed=0):
    """Random params whose routers are decisive (normal(1)), so routing depends on the token."""
    params = init_params(cfg, jax.random.key(seed))
    layers = params["layers"]["moe"]
    layers["router"] = jax.random.normal(jax.random.key(seed + 1), layers["router"].shape)
    if "e_score_correction_bias" in layers:
        bias = layers["e_score_correction_bias"]
        layers["e_score_correction_bias"] = 0.3 * jax.random.normal(jax.random.key(7), bias.shape)
    return params


@pytest.mark.parametrize(
    "cfg,spec",
    [(CFG, "ep=8"), (CFG, "ep=4,tp=2"), (GROUPED, "dp=2,ep=4"), (GROUPED, "ep=2,tp=2")],
    ids=["mixtral-ep8", "mixtral-ep4-tp2", "grouped-dp2-ep4", "grouped-ep2-tp2"],
)
def test_ep_logits_match_one_device(cfg, spec):
    params = _params(cfg)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 13))  # 26: not 8k tokens
    want = np.asarray(forward(cfg, params, tokens))
    placement = Placement.from_spec(cfg, spec)
    sharded = placement.params(params)
    experts = sharded["layers"]["moe"]["experts"]["gate_proj"]
    ep = placement.mesh.shape["expert"]
    assert experts.addressable_shards[0].data.shape[1] == cfg.moe.num_experts // ep
    assert placement.describe()["expert_parallel"].startswith(f"{cfg.moe.num_experts // ep} ")
    with placement.context():
        got = np.asarray(forward(cfg, sharded, tokens))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def _all_to_all_bytes(body: str) -> int:
    """Bytes each device sends through the all-to-alls of one computation."""
    total = 0
    for line in body.splitlines():
        if not re.search(r"\ball-to-all(?:-start)?\(", line):
            continue
        result = line.split("=", 1)[1].split("all-to-all", 1)[0]
        for _, dims in re.findall(r"\b([fs]32)\[([\d,]*)\]", result):
            total += 4 * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def test_ep_decode_exchanges_tokens_with_all_to_all():
    """Per MoE layer: rows and expert ids out, results back. Each destination's buffer holds
    all M = ceil(T / ep) * k routed rows of a device's token share (nothing can be dropped), so
    a device sends 2 * ep * M * D floats and ep * M ids; experts are never gathered."""
    params = _params(CFG)
    placement = Placement.from_spec(CFG, "ep=4")
    sharded = placement.params(params)
    batch, ep, k, d = 8, 4, CFG.moe.num_experts_per_tok, CFG.hidden_size
    kv = placement.cache(KVCache.init(CFG, batch, 32))
    with placement.context():
        hlo = steps.decode.lower(sharded, jnp.zeros(batch, jnp.int32), kv, cfg=CFG)
        hlo = hlo.compile().as_text()
    comps = computations(hlo)
    loops = loop_multipliers(comps)
    bodies = [n for n in loops if "all-to-all" in comps.get(n, "")]
    assert bodies and all(loops[n] == CFG.num_layers for n in bodies), loops
    m = -(-batch // ep) * k
    want = 4 * (2 * ep * m * d + ep * m)
    assert sum(_all_to_all_bytes(comps[n]) for n in bodies) == want
    # Expert weights stay where they are: only activations ([tokens, D]-sized) are gathered.
    f = CFG.moe.intermediate_size
    assert not re.search(rf"f32\[[\d,]*\b{f}\b[\d,]*\][^\n]*all-gather\(", hlo)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg,spec", [(CFG, "ep=8"), (GROUPED, "dp=2,ep=4")], ids=["mixtral-ep8", "grouped-dp2-ep4"]
)
def test_ep_greedy_tokens_identical_to_one_device(cfg, spec, default_tokenizer):
    """The paged engine on the mesh against the engine on one device."""
    params = _params(cfg, seed=3)
    prompts = [[5, 9, 17, 33, 2, 64], [100, 7], list(range(40, 59))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(max_num_seqs=4, warmup=False, max_model_len=64)

    def run(mesh):
        llm = LLM.from_parts(cfg, params, default_tokenizer, mesh=mesh, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]

    assert run(spec) == run(None)


def test_ep_mesh_errors_are_typed():
    dense = ModelConfig(**{**CFG.__dict__, "arch": "llama", "moe": None})
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        Placement.from_spec(dense, "ep=2")
    six = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(6, 2, 32)})
    with pytest.raises(ValueError, match="must divide the model's 6 experts"):
        Placement.from_spec(six, "ep=4")
