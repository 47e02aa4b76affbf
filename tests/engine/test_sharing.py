"""Page sharing at fork on and off (`EngineConfig.share_on_fork`, kept to measure what sharing
saves): the same outputs either way, for n > 1 and beam search, with more pages in use when
the fork copies the parent's pages; and the device page copies the fork relies on."""

import numpy as np
import pytest

from jaxgen import LLM, SamplingParams


def make_llm(tiny, share: bool, **kwargs):
    cfg, params, tok = tiny
    kwargs.setdefault("max_model_len", 512)
    llm = LLM.from_parts(
        cfg, params, tok, warmup=False, enable_prefix_caching=False, page_size=8, **kwargs
    )
    llm.engine.bm.share_on_fork = share  # no sequence runs yet
    return llm


def prompts(num, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 49152, rng.randint(20, 60)).tolist() for _ in range(num)]


def seq_outputs(outs):
    return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]


def assert_same(a, b):
    """Token ids equal; log-probabilities equal to f32 rounding (the two engines run programs
    of different page-copy counts)."""
    assert [[ids for ids, _ in r] for r in a] == [[ids for ids, _ in r] for r in b]
    assert None not in [lp for r in a + b for _, lp in r]
    np.testing.assert_allclose(
        [lp for r in a for _, lp in r], [lp for r in b for _, lp in r], rtol=1e-5, atol=1e-5
    )


@pytest.fixture(scope="module")
def engines(tiny):
    return {
        share: make_llm(tiny, share, max_num_seqs=16, num_kv_pages=256) for share in (True, False)
    }


def run(llm, call):
    """call(llm) -> its outputs, and the engine's counters of that call alone."""
    before = llm.stats()
    llm.engine.peak_pages_used = 0
    out = call(llm)
    stats = llm.stats()
    for key in ("fork_pages_copied", "fork_pages_shared", "preemptions"):
        stats[key] -= before[key]
    assert stats["pages_used"] == 0
    llm.engine.bm.check_invariants()
    return out, stats


def test_n_samples_same_outputs_more_pages_without_sharing(engines):
    ps = prompts(3)
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=5, logprobs=0, ignore_eos=True)
    outs, stats = {}, {}
    for share, llm in engines.items():
        outs[share], stats[share] = run(llm, lambda llm: seq_outputs(llm.generate(ps, sp)))
    assert_same(outs[True], outs[False])
    assert all(len({tuple(ids) for ids, _ in r}) > 1 for r in outs[True])  # samples differ
    on, off = stats[True], stats[False]
    assert on["fork_pages_copied"] == 0
    pages_needed = engines[True].engine.bm.pages_needed
    assert off["fork_pages_copied"] == sum(3 * pages_needed(len(p)) for p in ps)
    assert off["fork_pages_shared"] == 0 and off["preemptions"] == on["preemptions"] == 0
    assert on["peak_pages_used"] < off["peak_pages_used"]


def test_beam_search_same_beams_more_pages_without_sharing(engines):
    ps = prompts(2, seed=1)

    lengths = [10, 7]  # one max_tokens per prompt

    def search(llm):
        out = llm.beam_search(ps, beam_width=4, max_tokens=lengths, ignore_eos=True)
        return [[(h.token_ids, h.cumulative_logprob) for h in o.sequences] for o in out]

    beams, stats = {}, {}
    for share, llm in engines.items():
        beams[share], stats[share] = run(llm, search)
    assert_same(beams[True], beams[False])
    assert all(len(b) == 4 for b in beams[True])
    assert [{len(ids) for ids, _ in b} for b in beams[True]] == [{n} for n in lengths]
    assert stats[True]["fork_pages_copied"] == 0 < stats[False]["fork_pages_copied"]
    assert stats[False]["fork_pages_shared"] == 0 and stats[False]["preemptions"] == 0
    assert stats[True]["peak_pages_used"] < stats[False]["peak_pages_used"]


def test_greedy_siblings_equal_under_preemption_without_sharing(tiny, engines):
    """A pool too small for every copied sibling at once: the copies of preempted children are
    dropped, and every greedy sibling still equals the primary and the sharing engine's."""
    ps = prompts(4, seed=2)
    sp = SamplingParams(n=3, temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
    bm = engines[True].engine.bm
    longest = max(bm.pages_needed(len(p) + sp.max_tokens) for p in ps)
    tight = make_llm(tiny, False, max_num_seqs=16, num_kv_pages=2 * 3 * longest)
    want = seq_outputs(engines[True].generate(ps, sp))
    got, stats = run(tight, lambda llm: seq_outputs(llm.generate(ps, sp)))
    assert_same(want, got)
    assert all(len({tuple(ids) for ids, _ in r}) == 1 for r in got)
    assert stats["preemptions"] > 0 and stats["fork_pages_copied"] > 0


def test_engine_config_switch_reaches_the_block_manager(tiny):
    from jaxgen.engine.config import JaxgenConfig
    from jaxgen.engine.core import LLMEngine

    cfg, params, _ = tiny
    for share in (True, False):
        config = JaxgenConfig.from_options(max_model_len=64, share_on_fork=share, num_kv_pages=8)
        engine = LLMEngine(cfg, params, config)
        assert engine.bm.share_on_fork is share


def test_padded_page_copies_keep_a_copy_into_page_zero(tiny):
    """The copy list is padded to a power of two; the padding must not undo a real copy (an
    XLA scatter's order among repeated target indices is unspecified)."""
    import jax.numpy as jnp

    from jaxgen.cache.paged import PagedKVCache
    from jaxgen.engine.config import EngineConfig
    from jaxgen.engine.runner.packer import StepPacker
    from jaxgen.engine.sched.state import ScheduledStep

    cfg = tiny[0]
    llm = make_llm(tiny, True, max_num_seqs=4)
    packer = StepPacker(cfg, EngineConfig(max_model_len=64), llm.engine.bm, page_blocks=False)
    copies = [(5, 0), (6, 1), (7, 2)]  # three copies: one padding slot
    step = ScheduledStep([], [], [], copies)
    batch, _, shape = packer.pack(step)
    assert shape.num_copies > len(copies)
    kv = PagedKVCache.init(cfg, 8, 8, jnp.float32, None)
    pages = jnp.arange(8, dtype=jnp.float32).reshape(1, 8, 1, 1, 1)
    kv = kv.replace(k=jnp.broadcast_to(pages, kv.k.shape), v=jnp.broadcast_to(pages, kv.v.shape))
    out = kv.copy_pages(jnp.asarray(batch.copy_src), jnp.asarray(batch.copy_dst))
    got = np.asarray(out.k[0, :, 0, 0, 0])
    np.testing.assert_array_equal(got, [5, 6, 7, 3, 4, 5, 6, 7])
