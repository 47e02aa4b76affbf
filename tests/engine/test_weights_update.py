"""Generation inside a training loop: `LLM.update_weights` / `get_weights` (the same tokens as
an engine loaded with those weights, no compile, no prefix of older weights reused), pause and
resume, sleep and wake-up, and the typed errors of each."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.engine.metrics import CompileCounter
from jaxgen.errors import EnginePaused, EngineSleeping, JaxgenError, WeightsMismatch

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Longer than two 16-token pages, so a repeated prompt would find cached pages.
PROMPTS = [
    "The history of Rome is a long story of kings, consuls, emperors and the people who "
    "lived under them, told by many writers over many centuries",
    "My favourite recipe is a simple soup of beans, onions, garlic and tomatoes, cooked "
    "slowly for an hour with olive oil, salt and a little pepper",
]
OPTIONS = dict(max_model_len=128, max_num_seqs=8, num_kv_pages=64, warmup=False)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@contextlib.contextmanager
def counting_compiles():
    """Yields a `CompileCounter` of the XLA compiles inside the block."""
    counter = CompileCounter().install()
    try:
        yield counter
    finally:
        counter.close()


def perturbed(params, seed):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    return jax.tree.map(
        lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), params
    )


@pytest.fixture(scope="module")
def weights(tiny):
    cfg, params, tok = tiny
    return [params, perturbed(params, 1), perturbed(params, 2)]


@pytest.fixture(scope="module")
def expected(tiny, weights):
    """Greedy tokens of a fresh engine loaded with each set of weights."""
    cfg, _, tok = tiny
    return [
        token_ids(LLM.from_parts(cfg, p, tok, **OPTIONS).generate(PROMPTS, GREEDY)) for p in weights
    ]


@pytest.fixture
def llm(tiny, weights):
    cfg, _, tok = tiny
    return LLM.from_parts(cfg, weights[0], tok, **OPTIONS)


def test_update_weights_matches_fresh_engine_without_compiling(llm, weights, expected):
    assert expected[0] != expected[1] != expected[2]  # the updates change the tokens
    engine = llm.engine
    for _ in range(2):  # the programs of a cold and of a cached prompt, compiled before counting
        hits = engine.bm.prefix_hit_tokens
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[0]
    assert engine.bm.prefix_hit_tokens > hits
    with counting_compiles() as compiles:
        for i in range(20):
            which = 1 + i % 2
            version = llm.update_weights(weights[which])
            assert version == llm.weights_version == i + 1
            assert llm.get_weights() is not None
            # The same leaves: a pointer swap, no copy.
            assert all(
                a is b
                for a, b in zip(
                    jax.tree.leaves(llm.get_weights()), jax.tree.leaves(weights[which]), strict=True
                )
            )
            hits = engine.bm.prefix_hit_tokens
            assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[which]
            # Nothing computed by the older weights was reused ...
            assert engine.bm.prefix_hit_tokens == hits
        # ... while the same prompts under the same weights do reuse their pages.
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[2]
        assert engine.bm.prefix_hit_tokens > hits
    assert compiles.compiles == 0


def test_update_weights_casts_and_reshards_on_device(llm, tiny, weights):
    cfg, _, tok = tiny
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights[1])
    want = token_ids(
        LLM.from_parts(
            cfg, jax.tree.map(lambda a: a.astype(jnp.float32), half), tok, **OPTIONS
        ).generate(PROMPTS, GREEDY)
    )
    llm.update_weights(half)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(llm.get_weights()))
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
    # Host arrays (e.g. read from a file) are placed too.
    llm.update_weights(jax.tree.map(np.asarray, half))
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want


def test_bad_weights_raise_before_device_work(llm, weights, expected):
    p = weights[1]
    missing = {k: v for k, v in p.items() if k != "final_norm"}
    extra = {**p, "lm_head_bias": p["final_norm"]}
    shape = {**p, "final_norm": {"scale": jnp.zeros((3,), jnp.float32)}}
    ints = {**p, "final_norm": {"scale": jnp.zeros(p["final_norm"]["scale"].shape, jnp.int32)}}
    for bad, words in ((missing, "missing"), (extra, "extra"), (shape, "shape"), (ints, "int32")):
        with pytest.raises(WeightsMismatch, match=words):
            llm.update_weights(bad)
    with pytest.raises(WeightsMismatch):
        llm.update_weights([1.0, 2.0])
    assert llm.weights_version == 0
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[0]
    # Shared weights a trainer then donates: a typed error, and the engine takes new ones.
    shared = jax.tree.map(jnp.copy, p)
    llm.update_weights(shared)
    shared["embed"].delete()
    with pytest.raises(JaxgenError, match="deleted"):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights(p)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[1]


def test_pause_modes_and_resume(llm, weights, expected):
    engine = llm.engine
    llm.generate(PROMPTS[:1], GREEDY)
    # keep: running sequences stay, no step runs; after an update they recompute on resume.
    engine.add_requests(llm.processor.make_requests(PROMPTS, GREEDY))
    engine.step()
    running = len(engine.scheduler.running)
    assert running > 0
    llm.pause("keep")
    while engine.has_work:  # only the step in flight lands
        engine.step()
    assert len(engine.scheduler.running) == running
    with pytest.raises(EnginePaused):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights(weights[1])
    llm.resume()
    assert not engine.scheduler.running and engine.scheduler.num_preemptions >= running
    while engine.has_work:
        engine.step()
    # abort: everything is aborted with finish reason "abort", new requests are refused.
    requests = llm.processor.make_requests(PROMPTS, GREEDY)
    engine.add_requests(requests)
    engine.step()
    aborted = llm.pause("abort")
    assert sorted(aborted) == sorted(r.request_id for r in requests)
    assert all(r.outputs[0].finish_reason == "abort" for r in [r.to_output() for r in requests])
    with pytest.raises(EnginePaused, match="abort"):
        engine.add_requests(llm.processor.make_requests(PROMPTS, GREEDY))
    llm.resume()
    # finish: running ones finish, waiting ones wait for resume.
    first = llm.processor.make_requests(PROMPTS[:1], GREEDY)
    engine.add_requests(first)
    engine.step()
    llm.pause("finish")
    later = llm.processor.make_requests(PROMPTS[1:], GREEDY)
    engine.add_requests(later)  # queues
    while engine.has_work:
        engine.step()
    assert first[0].finished and not later[0].finished
    llm.resume()
    while engine.has_work:
        engine.step()
    assert later[0].finished
    assert token_ids([later[0].to_output()]) == [expected[1][1]]
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[1]
    with pytest.raises(JaxgenError, match="pause mode"):
        llm.pause("later")


def test_sleep_and_wake_up_free_and_restore_without_compiling(tiny, weights, expected):
    cfg, _, tok = tiny
    # The engine's own copy of the weights (nothing else holds them).
    own = jax.tree.map(jnp.copy, weights[0])
    llm = LLM.from_parts(cfg, own, tok, **OPTIONS)
    del own
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[0]
    kv_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.engine.kv))
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.get_weights()))
    report = llm.sleep(level=1)
    assert report["device_bytes_before"] - report["device_bytes_after"] >= kv_bytes
    with pytest.raises(EngineSleeping):
        llm.generate(PROMPTS, GREEDY)
    with counting_compiles() as compiles:
        llm.wake_up()
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[0]
    assert compiles.compiles == 0
    report = llm.sleep(level=2)
    freed = report["device_bytes_before"] - report["device_bytes_after"]
    assert freed >= 0.95 * (kv_bytes + weight_bytes)
    assert llm.sleep_level == 2 and llm.get_weights() is None
    with pytest.raises(EngineSleeping, match="update_weights"):
        llm.wake_up()
    with counting_compiles() as compiles:
        llm.update_weights(weights[2])
        llm.wake_up()
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[2]
    assert compiles.compiles == 0


def test_sleep_refuses_running_requests(llm):
    engine = llm.engine
    requests = llm.processor.make_requests(PROMPTS, GREEDY)
    engine.add_requests(requests)
    engine.step()
    with pytest.raises(JaxgenError, match="pause"):
        llm.sleep(1)
    llm.pause("abort")
    llm.sleep(1)
    llm.resume()
    llm.wake_up()
    assert len(token_ids(llm.generate(PROMPTS, GREEDY))) == 2


def test_quantized_engine_quantizes_the_update(tiny, weights, tmp_path):
    """Float weights given to an engine that runs int8: the same tokens as an engine loaded
    (and quantized on load) from those weights."""
    from jaxgen.model import save_checkpoint
    from jaxgen.quant.formats import QArray

    cfg, _, tok = tiny
    for i in (0, 1):
        save_checkpoint(str(tmp_path / str(i)), cfg, weights[i], tok)
    options = dict(OPTIONS, quantization="int8")
    want = token_ids(LLM(str(tmp_path / "1"), **options).generate(PROMPTS, GREEDY))
    llm = LLM(str(tmp_path / "0"), **options)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) != want
    llm.update_weights(weights[1])
    q = llm.get_weights()["layers"]["attn"]["q_proj"]["kernel"]
    assert isinstance(q, QArray) and q.values.dtype == jnp.int8
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == want


def test_kv_tiers_key_on_the_weights_version(tiny, weights, expected):
    """Pages written down a KV tier under older weights are never loaded after an update."""
    cfg, _, tok = tiny
    llm = LLM.from_parts(cfg, weights[0], tok, kv_host_cache_bytes=64 << 20, **OPTIONS)
    bm = llm.engine.bm
    llm.generate(PROMPTS, GREEDY)
    assert llm.engine.flush_kv_tiers() > 0  # the prompts' pages are in the host tier now
    llm.update_weights(weights[1])
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[1]
    assert bm.tier_hit_tokens == 0 and bm.prefix_hit_tokens == 0
    llm.engine.flush_kv_tiers()
    llm.reset_prefix_cache()  # the device forgets: the same weights' pages come from the tier
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected[1]
    assert bm.tier_hit_tokens > 0


def test_update_weights_of_a_moe_model(default_tokenizer):
    """A Mixture-of-Experts model's params (router and stacked experts) update like a dense
    one's: the tokens of a fresh engine with the new weights, nothing compiled."""
    from jaxgen.model import ModelConfig, init_params
    from jaxgen.model.config import MoEConfig

    cfg = ModelConfig(
        arch="qwen3_moe", vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        eos_token_ids=(2,),
        moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=32),
    )  # fmt: skip
    old, new = init_params(cfg, jax.random.key(0)), init_params(cfg, jax.random.key(1))
    assert "router" in str(jax.tree_util.tree_structure(new))
    want = token_ids(
        LLM.from_parts(cfg, new, default_tokenizer, **OPTIONS).generate(PROMPTS, GREEDY)
    )
    llm = LLM.from_parts(cfg, old, default_tokenizer, **OPTIONS)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) != want
    with counting_compiles() as compiles:
        llm.update_weights(new)
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == want
    assert compiles.compiles == 0


def test_update_weights_keeps_the_loaded_lora_adapters(tiny, weights, tiny_adapters):
    """The base weights change under loaded adapters: each row's tokens, with its adapter or
    without, are a fresh LoRA engine's with the new base and the same adapters."""
    cfg, _, tok = tiny
    name, path = next(iter(tiny_adapters.items()))
    rows = [name, None]

    def lora_llm(params):
        llm = LLM.from_parts(cfg, params, tok, enable_lora=True, max_lora_rank=8, **OPTIONS)
        llm.load_lora(name, path)
        return llm

    want = token_ids(lora_llm(weights[1]).generate(PROMPTS, GREEDY, lora_request=rows))
    llm = lora_llm(weights[0])
    before = token_ids(llm.generate(PROMPTS, GREEDY, lora_request=rows))
    assert before != want
    with counting_compiles() as compiles:
        llm.update_weights(weights[1])
        assert token_ids(llm.generate(PROMPTS, GREEDY, lora_request=rows)) == want
    assert compiles.compiles == 0
