"""Tensor, sequence, pipeline and data parallelism on 8 CPU devices: same logits and tokens as
one device, and the collectives we expect in the compiled programs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.bench.sharding import computations, loop_multipliers
from jaxgen.cache import KVCache
from jaxgen.engine.runner import steps
from jaxgen.model import ModelConfig, forward, init_params
from jaxgen.sharding.mesh import make_mesh, parse_mesh_spec
from jaxgen.sharding.pipeline import pipelined_apply
from jaxgen.sharding.placement import Placement

CFG = ModelConfig(
    arch="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)
TOL = 1e-5


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, CFG.vocab_size, (4, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(params, tokens):
    return np.asarray(forward(CFG, params, tokens))


def test_mesh_parsing():
    assert parse_mesh_spec("dp=2,tp=4") == {"data": 2, "model": 4, "seq": 1, "stage": 1}
    with pytest.raises(ValueError, match="unknown mesh axis"):
        parse_mesh_spec("xp=2")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh("tp=16")


@pytest.mark.parametrize(
    "spec", ["tp=2", "tp=4", "tp=8", "sp=2", "sp=4", "dp=2,tp=4", "tp=2,sp=2", "dp=2,tp=2,sp=2"]
)
def test_gspmd_logits_match_one_device(params, tokens, reference, spec):
    placement = Placement.from_spec(CFG, spec)
    sharded = placement.params(params)
    with placement.context():
        got = np.asarray(forward(CFG, sharded, tokens))
    np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "spec,micro", [("pp=2", 2), ("pp=4", 4), ("pp=2", 4), ("dp=2,tp=2,pp=2", 2)]
)
def test_pipeline_logits_match_one_device(params, tokens, reference, spec, micro):
    placement = Placement.from_spec(CFG, spec, microbatches=micro)
    sharded = placement.params(params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    from jaxgen.cache.contiguous import StepMetadata

    md = StepMetadata(num_new=jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32), fresh=True)
    with placement.context():
        fn = jax.jit(
            lambda p, t: pipelined_apply(CFG, placement.pipeline, p, t, positions, None, md)[0]
        )
        got = np.asarray(fn(sharded, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, reference, atol=TOL, rtol=0)
    assert placement.describe()["bubble_fraction"] == pytest.approx(
        (placement.pipeline.stages - 1) / (micro + placement.pipeline.stages - 1)
    )


@pytest.fixture(scope="module")
def greedy_reference(params, default_tokenizer):
    prompts = [[5, 9, 1, 30, 7], [100, 3], [42] * 11, [8, 8, 9]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM.from_parts(
        CFG, params, default_tokenizer, max_num_seqs=4, warmup=False, max_model_len=256
    )
    return prompts, sp, [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.mark.parametrize(
    "spec,kv_cache",
    [
        ("tp=4", "paged"),
        ("tp=8", "contiguous"),
        ("dp=2,tp=2", "paged"),
        ("dp=2,tp=4", "contiguous"),
        ("pp=2", "contiguous"),
        ("dp=2,tp=2,pp=2", "contiguous"),
        ("sp=2", "contiguous"),
    ],
)
def test_greedy_generation_identical(params, default_tokenizer, greedy_reference, spec, kv_cache):
    prompts, sp, want = greedy_reference
    llm = LLM.from_parts(
        CFG,
        params,
        default_tokenizer,
        max_num_seqs=4,
        warmup=False,
        max_model_len=256,
        mesh=spec,
        kv_cache=kv_cache,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want


def hlo_of_decode(params, spec):
    placement = Placement.from_spec(CFG, spec)
    sharded = placement.params(params)
    kv = placement.cache(KVCache.init(CFG, 4, 32))
    with placement.context():
        lowered = steps.decode.lower(
            sharded, jnp.zeros(4, jnp.int32), kv, cfg=CFG, pipeline=placement.pipeline
        )
        return lowered.compile().as_text()


def test_tp_decode_has_two_all_reduces_per_layer_and_no_weight_gathers(params):
    hlo = hlo_of_decode(params, "tp=4")
    comps = computations(hlo)
    loops = loop_multipliers(comps)
    assert CFG.num_layers in loops.values()  # the layer scan, with its trip count
    bodies = [comps[name] for name in loops if "all-reduce" in comps.get(name, "")]
    assert bodies, "no layer loop with all-reduces found"
    per_layer = max(len(re.findall(r"\ball-reduce(?:-start)?\(", b)) for b in bodies)
    assert per_layer == 2
    assert "all-gather" not in hlo  # no weight is gathered


def test_sp_prefill_gathers_keys_and_values(params):
    placement = Placement.from_spec(CFG, "sp=4")
    sharded = placement.params(params)
    kv = placement.cache(KVCache.init(CFG, 4, 32))
    with placement.context():
        hlo = (
            steps.prefill.lower(
                sharded, jnp.zeros((4, 32), jnp.int32), jnp.full((4,), 32, jnp.int32), kv, cfg=CFG
            )
            .compile()
            .as_text()
        )
    assert len(re.findall(r"\ball-gather(?:-start)?\(", hlo)) >= 2  # K and V of each layer


def test_pp_decode_has_stage_collective_permutes(params):
    hlo = hlo_of_decode(params, "pp=2")
    assert re.search(r"\bcollective-permute(?:-start)?\(", hlo)
