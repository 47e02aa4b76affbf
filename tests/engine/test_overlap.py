"""The overlapped engine loop (step N+1 dispatched before step N is read back) gives exactly
the outputs of the synchronous one: greedy and seeded sampling, stops that waste a row, n > 1,
logprobs, prompt logprobs, prefix caching, preemption, aborts, beam search, penalties and
speculative decoding (the last three run their steps synchronously)."""

import numpy as np

from jaxgen import LLM, SamplingParams
from jaxgen.cache.block_manager import PENDING, BlockManager
from jaxgen.engine.sample.sampling import row_key, row_keys

VOCAB = 49152  # the `tiny` fixture's (tests/engine/conftest.py)


def pair(tiny, **kwargs):
    """The same engine twice: overlap on, overlap off."""
    cfg, params, tok = tiny
    kwargs = dict(dict(max_model_len=512, warmup=False, max_num_seqs=8), **kwargs)
    return (
        LLM.from_parts(cfg, params, tok, overlap=True, **kwargs),
        LLM.from_parts(cfg, params, tok, overlap=False, **kwargs),
    )


def summary(outputs):
    """Tokens, text and finish of every completion, exactly; the log-probabilities (which may
    differ in the last float bits: the two loops batch rows into steps differently once a
    sequence stops) with the tokens they name, and their values and ranks apart."""
    exact, values, ranks = [], [], []

    def entries(table):
        for entry in table or []:
            for token, lp in (entry or {}).items():
                exact.append(token)
                values.append(lp.logprob)
                ranks.append(lp.rank)

    for o in outputs:
        for c in o.outputs:
            exact.append((c.token_ids, c.text, c.finish_reason, c.stop_reason))
            values.append(c.cumulative_logprob or 0.0)
            entries(c.logprobs)
        entries(o.prompt_logprobs)
    return exact, np.asarray(values), np.asarray(ranks)


def assert_same(got, want):
    (exact, values, ranks), (want_exact, want_values, want_ranks) = summary(got), summary(want)
    assert exact == want_exact
    np.testing.assert_allclose(values, want_values, rtol=1e-5, atol=1e-5)
    # A rank counts the logits above the token's. Near the top (the sampled tokens and the
    # top-k alternatives) they are far apart and the rank is exact. A prompt token deep in this
    # random model's 49152-token vocabulary sits among logits ~1e-4 apart, so last-bit noise can
    # move a neighbour across it (CI, newest JAX: rank 15154 vs 15155).
    top = want_ranks <= 20
    np.testing.assert_array_equal(ranks[top], want_ranks[top])
    assert np.abs(ranks - want_ranks).max(initial=0) <= 2, (ranks, want_ranks)


def prompts(num, seed=0, longest=40):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, VOCAB, rng.randint(2, longest)).tolist() for _ in range(num)]


def test_mixed_features_are_identical_and_overlapped(tiny):
    on, off = pair(tiny)
    ps = prompts(12)
    # Stopping on tokens two greedy requests emit early makes sequences end at different
    # steps: the overlapped loop has already dispatched a row for them, which it must drop.
    probe = off.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = [probe[0].outputs[0].token_ids[3], probe[6].outputs[0].token_ids[5]]
    params = [
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stops),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=14, seed=7, n=3),
        SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=12, min_tokens=6, seed=11),
        SamplingParams(temperature=0, max_tokens=9, logit_bias={5: 30.0}, ignore_eos=True),
        SamplingParams(temperature=0.7, best_of=3, n=2, max_tokens=8, seed=3),
    ] * 2
    want = off.generate(ps, params)
    got = on.generate(ps, params)
    assert_same(got, want)
    finished_early = sum(c.finish_reason == "stop" for o in want for c in o.outputs)
    assert sum(len(c.logprobs or []) for o in want for c in o.outputs) >= 20
    assert finished_early >= 2, "the workload should stop some sequences on a token"
    assert on.stats()["overlapped_steps"] > on.stats()["steps"] // 2
    assert off.stats()["overlapped_steps"] == 0
    for llm in (on, off):
        assert llm.stats()["pages_used"] == 0
        llm.engine.bm.check_invariants()
    # Prefix caching under overlap: the same prompts again hit the cached pages, same tokens.
    again = on.generate(ps, params)
    assert_same(again, want)
    assert on.stats()["prefix_hit_rate"] > 0


def test_preemption_and_abort_under_overlap(tiny):
    on, off = pair(tiny, max_num_seqs=12, num_kv_pages=40)
    ps = prompts(12, seed=5, longest=60)
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    want = off.generate(ps, params)
    got = on.generate(ps, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert on.stats()["preemptions"] > 0 and on.stats()["overlapped_steps"] > 0
    assert on.stats()["pages_used"] == 0
    on.engine.bm.check_invariants()
    # An abort while a step is in flight: the rest finish, nothing leaks.
    engine = on.engine
    requests = on.processor.make_requests(ps[:4], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_requests(requests)
    for _ in range(6):
        engine.step()
    assert engine._flight is not None
    assert engine.abort(requests[1].request_id)
    while engine.has_work:
        engine.step()
    assert requests[1].seqs[0].finish_reason == "abort"
    assert all(len(r.seqs[0].output_ids) == 30 for r in requests if r is not requests[1])
    assert engine.bm.num_used_pages == 0
    engine.bm.check_invariants()


def test_synchronous_features_keep_working_with_overlap_on(tiny):
    on, off = pair(tiny)
    ps = prompts(4, seed=2)
    penalised = SamplingParams(
        temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5
    )
    assert_same(on.generate(ps, penalised), off.generate(ps, penalised))
    beams = [llm.beam_search(ps[:2], beam_width=3, max_tokens=6) for llm in (on, off)]
    assert [[h.token_ids for h in b.sequences] for b in beams[0]] == [
        [h.token_ids for h in b.sequences] for b in beams[1]
    ]
    assert on.stats()["overlapped_steps"] == 0  # penalties and beams run synchronously
    spec_on, spec_off = pair(tiny, speculative={"method": "ngram", "num_tokens": 3})
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert_same(spec_on.generate(ps, greedy), off.generate(ps, greedy))
    assert_same(spec_on.generate(ps, greedy), spec_off.generate(ps, greedy))


def test_a_pending_token_page_is_hashed_only_once_its_token_is_known():
    bm = BlockManager(num_pages=8, page_size=4)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    bm.append("a", PENDING)  # the slot of a token still being sampled
    bm.mark_computed("a", 4)  # the step writing its K/V is dispatched
    assert bm.num_cached_pages == 0  # not hashed with a placeholder in it
    bm.set_token("a", 3, 9)
    bm.mark_computed("a", 4)
    assert bm.num_cached_pages == 1
    assert bm.allocate("b", [1, 2, 3, 9, 5]) == 4  # a later prompt reuses it
    bm.set_token("a", 10, 0)  # no slot holds position 10: nothing changes
    bm.check_invariants()


def test_row_keys_equal_row_key():
    seeds = [0, 1, 2**31, 2**32 - 1, 2**32, 12345678901234, 2**63 - 1]
    index = [0, 1, 2, 0, 5, 3, 1]
    want = np.stack([row_key(s, i) for s, i in zip(seeds, index, strict=True)])
    np.testing.assert_array_equal(row_keys(seeds, index), want)


def test_a_step_that_compiles_lands_the_step_in_flight_first(tiny):
    """A step whose program compiles (or loads) first hands the step in flight back before it:
    those tokens are not held behind the compile, and the step log charges the compile to the
    step that needed it. The outputs stay the synchronous loop's."""
    on, off = pair(tiny)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    on.generate(prompts(1, seed=3), params)  # the engine, and a first few programs
    engine = on.engine
    counts = {"launched": 0, "landed": 0}
    in_flight = []  # steps in flight when a program was compiled
    launch, land, note = engine._launch, engine._land, engine.runner.note

    def spy_launch(step, prev):
        out = launch(step, prev)
        counts["launched"] += 1
        return out

    def spy_land(flight):
        counts["landed"] += 1
        return land(flight)

    class SpyNote:
        def __getattr__(self, name):
            return getattr(note, name)

        def __call__(self, *key):
            return note(*key)

        def compiled(self, seconds):  # right after the step's program compiled and ran
            in_flight.append(counts["launched"] - counts["landed"])
            note.compiled(seconds)

    engine._launch, engine._land, engine.runner.note = spy_launch, spy_land, SpyNote()
    ps = prompts(6, seed=4, longest=60)
    # Sequences ending at different steps: the decode batch shrinks to new shapes mid-run.
    mixed = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    assert_same(on.generate(ps, mixed), off.generate(ps, mixed))
    assert len(in_flight) >= 2 and on.stats()["overlapped_steps"] > 0
    assert in_flight == [0] * len(in_flight)
