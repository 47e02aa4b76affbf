"""The scheduler under random arrivals, aborts and lengths, against a fake model step; page
accounting is checked after every step (hypothesis)."""

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from jaxgen.cache.block_manager import BlockManager
from jaxgen.engine.detokenizer import IncrementalDetokenizer
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.request import Request
from jaxgen.engine.sched.scheduler import RUNNING, Scheduler
from jaxgen.engine.sched.sequence import Sequence


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def make_request(rid, prompt, max_tokens, n):
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [
        Sequence(
            str(rid), i, list(prompt), params, frozenset(), IncrementalDetokenizer(FakeTokenizer())
        )
        for i in range(n)
    ]
    return Request(str(rid), None, list(prompt), params, seqs, 0.0)


def fake_step(sched: Scheduler, step):
    """Deterministic 'model': the next token is a hash of the row's visible tokens."""
    rows = step.decode + step.prefill + step.samples
    tokens = np.array([(sum(r.state.tokens[: r.end]) + r.state.seq.index) % 50 + 3 for r in rows])
    return list(sched.update(step, tokens, lambda r: (0.0, 1, [])))


def check(sched: Scheduler):
    bm = sched.bm
    bm.check_invariants()
    for s in sched.running:
        assert s.status == RUNNING and s.id in bm.tables
        assert len(bm.tokens[s.id]) in (len(s.tokens), len(s.tokens) - 1)
        assert s.num_computed <= len(s.tokens)
    for s in sched.waiting:
        assert s.id not in bm.tables  # waiting sequences hold no pages
    assert len(sched.running) <= sched.max_num_seqs


events = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(
    events=events,
    num_pages=st.integers(6, 40),
    budget=st.integers(1, 64),
    prefix_caching=st.booleans(),
)
def test_random_workloads_keep_page_accounting(events, num_pages, budget, prefix_caching):
    sched = Scheduler(
        BlockManager(num_pages, 4, prefix_caching),
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        token_bucket=lambda n: 1 << (n - 1).bit_length(),
    )
    requests = []
    for event in events:
        if event[0] == "add":
            _, plen, max_tokens, n = event
            try:
                sched.check_fits(plen, max_tokens)
            except ValueError:
                continue
            prompt = [(len(requests) * 7 + i) % 20 + 3 for i in range(plen)]  # shared prefixes
            requests.append(make_request(len(requests), prompt, max_tokens, n))
            sched.add(requests[-1])
        elif event[0] == "abort" and requests:
            sched.abort(requests[event[1] % len(requests)].request_id)
        else:
            for _ in range(event[1]):
                fake_step(sched, sched.schedule())
                check(sched)
    for _ in range(2000):  # drain
        if not sched.has_work:
            break
        step = sched.schedule()
        assert not step.empty or not sched.running  # progress whenever something runs
        fake_step(sched, step)
        check(sched)
    assert not sched.has_work
    assert sched.bm.num_used_pages == 0 and sched.bm.num_free_pages == num_pages
    for r in requests:
        for s in r.seqs:
            assert s.finish_reason in ("length", "abort")
            if s.finish_reason == "length":
                assert len(s.output_ids) == r.params.max_tokens
