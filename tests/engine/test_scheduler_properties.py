"""The scheduler under random arrivals, aborts and lengths, against a fake model step, in the
engine's synchronous and overlapped loops; page accounting is checked after every step and
every finished sequence holds exactly the tokens the fake model gives it alone (hypothesis)."""

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from jaxgen.cache.block_manager import BlockManager
from jaxgen.engine.detokenizer import IncrementalDetokenizer
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.request import Request
from jaxgen.engine.sched.scheduler import Scheduler
from jaxgen.engine.sched.sequence import RUNNING, Sequence


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


def next_token(tokens, index):
    """Deterministic 'model': the next token is a hash of the sequence's tokens so far."""
    return (sum(tokens) + index) % 50 + 3


def land(sched: Scheduler, step):
    """The fake step's results, handed back. Computed now, when every token before each row's
    end is known (a pending one was filled in when the step before landed)."""
    rows = step.decode + step.prefill + step.samples
    tokens = np.array([next_token(r.state.tokens[: r.end], r.state.seq.index) for r in rows])
    return list(sched.update(step, tokens, lambda r: (0.0, 1, [])))


class Loop:
    """`LLMEngine.step` over the fake model: a launched step stays in flight across the next
    schedule when `overlap` (and the next schedule cannot preempt)."""

    def __init__(self, sched: Scheduler, overlap: bool):
        self.sched, self.overlap, self.flight = sched, overlap, None

    def step(self) -> bool:
        """One iteration; False if it neither launched nor landed anything."""
        sched, flight, self.flight = self.sched, self.flight, None
        if flight is not None and not sched.decodes_fit():
            land(sched, flight)
            flight = None
        step = sched.schedule()
        for row in step.prefill[1:]:  # only a step's first row is a prompt's first chunk cut short
            assert row.start > 0 or row.end == len(row.state.tokens), (row.start, row.end)
        if not step.empty:
            sched.launch(step)
        if flight is not None:
            land(sched, flight)
        if not step.empty:
            if self.overlap:
                self.flight = step
            else:
                land(sched, step)
        return not step.empty or flight is not None


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


@settings(max_examples=150, deadline=None)
@given(
    events=events,
    num_pages=st.integers(6, 40),
    budget=st.integers(1, 64),
    prefix_caching=st.booleans(),
    overlap=st.booleans(),
)
def test_random_workloads_keep_page_accounting(events, num_pages, budget, prefix_caching, overlap):
    sched = Scheduler(
        BlockManager(num_pages, 4, prefix_caching),
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        token_bucket=lambda n: 1 << (n - 1).bit_length(),
    )
    loop = Loop(sched, overlap)
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
                loop.step()
                check(sched)
    for _ in range(2000):  # drain
        if not sched.has_work and loop.flight is None:
            break
        assert loop.step() or not sched.running  # progress whenever something runs
        check(sched)
    assert not sched.has_work and loop.flight is None
    assert sched.bm.num_used_pages == 0 and sched.bm.num_free_pages == num_pages
    for r in requests:
        for s in r.seqs:
            assert s.finish_reason in ("length", "abort")
            if s.finish_reason == "length":
                want = list(r.prompt_ids)
                for _ in range(r.params.max_tokens):
                    want.append(next_token(want, s.index))
                assert s.output_ids == want[len(r.prompt_ids) :]


def test_a_prompt_is_not_cut_to_an_earlier_rows_chunk():
    """A prompt that would be cut to the chunk length of the step's first prefill row waits to
    lead the next step, whole (a short chunk would leave a remainder with cached context, a
    costlier program), and the prompts behind it wait too (first come, first served)."""
    sched = Scheduler(
        BlockManager(64, 16, False),
        max_num_seqs=8,
        max_num_batched_tokens=512,
        token_bucket=lambda n: max(16, 1 << (n - 1).bit_length()),
    )
    for i, plen in enumerate((11, 279, 12)):
        sched.add(make_request(i, [(i + j) % 20 + 3 for j in range(plen)], 4, 1))
    spans = []
    for _ in range(3):
        step = sched.schedule()
        spans.append([(r.state.seq.request_id, r.start, r.end) for r in step.prefill])
        sched.launch(step)
        land(sched, step)
    # Before: step 1 held ("0", 0, 11) and ("1", 0, 16), then ("1", 16, 279) ran alone with
    # 16 tokens of cached context.
    assert spans == [[("0", 0, 11)], [("1", 0, 279)], [("2", 0, 12)]]
    # A prompt whose prefix is cached (as a decode instance's handed-off prompt is, all but
    # its tail) is not a fresh row: it joins, its uncached tokens cut to the chunk length.
    sched = Scheduler(BlockManager(64, 16, True), max_num_seqs=8, max_num_batched_tokens=512,
                      token_bucket=lambda n: max(16, 1 << (n - 1).bit_length()))  # fmt: skip
    shared = [(j * 3) % 20 + 3 for j in range(100)]
    sched.add(make_request(0, shared[:40], 4, 1))
    step = sched.schedule()
    sched.launch(step)
    land(sched, step)
    while sched.has_work:  # the first finishes; its prompt's pages stay cached
        step = sched.schedule()
        sched.launch(step)
        land(sched, step)
    sched.add(make_request(1, [5] * 11, 4, 1))
    sched.add(make_request(2, shared, 4, 1))
    step = sched.schedule()
    assert [(r.state.seq.request_id, r.start, r.end) for r in step.prefill] == [
        ("1", 0, 11),
        ("2", 32, 48),
    ]
    # Two short prompts still share a step.
    sched = Scheduler(BlockManager(64, 16, False), max_num_seqs=8, max_num_batched_tokens=512,
                      token_bucket=lambda n: max(16, 1 << (n - 1).bit_length()))  # fmt: skip
    for i, plen in enumerate((11, 14)):
        sched.add(make_request(i, [(i + j) % 20 + 3 for j in range(plen)], 4, 1))
    step = sched.schedule()
    assert [(r.start, r.end) for r in step.prefill] == [(0, 11), (0, 14)]


class _Cfg:  # what the packer reads of a model config
    vocab_size = 64


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 3)), min_size=1, max_size=6),
    budget=st.integers(4, 48),
    microbatches=st.integers(2, 3),
)
def test_microbatches_pack_each_row_as_the_whole_step_does(lens, budget, microbatches):
    """A pipelined step's microbatches hold every row of the step once, with the tokens,
    positions, slots, stop ids and keys the unsplit step gives it; n > 1 siblings stay with
    the row they sample from, and every page copy runs."""
    from jaxgen.engine.config import EngineConfig
    from jaxgen.engine.runner.packer import StepPacker

    sched = Scheduler(
        BlockManager(64, 4, True),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        token_bucket=lambda n: 1 << (n - 1).bit_length(),
    )
    packer = StepPacker(
        _Cfg(), EngineConfig(max_model_len=64, max_num_seqs=8), sched.bm, page_blocks=False
    )
    for i, (plen, n) in enumerate(lens):
        request = make_request(i, [(i * 5 + j) % 20 + 3 for j in range(plen)], 6, n)
        for seq in request.seqs:
            seq.key = np.asarray([i, seq.index], np.uint32)
        sched.add(request)
    while sched.has_work:
        step = sched.schedule()
        whole, whole_sa, _ = packer.pack(step)
        batch, sa, shape, parts, rows = packer.pack_microbatches(step, microbatches)
        order = step.decode + step.prefill + step.samples
        assert len(parts) == batch.tokens.shape[0] <= microbatches
        assert sorted(map(tuple, rows.tolist())) == sorted(
            (m, j)
            for m, p in enumerate(parts)
            for j in range(len(p.decode + p.prefill + p.samples))
        )
        for r, (m, j) in enumerate(rows):
            if order[r].sample_of is not None:
                assert order[r].sample_of in parts[m].decode + parts[m].prefill
            w, g = whole.logit_index[r], batch.logit_index[m, j]
            assert batch.tokens[m, g] == whole.tokens[w]
            assert batch.positions[m, g] == whole.positions[w]
            assert batch.md.slot_mapping[m, g] == whole.md.slot_mapping[w]
            assert (batch.stop_ids[m, j] == whole.stop_ids[r]).all()
            assert (sa.keys[m, j] == whole_sa.keys[r]).all()
            assert batch.row_step[m, j] == whole.row_step[r]
        slots = batch.md.slot_mapping
        assert sorted(slots[slots >= 0].tolist()) == sorted(
            whole.md.slot_mapping[whole.md.slot_mapping >= 0].tolist()
        )
        copies = set(
            zip(batch.copy_src.ravel().tolist(), batch.copy_dst.ravel().tolist(), strict=True)
        )
        assert set(step.copies) <= copies
        sched.launch(step)
        land(sched, step)
