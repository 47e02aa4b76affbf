"""Tensor, sequence, pipeline and data parallelism on 8 CPU devices: same logits and tokens as
one device, and the collectives we expect in the compiled programs."""

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
    assert parse_mesh_spec("dp=2,tp=4") == {
        "data": 2,
        "model": 4,
        "expert": 1,
        "seq": 1,
        "stage": 1,
    }
    with pytest.raises(ValueError, match="unknown mesh axis"):
        parse_mesh_spec("xp=2")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh("tp=16")
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="pipeline_microbatches must be an int"):
            Placement.from_spec(CFG, "pp=2", microbatches=bad)


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


# Every mesh serves through the paged continuous-batching engine; the static-batch engine
# (kv_cache="contiguous") keeps a few of its own.
PAGED_MESHES = [
    "tp=4",
    "pp=2",
    "pp=4",
    "sp=2",
    "dp=2,tp=2",
    "dp=2,pp=2",
    "dp=2,sp=2",
    "tp=2,pp=2",
    "tp=2,sp=2",
    "sp=2,pp=2",
    "dp=2,tp=2,pp=2",
    "tp=2,sp=2,pp=2",
]


@pytest.mark.parametrize(
    "spec,kv_cache",
    [(m, "paged") for m in PAGED_MESHES]
    + [
        ("tp=8", "contiguous"),
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
    if kv_cache == "paged" and "pp" in spec:
        # The steps ran pipelined, with more than one microbatch in flight.
        micro = {key[2] for key in llm.compiled if key[0] == "pipelined_paged_step"}
        assert max(micro) > 1, llm.compiled


def _outputs(llm, prompts, sp):
    """Per request: each sample's tokens, its tokens' logprobs, and the prompt logprobs (token
    id -> logprob of each prompt position)."""
    out = []
    for o in llm.generate(prompts, sp):
        tokens = [c.token_ids for c in o.outputs]
        logprobs = [
            [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)] for c in o.outputs
        ]
        prompt = [
            None if d is None else {t: lp.logprob for t, lp in d.items()}
            for d in o.prompt_logprobs or []
        ]
        out.append((tokens, logprobs, prompt))
    return out


def test_pipelined_paged_engine_serves_every_feature(params, default_tokenizer):
    """pp=2 through the paged engine against one device: seeded n=2 sampling, logprobs, prompt
    logprobs, penalties, shared prefixes (prefix cache and copy-on-write forks) and prompts
    prefilled in several chunks, in one run of mixed steps."""
    shared = list(range(1, 40))
    prompts = [shared + [7, 8], shared + [9], [3] * 70, [11, 12, 13], [5, 6]]
    sp = [
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1, logprobs=1),
        SamplingParams(
            temperature=0.7,
            seed=5,
            max_tokens=6,
            ignore_eos=True,
            logprobs=1,
            repetition_penalty=1.3,
            presence_penalty=0.5,
        ),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=7, ignore_eos=True, logprobs=0),
    ]
    kw = dict(max_num_seqs=8, warmup=False, max_model_len=256, max_num_batched_tokens=32)
    one = LLM.from_parts(CFG, params, default_tokenizer, **kw)
    pp = LLM.from_parts(CFG, params, default_tokenizer, mesh="pp=2", **kw)
    want, got = _outputs(one, prompts, sp), _outputs(pp, prompts, sp)
    for (wt, wl, wp), (gt, gl, gp) in zip(want, got, strict=True):
        assert gt == wt
        np.testing.assert_allclose(np.asarray(gl), np.asarray(wl), atol=1e-4)
        assert len(gp) == len(wp)
        for g, w in zip(gp, wp, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                assert sorted(g) == sorted(w)
                np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-4)
    assert sum(len(p) for _, _, p in got) == len(prompts[1])  # prompt logprobs of request 1
    micro = {key[2] for key in pp.compiled if key[0] == "pipelined_paged_step"}
    assert max(micro) > 1, pp.compiled
    # A later request reads the shared prefix's pages from the prefix cache.
    again = (
        [shared + [12]],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),
    )
    assert _outputs(pp, *again) == _outputs(one, *again)
    assert pp.engine.stats()["prefix_hit_rate"] > 0
    with pytest.raises(ValueError, match="speculative decoding does not run with pipeline"):
        LLM.from_parts(
            CFG, params, default_tokenizer, mesh="pp=2", speculative={"method": "ngram"}, **kw
        )


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


def test_static_pipeline_pads_a_batch_to_its_microbatches(params, default_tokenizer):
    """One prompt on pp=2 with the static engine: the batch is padded to whole microbatches
    (it used to raise 'batch 1 is not a multiple of 2 microbatches', warm-up included)."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(max_num_seqs=4, warmup=False, max_model_len=256)
    want = LLM.from_parts(CFG, params, default_tokenizer, **kw).generate([[5, 9, 1]], sp)
    llm = LLM.from_parts(CFG, params, default_tokenizer, mesh="pp=2", kv_cache="contiguous", **kw)
    got = llm.generate([[5, 9, 1]], sp)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
