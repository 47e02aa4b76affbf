"""The disaggregation planner: latency-model fits, the discrete-event simulator on inputs whose
TTFT/TPOT can be worked out by hand, goodput search, traces, typed errors."""

import dataclasses
import json
import random
import subprocess
import sys

import pytest

from benchmarks.disagg import planner, search, simulator, traces
from benchmarks.disagg.planner import LatencyModel, PlanningError
from benchmarks.disagg.simulator import Request
from jaxgen.errors import JaxgenError


def fixed_model(**kw) -> LatencyModel:
    """prefill = 0.1 + 0.001 s/token; decode step = 0.02 + 0.001 s/seq; transfer = 0.05 s +
    1 ns/byte with 1000 bytes per token (1 us per token)."""
    args = dict(
        prefill=(0.1, 0.001, 0.0),
        decode=(0.02, 0.001, 0.0),
        transfer=(0.05, 1e-9),
        kv_bytes_per_token=1000,
        max_kv_tokens=100_000,
        max_num_seqs=64,
        max_batched_tokens=4096,
    )
    return LatencyModel(**{**args, **kw})


def test_fit_recovers_known_coefficients():
    rng = random.Random(0)
    true_pre, true_dec = (0.01, 2e-5, 3e-9), (0.013, 7e-5, 6e-8)
    pre = []
    for _ in range(40):
        lens = [rng.randint(16, 4096) for _ in range(rng.randint(1, 4))]
        t = true_pre[0] + true_pre[1] * sum(lens) + true_pre[2] * sum(n * n for n in lens)
        pre.append((lens, t * (1 + rng.gauss(0, 0.005))))
    fit = planner.fit_prefill(pre)
    for got, want in zip(fit.coef, true_pre, strict=True):
        assert got == pytest.approx(want, rel=0.05)
    assert fit.rel_rms < 0.01
    dec = []
    for _ in range(40):
        b = rng.randint(1, 256)
        ctx = b * rng.randint(16, 4096)
        dec.append((b, ctx, true_dec[0] + true_dec[1] * b + true_dec[2] * ctx))
    fit = planner.fit_decode(dec)
    for got, want in zip(fit.coef, true_dec, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert fit.rel_max < 1e-9
    fit = planner.fit_transfer([(n, 1e-4 + n / 10e9) for n in (1e3, 1e5, 1e7, 1e9)])
    assert fit.coef[0] == pytest.approx(1e-4, rel=1e-6)
    assert 1 / fit.coef[1] == pytest.approx(10e9, rel=1e-6)


def test_fit_of_logged_steps_recovers_the_mixed_model():
    """Steps as `serve --step-log` writes them (prefill-only, decode-only and mixed), timed by
    a known model's `mixed_seconds`: the joint fit gives that model back."""
    rng = random.Random(1)
    want = fixed_model(prefill=(0.02, 3e-4, 2e-7), decode=(0.02, 4e-3, 5e-6))
    records = []
    for _ in range(60):
        chunks = [(rng.randint(1, 300), rng.choice((0, 16, 256))) for _ in range(rng.randint(0, 3))]
        batch = rng.randint(0 if chunks else 1, 8)
        context = sum(rng.randint(10, 900) for _ in range(batch))
        seconds = want.mixed_seconds(chunks, batch, context)
        records.append(dict(chunks=chunks, decode_rows=batch, decode_context=context,
                            seconds=seconds))  # fmt: skip
    fit = planner.fit_steps(records)
    assert fit.rel_max < 1e-9
    got = LatencyModel.from_steps(fit, transfer=want.transfer, kv_bytes_per_token=1000,
                                  max_kv_tokens=100_000)  # fmt: skip
    assert got.prefill == pytest.approx(want.prefill, rel=1e-6)
    assert got.decode == pytest.approx(want.decode, rel=1e-6)


def test_client_overhead_adds_to_every_ttft():
    m = fixed_model()
    reqs = [Request(0.0, 100, 5), Request(0.01, 300, 3)]
    for run in (
        lambda **kw: simulator.simulate_colocated(reqs, m, 1, **kw),
        lambda **kw: simulator.simulate_disaggregated(reqs, m, m, tail_page=16, **kw),
    ):
        base, shifted = run(), run(overhead=0.25)
        for b, s in zip(base, shifted, strict=True):
            assert s.ttft == pytest.approx(b.ttft + 0.25)
            assert (s.tpot, s.finish) == (b.tpot, b.finish)  # outside the engines' steps
    with pytest.raises(PlanningError, match="overhead"):
        simulator.simulate_colocated(reqs, m, overhead=-1.0)


def test_fit_errors():
    with pytest.raises(PlanningError):
        planner.fit_decode([(1, 10, 0.1)])  # fewer samples than coefficients
    with pytest.raises(PlanningError):
        planner.fit_transfer([(1, 0.1), (2, 0.0)])  # a non-positive time


def test_one_request_colocated_by_hand():
    m = fixed_model()
    (o,) = simulator.simulate_colocated([Request(1.0, 100, 5)], m)
    # Prefill of 100 tokens: 0.1 + 0.1 = 0.2 s, then 4 decode steps of 0.021 s.
    assert o.ttft == pytest.approx(0.2)
    assert o.tpot == pytest.approx(0.021)
    assert o.finish == pytest.approx(1.0 + 0.2 + 4 * 0.021)


def test_chunked_prefill_by_hand():
    # A 300-token prompt in chunks of 128, 128, 44 (budget 128): three prefill steps.
    m = fixed_model(max_batched_tokens=128)
    (o,) = simulator.simulate_colocated([Request(0.0, 300, 1)], m)
    assert o.ttft == pytest.approx(3 * 0.1 + 0.001 * 300)
    assert o.tpot == 0.0
    # With the quadratic term, chunks at offsets sum to the whole prompt's L^2.
    m2 = fixed_model(prefill=(0.1, 0.0, 1e-6), max_batched_tokens=128)
    (o,) = simulator.simulate_colocated([Request(0.0, 300, 1)], m2)
    assert o.ttft == pytest.approx(3 * 0.1 + 1e-6 * 300**2)


def test_one_request_disaggregated_by_hand():
    m = fixed_model()
    (o,) = simulator.simulate_disaggregated([Request(0.0, 100, 5)], m, m)
    transfer = 0.05 + 100 * 1000 * 1e-9
    assert o.ttft == pytest.approx(0.2 + transfer)  # the first token leaves after the KV
    assert o.tpot == pytest.approx(0.021)


def test_decode_instance_computing_the_last_partial_page_by_hand():
    """jaxgen's deployment (KV in whole pages through the store): the decode instance prefills
    the prompt's last partial page (100 tokens, pages of 16: 4 tokens) before the first token,
    one page when the prompt fills its pages exactly."""
    m = fixed_model()
    transfer = 0.05 + 100 * 1000 * 1e-9
    (o,) = simulator.simulate_disaggregated([Request(0.0, 100, 5)], m, m, tail_page=16)
    assert o.ttft == pytest.approx(0.2 + transfer + m.prefill_seconds([(4, 96)]))
    assert o.tpot == pytest.approx(0.021)
    (o,) = simulator.simulate_disaggregated([Request(0.0, 96, 1)], m, m, tail_page=16)
    transfer = 0.05 + 96 * 1000 * 1e-9
    assert o.ttft == pytest.approx(m.prefill_seconds([(96, 0)]) + transfer
                                   + m.prefill_seconds([(16, 80)]))  # fmt: skip


def test_decode_interference_colocated_vs_disaggregated():
    """A long prompt arriving during a decode stalls it when colocated (TPOT rises by the
    prefill chunk's time), not when disaggregated."""
    m = fixed_model(max_batched_tokens=4096)
    reqs = [Request(0.0, 10, 11), Request(0.05, 2000, 2)]
    colo = simulator.simulate_colocated(reqs, m)
    dis = simulator.simulate_disaggregated(reqs, m, m, 1, 1)
    assert dis[0].tpot == pytest.approx(0.021)
    assert colo[0].tpot > dis[0].tpot + 0.1  # one step carried the 2000-token prefill (2.1 s)


def test_mixed_steps_by_hand():
    m = fixed_model()
    reqs = [Request(0.0, 100, 3), Request(0.0, 100, 3)]
    a, b = simulator.simulate_colocated(reqs, m)
    # A's prefill starts alone (0.2 s: B arrives as the step launches). Step 2 mixes A's decode
    # and B's prefill: one fixed cost max(0.1, 0.02) + 0.1 + 0.001 = 0.201 s. Step 3 decodes
    # both (0.022 s), A is done; step 4 decodes B alone (0.021 s).
    assert a.ttft == pytest.approx(0.2)
    assert b.ttft == pytest.approx(0.401)
    assert a.tpot == pytest.approx((0.423 - 0.2) / 2)
    assert b.tpot == pytest.approx((0.444 - 0.401) / 2)


PAD = planner.Padding((16, 32, 64, 128, 256, 512), (1, 2, 4, 8), page_size=16)


def test_padded_steps_by_hand():
    """An engine that runs each step at a compiled shape (jaxgen's): the model prices the
    padded rows: prefill rows to a power of two at the token bucket of the longest chunk,
    decode rows to a batch bucket; a step with cached context attends over its padded table
    and its own tokens."""
    m = fixed_model(padding=PAD, prefill=(0.1, 0.001, 1e-6), decode=(0.02, 0.001, 1e-5),
                    max_batched_tokens=512)  # fmt: skip
    assert m.prefill_seconds([(100, 0)]) == pytest.approx(0.1 + 0.128 + 1e-6 * 128 * 128)
    assert m.decode_seconds(3, 500) == pytest.approx(0.02 + 0.004 + 1e-5 * 500)
    assert PAD.shape([(100, 0), (20, 0), (5, 0)], 3) == dict(
        num_decode=4, prefill_rows=4, prefill_len=128, max_pages=8
    )
    # A fresh row past the attention's query block of 128: each block over the keys up to
    # its last query (300 tokens padded to 512: 128 x (128 + 256 + 384 + 512) pairs).
    assert m.prefill_seconds([(300, 0)]) == pytest.approx(0.1 + 0.512 + 1e-6 * 128 * 1280)
    # 64 tokens after 200 cached: 264 tokens of pages (17 pages, padded to 32), then the
    # chunk's own 64 keys, read by 64 queries.
    assert PAD.features([(64, 200)], 0, 0) == (64, 64 * (32 * 16 + 64), 0, 0)
    assert m.mixed_seconds([(64, 200)], 5, 900) == pytest.approx(
        0.1 + 0.064 + 1e-6 * 64 * 576 + 0.008 + 1e-5 * 900
    )
    assert PAD.shape([], 0) == dict(num_decode=0, prefill_rows=0, prefill_len=0, max_pages=0)
    back = LatencyModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back == m and back.padding == PAD
    for bad in (dict(token_buckets=()), dict(batch_buckets=(4, 2)), dict(page_size=0)):
        with pytest.raises(PlanningError):
            planner.Padding(**{**dataclasses.asdict(PAD), **bad})
    with pytest.raises(PlanningError, match="largest bucket"):
        m.prefill_seconds([(600, 0)])


def test_padded_prefill_rows_share_one_chunk_length_by_hand():
    """jaxgen's scheduler pads every prefill row of a step to the first row's token bucket,
    so later rows stop where the padded rows would pass the budget, and a prompt not started
    that the first row's bucket would cut short leads the next step instead, whole
    (`Scheduler._cut_short`); one already under way is cut."""
    m = fixed_model(padding=PAD, max_batched_tokens=512)
    first = Request(0.0, 16, 1)  # busy until 0.1 + 0.016: the two below wait together
    # A 100-token prompt (bucket 128) then a 300-token one, which 128 tokens would cut: the
    # first runs alone (0.1 + 0.128), the second next, whole (bucket 512: 0.1 + 0.512).
    a, b, c = simulator.simulate_colocated([first, Request(0.01, 100, 1), Request(0.01, 300, 1)], m)
    assert a.ttft == pytest.approx(0.116)
    assert b.ttft == pytest.approx(0.116 + 0.228 - 0.01)
    assert c.ttft == pytest.approx(0.116 + 0.228 + 0.612 - 0.01)
    # Two that fit the first's bucket share its step: 2 x 128 tokens computed.
    a, b, c = simulator.simulate_colocated([first, Request(0.01, 100, 1), Request(0.01, 120, 1)], m)
    assert b.ttft == c.ttft == pytest.approx(0.116 + 0.356 - 0.01)
    # A 600-token prompt leads its step, cut at the budget (512, fresh); its last 88 tokens
    # (bucket 128) lead the next, and a 100-token prompt joins them there (2 x 128).
    a, b, c = simulator.simulate_colocated([first, Request(0.01, 600, 1), Request(0.01, 100, 1)], m)
    assert b.ttft == c.ttft == pytest.approx(0.116 + 0.612 + 0.356 - 0.01)
    # The other order: the 300-token row's bucket (512) leaves no room for a second row.
    a, b, c = simulator.simulate_colocated([first, Request(0.01, 300, 1), Request(0.01, 100, 1)], m)
    assert b.ttft == pytest.approx(0.116 + 0.612 - 0.01)
    assert c.ttft == pytest.approx(0.116 + 0.612 + 0.228 - 0.01)
    # Without padding both fit one step: 0.1 + 0.4.
    a, b, c = simulator.simulate_colocated(
        [first, Request(0.01, 300, 1), Request(0.01, 100, 1)], fixed_model(max_batched_tokens=512)
    )
    assert b.ttft == c.ttft == pytest.approx(0.116 + 0.5 - 0.01)


def test_chunked_prefill_instances():
    """jaxgen's prefill instances cut a prompt at the token budget (DistServe's take it whole)."""
    m = fixed_model(max_batched_tokens=512)
    transfer = 0.05 + 768 * 1000 * 1e-9
    (o,) = simulator.simulate_disaggregated([Request(0.0, 768, 1)], m, m)
    assert o.ttft == pytest.approx(0.1 + 0.768 + transfer)
    (o,) = simulator.simulate_disaggregated([Request(0.0, 768, 1)], m, m, chunked_prefill=True)
    assert o.ttft == pytest.approx(0.2 + 0.768 + transfer)


def test_fit_of_padded_steps_recovers_the_model():
    rng = random.Random(2)
    want = fixed_model(padding=PAD, prefill=(0.02, 3e-4, 2e-7), decode=(0.02, 4e-3, 5e-6))
    records = []
    for _ in range(60):
        chunks = [(rng.randint(1, 200), rng.choice((0, 16, 256))) for _ in range(rng.randint(0, 2))]
        batch = rng.randint(0 if chunks else 1, 8)
        context = sum(rng.randint(10, 900) for _ in range(batch))
        records.append(dict(chunks=chunks, decode_rows=batch, decode_context=context,
                            seconds=want.mixed_seconds(chunks, batch, context)))  # fmt: skip
    fit = planner.fit_steps(records, PAD)
    assert fit.rel_max < 1e-9
    assert planner.fit_steps(records).rel_rms > 0.05  # the rows as they are explain it worse
    got = LatencyModel.from_steps(fit, transfer=want.transfer, kv_bytes_per_token=1000,
                                  max_kv_tokens=100_000, padding=PAD)  # fmt: skip
    assert got.prefill == pytest.approx(want.prefill, rel=1e-6)
    assert got.decode == pytest.approx(want.decode, rel=1e-6)


def test_programs_keyed_as_the_engine_by_hand():
    """`Padding.program`: the step log's shape fields. Tables as wide as the widest row's (a
    power of two, at least 8 pages); decode rows read page blocks (4 pages, 64 tokens each,
    counts bucketed 8, 12, 16, 24, ...) when those cover at most 3/4 of the pages their tables
    would, and the tables are then the prefill rows' alone."""
    assert PAD.program([(100, 0)], [100], []) == (0, 1, 128, 8, 0, True, 1)
    # 300 and 20 tokens: tables of 19 and 2 pages -> 32 wide, 2 rows x 32 = 64 pages; blocks
    # 5 + 1 -> 8 blocks (32 pages) <= 48: blocks, and no table left to send.
    assert PAD.program([], [], [300, 20]) == (2, 0, 0, 8, 8, True, 2)
    # 8 blocks > 3/4 of one 8-page table
    assert PAD.program([], [], [20]) == (1, 0, 0, 8, 0, True, 1)
    # With a prefill row of a 400-token prompt (25 pages) the tables are 32 wide either way.
    assert PAD.program([(64, 200)], [400], [300, 20]) == (2, 1, 64, 32, 8, False, 4)
    # A 600-token prompt's 38 pages: 64-page tables, and the decode row's 8 blocks fit 3/4.
    assert PAD.program([(64, 0)], [600], [20]) == (1, 1, 64, 64, 8, True, 2)


def test_compiles_priced_once_per_program():
    """With a compile model, a step whose program its instance has not run costs that model's
    time; `Programs` carries the instances' programs from one simulated run to the next."""
    m = fixed_model(padding=PAD, compile=(1.0, 0.0, 0.0, 0.0, 0.0))
    programs = simulator.Programs()
    # Prefill (new: 1 s), decode at 101 tokens (new: 1 s), decode at 102 (the same program).
    (o,) = simulator.simulate_colocated([Request(0.0, 100, 3)], m, programs=programs)
    assert o.ttft == pytest.approx(1.0) and o.finish == pytest.approx(2.0 + 0.021)
    assert programs.compiles == 2
    seen = programs.copy()
    (o,) = simulator.simulate_colocated([Request(0.0, 100, 3)], m, programs=programs)
    assert o.ttft == pytest.approx(0.228) and programs.compiles == 2  # nothing new
    assert seen.known == programs.known and seen.known[0] is not programs.known[0]
    # The other colocated instance has its own programs; a new prompt length, a new program.
    a, b = simulator.simulate_colocated(
        [Request(0.0, 100, 1), Request(0.0, 300, 1)], m, 2, programs=programs
    )
    assert a.ttft == pytest.approx(0.228) and b.ttft == pytest.approx(1.0)
    assert programs.compiles == 3 and len(programs.known[1]) == 1
    # Disaggregated: prefill and decode instances each compile their own.
    dis = simulator.Programs()
    simulator.simulate_disaggregated([Request(0.0, 100, 3)], m, m, programs=dis)
    assert set(dis.known) == {0, 1} and dis.compiles == 2
    # Without a compile model nothing is counted, and the times are the plain ones.
    plain = simulator.Programs()
    (o,) = simulator.simulate_colocated(
        [Request(0.0, 100, 3)], fixed_model(padding=PAD), programs=plain
    )
    assert o.ttft == pytest.approx(0.228) and plain.compiles == 0
    back = LatencyModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back == m and back.compile_seconds((0, 1, 128, 8, 0, True, 1)) == pytest.approx(1.0)
    with pytest.raises(PlanningError, match="padding"):
        fixed_model(compile=(1.0, 0.0, 0.0, 0.0, 0.0))
    with pytest.raises(PlanningError, match="0 \\(off\\) or >= 1"):
        simulator.Programs(cover=0.5)
    with pytest.raises(PlanningError, match="5 coefficients"):
        fixed_model(padding=PAD, compile=(1.0,))


def test_scaled_model():
    m = fixed_model(padding=PAD, compile=(1.0, 0.5, 0.0, 0.0, 0.0))
    slow = m.scaled(2.0)
    assert slow.prefill == pytest.approx((0.2, 0.002, 0.0))
    assert slow.decode == pytest.approx((0.04, 0.002, 0.0))
    assert slow.compile == pytest.approx((2.0, 1.0, 0.0, 0.0, 0.0))
    assert slow.transfer == m.transfer and slow.padding == PAD
    assert slow.mixed_seconds([(100, 0)], 2, 300) == pytest.approx(
        2 * m.mixed_seconds([(100, 0)], 2, 300)
    )
    with pytest.raises(PlanningError):
        m.scaled(0.0)


def test_handoff_by_hand():
    """The engines' own time on handed-off KV: the prefill instance writes a prompt's full
    pages out after its step (0.1 s + 1 ms per token; busy meanwhile, the transfer after), the
    decode instance admits them in its next step (0.2 s)."""
    pre = fixed_model(handoff=(0.1, 0.001))
    dec = fixed_model(handoff=(0.2, 0.0))
    first, second = Request(0.0, 100, 2), Request(0.25, 100, 1)
    a, b = simulator.simulate_disaggregated([first, second], pre, dec, tail_page=16)
    transfer = 0.05 + 100 * 1000 * 1e-9
    # 0.2 prefill, 0.196 writing 96 tokens (the last partial page is computed at the decode
    # instance), the transfer, then 0.2 admitting + 0.104 for the 4-token tail.
    assert a.ttft == pytest.approx(0.2 + 0.196 + transfer + 0.2 + 0.104)
    assert a.tpot == pytest.approx(0.021)
    # The second prompt waits for the first one's write (0.396), then the same path.
    assert b.ttft == pytest.approx(0.396 + 0.2 + 0.196 + transfer + 0.304 - 0.25)
    # The prefill hop (the router's wait for the prefill instance's answer): up to the write.
    assert a.prefill == pytest.approx(0.396) and b.prefill == pytest.approx(0.792 - 0.25)
    # Without a handoff: prefill, transfer, tail.
    (c,) = simulator.simulate_disaggregated([first], fixed_model(), fixed_model(), tail_page=16)
    assert c.ttft == pytest.approx(0.2 + transfer + 0.104)
    assert c.prefill == pytest.approx(0.2)
    (d,) = simulator.simulate_colocated([first], fixed_model())
    assert d.prefill is None  # no hop
    assert pre.scaled(2.0).handoff == pytest.approx((0.2, 0.002))
    assert LatencyModel.from_dict(json.loads(json.dumps(pre.to_dict()))) == pre
    with pytest.raises(PlanningError, match="handoff"):
        fixed_model(handoff=(-1.0, 0.0))


def test_overlapped_loop_by_hand():
    """jaxgen's overlapped engine loop: a busy instance planned its next step when the one
    before started, so a prompt arriving mid-step (0.25 s, during the decode step of 0.242 s)
    joins the step after the next, one decode step (21 ms) later than without overlap; one
    arriving at an idle instance starts at once."""
    m = fixed_model()
    reqs = [Request(0.0, 100, 10), Request(0.25, 50, 3)]
    plain = simulator.simulate_colocated(reqs, m)
    over = simulator.simulate_colocated(reqs, m, overlap=True)
    assert over[0].ttft == pytest.approx(plain[0].ttft) == pytest.approx(0.2)
    assert over[1].ttft == pytest.approx(plain[1].ttft + 0.021)
    # The same on a decode instance: the handed-off prompt's tail waits for one more step.
    d_plain = simulator.simulate_disaggregated(reqs, m, m, tail_page=16)
    d_over = simulator.simulate_disaggregated(reqs, m, m, tail_page=16, overlap=True)
    assert d_over[0].ttft == pytest.approx(d_plain[0].ttft)
    assert d_over[1].ttft > d_plain[1].ttft
    assert d_over[1].prefill == pytest.approx(d_plain[1].prefill)  # the prefill side was idle


def test_simulator_errors():
    m = fixed_model()
    with pytest.raises(JaxgenError):
        simulator.simulate_colocated([], m)
    with pytest.raises(PlanningError):
        simulator.simulate_colocated([Request(0.0, 0, 1)], m)
    with pytest.raises(PlanningError):  # can never fit the KV pool
        simulator.simulate_colocated([Request(0.0, 100, 5)], fixed_model(max_kv_tokens=50))
    with pytest.raises(PlanningError):
        simulator.attainment([simulator.Outcome(0.1, 0.01, 1.0)], 0.0, 0.1)
    with pytest.raises(PlanningError):
        search.SLO(ttft=1.0, tpot=-0.1)
    with pytest.raises(PlanningError):
        LatencyModel((0, 0, 0), (0, 0, 0), (0, 0), 1, 1)  # no fixed cost
    with pytest.raises(PlanningError):
        traces.poisson_requests([], 1.0, [])


def test_max_rate_bisection():
    # Attainment 1 below 7.3 req/s, 0 above: found within the tolerance, from below.
    r = search.max_rate(lambda x: 1.0 if x <= 7.3 else 0.0, 0.9, start=1.0, rel_tol=0.01)
    assert 7.3 * 0.99 <= r <= 7.3
    r = search.max_rate(lambda x: 1.0 if x <= 0.01 else 0.0, 0.9, start=4.0, rel_tol=0.01)
    assert 0.01 * 0.99 <= r <= 0.01
    assert search.max_rate(lambda x: 0.0, 0.9) == 0.0


def small_trace(n=80, seed=3):
    spec = traces.TRACES["chat"]
    return traces.sample_lengths(spec, n, seed), traces.unit_gaps(n, seed)


def test_goodput_is_monotone_and_consistent():
    lengths, gaps = small_trace()
    m = fixed_model(prefill=(0.01, 1e-5, 0.0), decode=(0.01, 1e-4, 0.0))

    def model_for(tp, role):
        return m

    p = search.Placement("colocated", 1, 1)
    tight = search.goodput(p, lengths, gaps, search.SLO(0.2, 0.03), model_for)
    loose = search.goodput(p, lengths, gaps, search.SLO(0.4, 0.06), model_for)
    assert 0 < tight <= loose * 1.02
    # Consistent: at the rate found the target holds, at 20% more it does not.
    att = lambda r: simulator.attainment(  # noqa: E731
        search.simulate(p, traces.poisson_requests(lengths, r, gaps), model_for), 0.2, 0.03
    )
    assert att(tight) >= 0.9
    assert att(tight * 1.2) < 0.9
    # A faster model serves at least as much.
    fast = fixed_model(prefill=(0.005, 5e-6, 0.0), decode=(0.005, 5e-5, 0.0))
    faster = search.goodput(p, lengths, gaps, search.SLO(0.2, 0.03), lambda tp, role: fast)
    assert faster >= tight


def test_search_ranks_placements():
    lengths, gaps = small_trace(60)
    m = fixed_model(prefill=(0.01, 1e-5, 0.0), decode=(0.01, 1e-4, 0.0))
    cands = search.placements(2, tps=(1,))
    assert {c.label() for c in cands} == {"1x colocated TP1", "1P TP1 + 1D TP1"}
    rows = search.search(cands, lengths, gaps, search.SLO(0.2, 0.03), lambda tp, role: m, 0.05)
    per = [r["per_device_rps"] for r in rows]
    assert per == sorted(per, reverse=True)
    assert all(r["goodput_rps"] == pytest.approx(r["per_device_rps"] * r["devices"]) for r in rows)


def test_tp_scaling():
    m = fixed_model()
    m2 = m.with_tp(
        2,
        layers=2,
        hidden=10,
        act_bytes=2,
        allreduce_latency=1e-3,
        link_bytes_per_s=1e6,
        kv_tokens=7,
    )
    # Halved terms, plus 2 all-reduces x 2 layers: 4 ms fixed, 2*2 * 2*(1/2) * 10*2/1e6 s/token.
    assert m2.decode[0] == pytest.approx(0.01 + 0.004)
    assert m2.decode[1] == pytest.approx(0.0005 + 8e-5)
    assert m2.max_kv_tokens == 7
    with pytest.raises(PlanningError):
        m.with_tp(
            0, layers=1, hidden=1, act_bytes=2, allreduce_latency=0, link_bytes_per_s=1, kv_tokens=1
        )


def test_traces_seeded_and_documented_ranges():
    for spec in traces.TRACES.values():
        a = traces.sample_lengths(spec, 500, 7)
        assert a == traces.sample_lengths(spec, 500, 7)
        assert a != traces.sample_lengths(spec, 500, 8)
        assert all(spec.prompt.low <= p <= spec.prompt.high for p, _ in a)
        assert all(spec.output.low <= o <= spec.output.high for _, o in a)
    summ = traces.sample_lengths(traces.TRACES["summarization"], 500, 0)
    chat = traces.sample_lengths(traces.TRACES["chat"], 500, 0)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean([p for p, _ in summ]) > 3 * mean([p for p, _ in chat])
    assert mean([o for _, o in summ]) < mean([o for _, o in chat])
    reqs = traces.poisson_requests(chat, 10.0, traces.unit_gaps(500, 0))
    assert reqs[-1].arrival / len(reqs) == pytest.approx(0.1, rel=0.15)


def test_no_jax_at_import():
    code = (
        "import sys; import benchmarks.disagg.search, benchmarks.disagg.traces;"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_compiled_program_covers_a_new_step():
    """With `Programs(cover=f)` (jaxgen's `cover_new_shapes`), a step whose program has not
    compiled runs on a compiled one at least as large in every size whose work (tokens, KV
    pairs) is at most f x its own, priced at that program's padded size; a step no program
    covers within f compiles its own."""
    m = fixed_model(padding=PAD, compile=(1.0, 0.0, 0.0, 0.0, 0.0))
    assert PAD.covers((0, 2, 128, 8, 0, True, 2), (0, 1, 128, 8, 0, True, 1), 2.0)
    assert not PAD.covers((0, 2, 128, 8, 0, True, 2), (0, 1, 64, 8, 0, True, 1), 2.0)  # 4x
    assert not PAD.covers((0, 1, 128, 8, 0, True, 1), (0, 2, 128, 8, 0, True, 2), 9.0)  # rows
    assert not PAD.covers((2, 0, 0, 8, 0, True, 2), (1, 0, 0, 8, 8, True, 1), 9.0)  # tables
    # Rows that would read tables read page blocks where the program has enough for their
    # tables' width (2 rows of 8 pages: 4 blocks of 4 pages), as the engine's do.
    assert PAD.covers((8, 0, 0, 8, 8, True, 8), (2, 0, 0, 8, 0, True, 2), 99.0)
    assert not PAD.covers((8, 0, 0, 8, 8, True, 8), (8, 0, 0, 8, 0, True, 8), 99.0)  # 16
    assert PAD.covers((2, 1, 64, 16, 8, False, 4), (1, 1, 64, 16, 8, False, 2), 2.0)
    # Fewer sampled rows (3 decode + 1 prefill bucket to 4, 4 + 1 to 8): not the same program.
    assert not PAD.covers((4, 1, 32, 8, 0, True, 4), (4, 1, 32, 8, 0, True, 8), 9.0)
    # A chunk with cached context needs a program that reads it (the engine's prefill_fresh);
    # one that does runs a fresh chunk too, at its own (larger) work.
    assert not PAD.covers((0, 1, 64, 8, 0, True, 1), (0, 1, 64, 8, 0, False, 1), 9.0)
    assert PAD.covers((0, 1, 64, 8, 0, False, 1), (0, 1, 64, 8, 0, True, 1), 9.0)
    assert PAD.work((0, 1, 64, 8, 0, False, 1)) == (64, 64 * (8 * 16 + 64))
    assert PAD.work((0, 1, 64, 8, 0, True, 1)) == (64, 64 * 64)
    programs = simulator.Programs(cover=2.0)
    programs.known[0] |= {(0, 2, 128, 8, 0, True, 2), (2, 0, 0, 8, 0, True, 2)}  # prefill, decode
    # One prompt: its prefill (1x128) and decode (1 row) run on those programs.
    (o,) = simulator.simulate_colocated([Request(0.0, 100, 2)], m, programs=programs)
    assert programs.compiles == 0 and programs.covered == 2
    prefill = m.program_seconds((0, 2, 128, 8, 0, True, 2))
    assert prefill == pytest.approx(0.1 + 0.001 * 256) and o.ttft == pytest.approx(prefill)
    assert o.finish - o.ttft == pytest.approx(m.program_seconds((2, 0, 0, 8, 0, True, 2)))
    # A 30-token prompt: 1x32 is 1/8 of 2x128's tokens, beyond the factor: it compiles.
    (o,) = simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=programs)
    assert programs.compiles == 1 and o.ttft == pytest.approx(1.0)
    # Without cover, the prompt compiles its own programs.
    plain = simulator.Programs()
    plain.known[0] |= {(0, 2, 128, 8, 0, True, 2), (2, 0, 0, 8, 0, True, 2)}
    simulator.simulate_colocated([Request(0.0, 100, 2)], m, programs=plain)
    assert plain.compiles == 2 and plain.covered == 0


def test_background_compile_shares_the_core_by_hand():
    """With `Programs(background=True)` (jaxgen's `compile_in_background`), a step that no
    compiled program covers within the factor runs on one covering it at any factor while its
    own program compiles (`compile_seconds - program_seconds` of work) on a thread sharing the
    core: a step gets `background_share` of it, the compile the rest, and all of it when the
    instance is idle. Its program serves once compiled; compiles still running when a
    simulation ends have ended before the next."""
    m = fixed_model(padding=PAD, compile=(1.0, 0.0, 0.0, 0.0, 0.0), background_share=0.5)
    big, own = (0, 2, 128, 8, 0, True, 2), (0, 1, 32, 8, 0, True, 1)
    cover, alone = 0.1 + 0.001 * 256, 0.1 + 0.001 * 32  # the 30-token prompt on each
    work = 1.0 - alone  # the compile's own
    programs = simulator.Programs(cover=2.0, background=True)
    programs.known[0].add(big)
    # A at 0: on the 2x128 program at half speed, the compile at the other half meanwhile.
    # B at 0.8 (the compile has had the core alone since A finished): on the cover again, and
    # it ends first. C at 2.0: the compile has ended, its own program serves.
    a, b, c = simulator.simulate_colocated(
        [Request(0.0, 30, 1), Request(0.8, 30, 1), Request(2.0, 30, 1)], m, programs=programs
    )
    assert a.ttft == pytest.approx(2 * cover) and b.ttft == pytest.approx(2 * cover)
    left = work - cover - (0.8 - 2 * cover) - cover  # what C's step finds: none
    assert left > 0 and 0.8 + 2 * cover + left < 2.0
    assert c.ttft == pytest.approx(alone)
    assert (programs.compiles, programs.background_compiles, programs.covered) == (1, 1, 2)
    assert own in programs.known[0] and not programs.pending[0]
    # A compile still running as a simulation ends has ended before the next one.
    fresh = simulator.Programs(cover=2.0, background=True)
    fresh.known[0].add(big)
    simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=fresh)
    assert fresh.pending[0] and fresh.copy().pending[0] == fresh.pending[0]
    (d,) = simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=fresh)
    assert d.ttft == pytest.approx(alone) and fresh.compiles == 1
    # A step that nothing covers stalls to compile, as without background compiles.
    bare = simulator.Programs(cover=2.0, background=True)
    (e,) = simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=bare)
    assert e.ttft == pytest.approx(1.0) and bare.background_compiles == 0
    # The share, from logged steps that ran beside a compile (compiled ones and those alone
    # do not count; fewer than 5: None).
    plain = fixed_model()  # a 100-token prefill: 0.2 s
    step = dict(chunks=[(100, 0)], decode_rows=0, decode_context=0)
    slow = [dict(step, seconds=0.2 * r, compiling=1) for r in (1.6, 1.9, 2.0, 2.1, 3.0)]
    other = [dict(step, seconds=5.0, compiled=True, compiling=1), dict(step, seconds=0.9)]
    assert planner.fit_background_share(slow + other, plain) == pytest.approx(0.5)
    assert planner.fit_background_share(slow[:4] + other, plain) is None
    with pytest.raises(PlanningError, match="background_share"):
        fixed_model(background_share=0.0)


def test_frozen_programs_cover_at_any_factor_by_hand():
    """With `Programs(frozen=True)` (jaxgen's `freeze_programs`), a step whose program has not
    compiled runs on the least-work compiled program covering it at any factor, priced at that
    program, and compiles nothing, in the background or not; a step that nothing covers still
    compiles inline. Copies keep the flag."""
    m = fixed_model(padding=PAD, compile=(1.0, 0.0, 0.0, 0.0, 0.0), background_share=0.5)
    big, bigger = (0, 2, 128, 8, 0, True, 2), (0, 4, 128, 8, 0, True, 4)
    for background in (False, True):
        programs = simulator.Programs(cover=2.0, background=background, frozen=True)
        programs.known[0] |= {big, bigger}
        # 1x32 is 1/8 of 2x128's tokens (beyond the factor): on 2x128, the least work.
        (a,) = simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=programs.copy())
        assert a.ttft == pytest.approx(m.program_seconds(big))
        (a,) = simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=programs)
        assert (programs.compiles, programs.covered) == (0, 1) and not programs.pending[0]
        # 200 tokens: a 1x256 prefill, wider than every program: it compiles (1 s).
        (b,) = simulator.simulate_colocated([Request(0.0, 200, 1)], m, programs=programs)
        assert b.ttft == pytest.approx(1.0) and programs.compiles == 1
        assert programs.background_compiles == 0
    programs.frozen = False  # thawed: the 1x32 prefill beyond the factor compiles again
    simulator.simulate_colocated([Request(0.0, 30, 1)], m, programs=programs)
    assert programs.compiles == 2 and programs.background_compiles == 1


def test_a_frozen_instance_defers_prefill_rows_by_hand():
    """`Programs(frozen=True)` (jaxgen's `LLMEngine._defer_prefills`): a step that no program
    the instance holds covers leaves its last prefill rows to the next step until one does,
    rather than compile; a row is deferred once (its next row stays: that step compiles).
    `defer=0` (an engine before deferring) compiles at once; `defer=1` (the rule of the
    16:03 run: the last step's deferred rows stay) and 2 agree here, and a bad value fails."""
    m = fixed_model(padding=PAD, compile=(1.0, 0.0, 0.0, 0.0, 0.0))
    one = PAD.program([(30, 0)], [30], [])  # a 1x32 prefill
    mixed = PAD.program([(30, 0)], [30], [31])  # 1 decode row + a 1x32 prefill
    mixed2 = PAD.program([(30, 0)], [30], [32, 31])  # 2 decode rows + a 1x32 prefill
    assert (one[:3], mixed[:3], mixed2[:3]) == ((0, 1, 32), (1, 1, 32), (2, 1, 32))
    decode = (8, 0, 0, 8, 0, True, 8)  # covers every decode step of these requests
    # The first prompt's step runs alone; the other two arrive during it and come together
    # with its decode row: 1 decode + 2x32, which no program held covers.
    reqs = [Request(0.0, 30, 4), Request(0.01, 30, 4), Request(0.01, 30, 4)]

    def run(known, defer=2):
        programs = simulator.Programs(frozen=True, defer=defer)
        programs.known[0] |= known
        outs = simulator.simulate_colocated(reqs, m, programs=programs)
        return outs, programs

    # The third waits a step; the steps that follow are held: nothing compiles.
    (a, b, c), programs = run({one, mixed, mixed2, decode})
    assert (programs.compiles, programs.deferred) == (0, 1)
    first = m.program_seconds(one)
    assert a.ttft == pytest.approx(first)
    assert b.ttft == pytest.approx(first + m.program_seconds(mixed) - 0.01)
    assert c.ttft == pytest.approx(b.ttft + m.program_seconds(mixed2))
    # Without a program for the step after, the row that waited stays in it: it compiles.
    (a, b, c), programs = run({one, mixed, decode})
    assert (programs.compiles, programs.deferred) == (1, 1)
    assert c.ttft == pytest.approx(b.ttft + 1.0)
    # An engine without deferring compiles the 1 + 2x32 step at once.
    (a, b, c), programs = run({one, mixed, mixed2, decode}, defer=0)
    assert (programs.compiles, programs.deferred) == (1, 0)
    assert b.ttft == c.ttft == pytest.approx(first + 1.0 - 0.01)
    for known, want in (({one, mixed, mixed2, decode}, (0, 1)), ({one, mixed, decode}, (1, 1))):
        assert (run(known, defer=1)[1].compiles, run(known, defer=1)[1].deferred) == want
    with pytest.raises(PlanningError, match="give 0, 1 or 2"):
        simulator.Programs(defer=3)


def test_a_program_is_priced_at_the_kv_it_reads():
    """The decode term of a step priced by its program (`program_seconds`) is the KV that
    program reads, padding included: its page blocks, or every padded row's table. A step on
    a covering program with 4x the blocks costs 4x the decode read; `fit_steps` on logged
    steps (their `shape`, covered ones too) prices them the same way and gets the model back."""
    assert PAD.decode_read((8, 0, 0, 8, 32, True, 8)) == 32 * 4 * 16
    assert PAD.decode_read((4, 0, 0, 16, 0, True, 4)) == 4 * 16 * 16  # tables: every padded row
    assert PAD.decode_read((0, 1, 128, 8, 0, True, 1)) == 0
    m = fixed_model(padding=PAD, prefill=(0.02, 3e-4, 2e-7), decode=(0.02, 4e-3, 5e-6))
    own, cover = (8, 0, 0, 8, 8, True, 8), (8, 0, 0, 8, 32, True, 8)
    assert m.program_seconds(cover) - m.program_seconds(own) == pytest.approx(5e-6 * 24 * 64)
    rng = random.Random(3)
    records = []
    for _ in range(60):
        chunks = [(rng.randint(1, 200), rng.choice((0, 16))) for _ in range(rng.randint(0, 2))]
        lens = [rng.randint(10, 900) for _ in range(rng.randint(0 if chunks else 1, 6))]
        key = PAD.program(chunks, [n + p + 5 for n, p in chunks], lens)
        if rng.random() < 0.5:  # run on a larger program, as a covered step is
            key = (*(2 * k for k in key[:5]), key[5], key[6])
        names = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "decode_blocks",
                 "prefill_fresh", "num_rows")  # fmt: skip
        shape = dict(zip(names, key, strict=True))
        record = dict(chunks=chunks, decode_rows=len(lens), decode_context=sum(lens), shape=shape)
        records.append(dict(record, seconds=m.program_seconds(key)))
        assert m.record_seconds(record) == pytest.approx(m.program_seconds(key))
    fit = planner.fit_steps(records, PAD)
    assert fit.rel_max < 1e-9
    got = LatencyModel.from_steps(fit, transfer=m.transfer, kv_bytes_per_token=1000,
                                  max_kv_tokens=100_000, padding=PAD)  # fmt: skip
    assert got.prefill == pytest.approx(m.prefill, rel=1e-6)
    assert got.decode == pytest.approx(m.decode, rel=1e-6)
    # A log from before `prefill_fresh` and `num_rows` were logged: the step's rows decide.
    old = {k: v for k, v in records[0]["shape"].items() if k not in ("prefill_fresh", "num_rows")}
    assert PAD.key_of(old, [(5, 16)], 4)[5:] == (False, 8)


def test_prefill_rows_with_cached_context_have_a_term_of_their_own():
    """`LatencyModel.cached_pair`: the pairs of prefill rows that read cached context over
    their page tables (`Padding.cached_pairs`) cost more than a fresh row's; `fit_steps(...,
    cached=True)` fits that term to logged steps and gets it back, which the five terms alone
    cannot explain. TP splits it and a slower host scales it like the other terms."""
    m = fixed_model(padding=PAD, prefill=(0.02, 3e-4, 2e-7), decode=(0.02, 4e-3, 5e-6),
                    cached_pair=3e-7)  # fmt: skip
    fresh, cached = PAD.program([(100, 0)], [100], []), PAD.program([(100, 16)], [116], [])
    assert PAD.cached_pairs(fresh) == 0 and PAD.cached_pairs((4, 0, 0, 8, 0, True, 4)) == 0
    assert PAD.cached_pairs(cached) == 128 * (8 * 16 + 128)
    plain = dataclasses.replace(m, cached_pair=0.0)
    assert m.program_seconds(fresh) == plain.program_seconds(fresh)
    assert m.program_seconds(cached) - plain.program_seconds(cached) == pytest.approx(
        3e-7 * 128 * 256
    )
    assert m.prefill_seconds([(100, 16)]) == pytest.approx(m.program_seconds(cached))
    assert m.mixed_seconds([(100, 16)], 2, 300) - plain.mixed_seconds([(100, 16)], 2, 300) == (
        pytest.approx(3e-7 * 128 * 256)
    )
    rng = random.Random(5)
    records = []
    names = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "decode_blocks",
             "prefill_fresh", "num_rows")  # fmt: skip
    for _ in range(80):
        chunks = [(rng.randint(1, 200), rng.choice((0, 16, 256))) for _ in range(rng.randint(0, 2))]
        lens = [rng.randint(10, 900) for _ in range(rng.randint(0 if chunks else 1, 6))]
        key = PAD.program(chunks, [n + p + 5 for n, p in chunks], lens)
        shape = dict(zip(names, key, strict=True))
        record = dict(chunks=chunks, decode_rows=len(lens), decode_context=sum(lens), shape=shape)
        records.append(dict(record, seconds=m.program_seconds(key)))
        assert m.record_seconds(record) == pytest.approx(m.program_seconds(key))
    fit = planner.fit_steps(records, PAD, cached=True)
    assert fit.rel_max < 1e-9 and fit.names[-1] == "c_cached_pair"
    got = LatencyModel.from_steps(fit, transfer=m.transfer, kv_bytes_per_token=1000,
                                  max_kv_tokens=100_000, padding=PAD)  # fmt: skip
    assert got.cached_pair == pytest.approx(3e-7, rel=1e-6)
    assert got.prefill == pytest.approx(m.prefill, rel=1e-6)
    assert planner.fit_steps(records, PAD).rel_rms > 0.01  # without the term
    assert LatencyModel.from_dict(json.loads(json.dumps(got.to_dict()))) == got
    assert m.scaled(2.0).cached_pair == pytest.approx(6e-7)
    tp = m.with_tp(2, layers=2, hidden=64, act_bytes=2, allreduce_latency=0.0,
                   link_bytes_per_s=1e9, kv_tokens=1000)  # fmt: skip
    assert tp.cached_pair == pytest.approx(1.5e-7)
    with pytest.raises(PlanningError, match="needs the padding"):
        planner.fit_steps(records, None, cached=True)
    with pytest.raises(PlanningError, match="needs the padding"):
        fixed_model(cached_pair=1e-7)
    with pytest.raises(PlanningError, match=">= 0"):
        fixed_model(padding=PAD, cached_pair=-1e-7)
