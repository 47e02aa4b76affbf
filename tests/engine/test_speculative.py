"""Speculative decoding: drafters, lossless verification, rollback, and greedy equivalence."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.engine.params import SamplingParams as SP
from jaxgen.engine.sample.sampling import SamplingArrays, row_key
from jaxgen.engine.spec_decode.speculative import ngram_propose, verify
from jaxgen.model import ModelConfig, init_params, save_checkpoint

CFG = ModelConfig(
    arch="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)


def test_ngram_lookup():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert ngram_propose(tokens, 3) == [4, 5, 9]  # the last 3-gram matched at the start
    assert ngram_propose([7, 8, 9], 2) == []
    assert ngram_propose([5, 6, 5], 4, n_max=2) == [6, 5]


@pytest.fixture(scope="module")
def target(default_tokenizer):
    params = jax.tree.map(lambda p: p * 8, init_params(CFG, jax.random.key(1)))
    return CFG, params, default_tokenizer


def make(target, **kw):
    cfg, params, tok = target
    return LLM.from_parts(cfg, params, tok, max_model_len=256, max_num_seqs=4, warmup=False, **kw)


PROMPTS = [[10, 11, 12, 13, 10, 11, 12, 13, 10, 11], [5, 6, 7, 5, 6, 7, 5], [300, 301, 302]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(target):
    return [o.outputs[0].token_ids for o in make(target).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    cfg, params, _ = target
    path = tmp_path_factory.mktemp("target")
    save_checkpoint(str(path), cfg, params)
    return str(path)


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_greedy_speculation_is_token_identical(target, plain, target_dir, tmp_path, method):
    spec = {"method": method, "num_tokens": 4}
    if method == "self":
        spec["num_layers"] = 2
    if method == "draft":  # a different, smaller model with the same vocabulary
        small = ModelConfig(
            **{
                **CFG.__dict__,
                "num_layers": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "head_dim": 8,
            }
        )
        save_checkpoint(str(tmp_path), small, init_params(small, jax.random.key(9)))
        spec["model"] = str(tmp_path)
    llm = make(target, speculative=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == plain
    stats = llm.stats()["speculative"]
    assert stats["drafted"] > 0 and stats["verify_rows"] > 0
    assert llm.engine.bm.num_used_pages == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_equal_to_target_accepts_everything(target, target_dir, temperature):
    llm = make(target, speculative={"method": "draft", "model": target_dir, "num_tokens": 4})
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=3)
    llm.generate(PROMPTS[:2], params)
    stats = llm.stats()["speculative"]
    assert stats["drafted"] > 0
    assert stats["acceptance_rate"] == 1.0


def chi_square(counts, probs):
    n = counts.sum()
    mask = probs > 0
    assert counts[~mask].sum() == 0
    return float(np.sum((counts[mask] - n * probs[mask]) ** 2 / (n * probs[mask])))


def spec_samples(p_logits, q_logits, n, k=2, swap=False):
    """First emitted token of a verify step over n independent keys."""
    vocab = p_logits.shape[-1]
    logits = jnp.broadcast_to(p_logits, (n, k + 1, vocab))
    logq = jax.nn.log_softmax(jnp.broadcast_to(q_logits, (n, k, vocab)), axis=-1)
    keys = np.stack([row_key(i, 0) for i in range(n)])
    draft_keys = jax.vmap(lambda kd: jax.random.fold_in(jax.random.wrap_key_data(kd), 77))(keys)
    drafts = jax.vmap(lambda key, lq: jax.random.categorical(key, lq))(draft_keys, logq)
    sa = SamplingArrays.build([SP(temperature=1.0)] * n, keys)
    if swap:  # the wrong rule: p and q exchanged
        logits, logq = (
            jnp.broadcast_to(q_logits, (n, k + 1, vocab)),
            jax.nn.log_softmax(jnp.broadcast_to(p_logits[:k], (n, k, vocab)), axis=-1),
        )
    acc, nxt, _ = jax.jit(verify)(
        logits,
        drafts.astype(jnp.int32),
        jnp.full((n,), k, jnp.int32),
        logq,
        sa,
        jnp.zeros(n, jnp.int32),
    )
    first = jnp.where(acc > 0, drafts[:, 0], nxt)
    return np.bincount(np.asarray(first), minlength=vocab)


def test_rejection_sampling_is_lossless_and_the_test_catches_a_wrong_rule():
    rng = np.random.RandomState(0)
    vocab = 8
    p_logits = jnp.asarray(rng.randn(3, vocab) * 1.5, jnp.float32)
    q_logits = jnp.asarray(rng.randn(vocab) * 1.5, jnp.float32)
    p0 = np.asarray(jax.nn.softmax(p_logits[0]))
    counts = spec_samples(p_logits, q_logits, 30000)
    # 7 degrees of freedom: the critical value at p = 0.001 is 24.3.
    assert chi_square(counts, p0) < 24.3
    wrong = spec_samples(p_logits, q_logits, 30000, swap=True)
    assert chi_square(wrong, p0) > 24.3  # a swapped p/q is detected


def test_rollback_leaves_the_cache_as_plain_decoding(target):
    """K/V of every token of a finished greedy sequence, speculative vs plain."""

    def run(llm):
        (request,) = llm.processor.make_requests([PROMPTS[0]], GREEDY)
        llm.engine.add_request(request)
        tables = {}
        schedule = llm.engine.scheduler.schedule

        def recording(*args, **kwargs):  # the pages as each step writes them
            step = schedule(*args, **kwargs)
            for s in llm.engine.scheduler.running:
                tables["last"] = list(llm.engine.bm.tables[s.id])
            return step

        llm.engine.scheduler.schedule = recording
        while llm.engine.has_work:
            llm.engine.step()
        table = tables["last"]
        seq = request.seqs[0]
        length = len(seq.prompt_ids) + len(seq.output_ids) - 1  # the last token is never fed
        ps = llm.engine.bm.page_size
        slots = np.asarray([table[i // ps] * ps + i % ps for i in range(length)])
        kv = llm.engine.kv
        flat_k = np.asarray(kv.k).reshape(kv.k.shape[0], -1, *kv.k.shape[3:])
        return seq.output_ids, flat_k[:, slots]

    # Against the row-shaped step, the one speculative decoding runs on (the ragged step
    # attends in another order: its keys differ in the last bits).
    plain_ids, plain_k = run(make(target, enable_prefix_caching=False, ragged_step=False))
    spec_ids, spec_k = run(
        make(target, enable_prefix_caching=False, speculative={"method": "ngram", "num_tokens": 4})
    )
    assert spec_ids == plain_ids
    np.testing.assert_allclose(spec_k, plain_k, atol=2e-5, rtol=0)


@pytest.mark.parametrize("spec", [None, {"method": "self", "num_layers": 2, "num_tokens": 3}])
def test_a_dropped_llm_frees_its_kv_pool_at_once(target, spec):
    """No reference cycle keeps an engine alive: `del llm` frees its KV pool (1 GiB by default
    on a CPU) without waiting for a full collection. A cycle through a callback once let the
    engine tests' process run out of memory."""
    llm = make(target, speculative=spec)
    llm.generate(PROMPTS[:1], GREEDY)
    alive = [weakref.ref(llm), *map(weakref.ref, jax.tree.leaves(llm.engine.kv))]
    gc.disable()
    try:
        del llm
        assert [ref() is None for ref in alive] == [True] * len(alive)
    finally:
        gc.enable()
