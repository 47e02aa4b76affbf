"""bench.disagg's own arithmetic (the deployments themselves run in the benchmark): the CPU-sized
traces, the goodput crossing between measured rates, SLO attainment of client results, and the
summary's transfer figures and simulators' errors, the client overhead, the step logs read."""

import copy
import dataclasses
import json

import pytest

from benchmarks.disagg import measure as disagg
from benchmarks.disagg import search, traces
from benchmarks.disagg.planner import PlanningError


def test_cpu_traces_divide_every_length():
    gpu, cpu = traces.TRACES["summarization"], disagg.cpu_traces(8)["summarization"]
    assert cpu.prompt.median == gpu.prompt.median / 8 and cpu.prompt.high == gpu.prompt.high // 8
    assert cpu.output.low >= 2  # every answer has a TPOT
    lengths = traces.sample_lengths(cpu, 200, 0)
    assert all(cpu.prompt.low <= p <= cpu.prompt.high for p, _ in lengths)
    assert "/ 8" in cpu.description


def test_crossing_interpolates_and_says_when_outside():
    for rates, att in (([1, 2, 3], [1.0, 0.95, 0.85]), ([3, 1, 2], [0.85, 1.0, 0.95])):
        got = disagg.crossing(rates, att)  # in any order of the rates
        assert got["bound"] == "=" and abs(got["rps"] - 2.5) < 1e-9
    assert disagg.crossing([1, 2], [0.95, 0.92]) == {"rps": 2, "bound": ">="}
    assert disagg.crossing([1, 2], [0.5, 0.2]) == {"rps": 1, "bound": "<"}
    # A dip at a low rate (a compile there) does not hide the higher rate that met the target.
    got = disagg.crossing([1, 2, 3], [0.7, 0.95, 0.85])
    assert got["bound"] == "=" and abs(got["rps"] - 2.5) < 1e-9


def test_attainment_counts_errors_as_misses():
    slo = search.SLO(ttft=1.0, tpot=0.1)
    results = [
        {"ttft": 0.5, "tpot": 0.05},
        {"ttft": 1.5, "tpot": 0.05},  # late first token
        {"ttft": 0.5, "tpot": 0.2},  # slow decode
        {"error": "HTTP 503"},
    ]
    assert disagg.attainment_of(results, slo) == 0.25


def test_summary_goodput_ratio_error_and_transfer_share():
    def runs(att, iso, served, transfer=None):
        return [
            dict(rate=r, attainment=a, isolated_attainment=i, served_attainment=s,
                 ttft_s=[1.0, 2.0, None], transfer=transfer or {})
            for r, a, i, s in zip((1.0, 2.0, 3.0), att, iso, served, strict=True)
        ]  # fmt: skip

    moved = {"pulled_bytes": 2e9, "pull_seconds": 0.5, "pulls": 4}
    result = {"traces": {"chat": {
        "runs": {
            "colocated": runs((1.0, 0.9, 0.5), (1.0, 0.95, 0.7), (1.0, 0.9, 0.6)),
            "disaggregated": runs((1.0, 1.0, 0.8), (1.0, 1.0, 1.0), (1.0, 1.0, 0.7), moved),
        },
    }}}  # fmt: skip
    disagg.summarize(result)
    row = result["traces"]["chat"]
    colo, dis = row["goodput"]["colocated"], row["goodput"]["disaggregated"]
    assert colo["measured"] == {"rps": 2.0, "bound": "="}
    assert abs(colo["isolated"]["rps"] - 2.2) < 1e-9
    assert abs(colo["isolated_error"] - 0.1) < 1e-9
    assert abs(colo["served"]["rps"] - 2.0) < 1e-9 and colo["served_error"] < 1e-9
    assert abs(dis["measured"]["rps"] - 2.5) < 1e-9 and dis["isolated_error"] is None  # >= 3
    assert abs(dis["served"]["rps"] - 2 - 1 / 3) < 1e-9
    assert abs(dis["served_error"] - (2.5 - 7 / 3) / 2.5) < 1e-9
    assert abs(row["goodput_ratio"] - 1.25) < 1e-9
    # 3 replays x 2e9 bytes in 3 x 0.5 s; 1.5 s of the 9 s of TTFT.
    assert abs(row["transfer"]["gbps"] - 4.0) < 1e-9
    assert abs(row["transfer"]["share_of_ttft"] - 1.5 / 9.0) < 1e-9
    assert row["transfer"]["pulls"] == 12


def test_client_overhead_is_what_the_instances_do_not_account_for():
    zero = dict(ttft_sum=0.0, ttft_count=0.0, pulls=0.0, pull_seconds=0.0, pulled_bytes=0.0)
    # Colocated: 4 requests, one instance TTFT each, 0.3 s mean there; clients saw 0.5 s.
    after = dict(zero, ttft_sum=1.2, ttft_count=4.0)
    assert abs(disagg.client_overhead([0.4, 0.6, 0.5, 0.5], zero, after) - 0.2) < 1e-9
    # Disaggregated: a prefill and a decode TTFT per request (8 in all, 0.25 s mean) and
    # 0.4 s of transfer reads over the 4 requests: 0.9 - 0.5 - 0.1.
    after = dict(zero, ttft_sum=2.0, ttft_count=8.0, pulls=4.0, pull_seconds=0.4)
    assert abs(disagg.client_overhead([0.9] * 4, zero, after) - 0.3) < 1e-9
    assert disagg.client_overhead([0.1] * 4, zero, after) == 0.0  # not below 0
    assert disagg.client_overhead([None], zero, zero) == 0.0


def test_steps_read_after_a_mark_compiles_flagged(tmp_path):
    path = tmp_path / "steps.jsonl"
    shape = dict(num_decode=4, prefill_rows=1, prefill_len=16, max_pages=8, decode_blocks=1)
    lines = [
        dict(time=100.0 + i, pid=7, seconds=0.1 * i, chunks=[[16, 0]], decode_rows=i,
             decode_context=20 * i, compiled=i == 3, covered=i == 1, tokens=16 + i, shape=shape,
             compiling=int(i == 5), deferred=int(i == 4), cpu_seconds=0.1, gc_seconds=0.0,
             trace_seconds=0.0, compile_seconds=0.0, jax_compiles=int(i == 3))
        for i in range(6)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert disagg.line_count(str(path)) == 6
    every = disagg.read_steps(str(path), 2)
    assert [(s["decode_rows"], s["compiled"]) for s in every] == [(2, False), (3, True), (4, False),
                                                                  (5, False)]  # fmt: skip
    got = disagg.plain_steps(every)
    assert [s["decode_rows"] for s in got] == [2, 4]  # 5 ran beside a background compile
    keys = {"time", "seconds", "chunks", "decode_rows", "decode_context", "shape", "compiled",
            "covered", "compiling", "deferred", *disagg.HOST_FIELDS}  # fmt: skip
    assert set(got[0]) == keys
    assert [s["jax_compiles"] for s in every] == [0, 1, 0, 0]  # the host beside each step
    assert [s["deferred"] for s in every] == [0, 0, 1, 0]  # prefill rows left to the next step
    assert [s["time"] for s in every] == [102.0, 103.0, 104.0, 105.0]  # the replays' sends
    # A step that ran on a larger program covering it (`COVER`) is not a plain one either.
    assert [s["decode_rows"] for s in disagg.plain_steps(disagg.read_steps(str(path), 0))] == [
        0, 2, 4
    ]  # fmt: skip
    # The padding rule gives 4 decode rows for 4 (and for 3), 8 for 5: the logged shape agrees
    # with it for the first two steps.
    pad = disagg.padding()
    assert disagg.shape_agreement(got[:2], pad) == 0.5  # 2 rows -> 2, logged 4; 4 rows -> 4
    assert disagg.shape_agreement([dict(s, shape=None) for s in got[:2]], pad) == 0.0


def test_settle_compiles_waits_for_every_background_compile(tmp_path):
    """`settle_compiles` returns once the instances' logs show every background compile that
    started has ended (or failed), and says so when one never ends."""
    from jaxgen.engine.runner.programs import BACKGROUND_COMPILE_ENDED, BACKGROUND_COMPILE_STARTED

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    started = f"jaxgen: compiling decode 4 {BACKGROUND_COMPILE_STARTED}about 2.5 s)\n"
    a.write_text(started + f"jaxgen:   decode 4 {BACKGROUND_COMPILE_ENDED[0]} in 3.1 s\n")
    b.write_text(started + f"jaxgen: {BACKGROUND_COMPILE_ENDED[1]} decode 4 failed\n")
    disagg.settle_compiles([str(a), str(b)], timeout=0.0)
    assert disagg.background_compile_seconds(str(a)) == [3.1]
    assert disagg.background_compile_seconds(str(b)) == []
    b.write_text(started * 2 + f"jaxgen: {BACKGROUND_COMPILE_ENDED[1]} decode 4 failed\n")
    with pytest.raises(TimeoutError, match="1 background compiles still running"):
        disagg.settle_compiles([str(a), str(b)], timeout=0.3)


def test_served_models_refit_from_saved_steps(tmp_path):
    """The served steps saved beside a result refit to the same models (`--resimulate`), and a
    padded fit explains steps timed by padded shapes better than the rows as they are."""
    from benchmarks.disagg.planner import LatencyModel

    pad = disagg.padding()
    truth = LatencyModel(prefill=(0.05, 1e-3, 1e-7), decode=(0.05, 4e-3, 1e-5),
                         transfer=(0.0, 1e-9), kv_bytes_per_token=100, max_kv_tokens=10_000,
                         padding=pad)  # fmt: skip
    steps = []
    for i in range(40):
        chunks = [[17 + 23 * i % 400, 0]] if i % 2 else []
        rows = 1 + i % 8
        steps.append(dict(chunks=chunks, decode_rows=rows, decode_context=50 * rows,
                          seconds=truth.mixed_seconds(chunks, rows, 50 * rows)))  # fmt: skip
    served = {"colocated": [steps[:20], steps[20:]], "disaggregated": [steps[1::2], steps]}
    path = disagg.steps_path(str(tmp_path / "disagg.json"))
    disagg.save_steps({"warmup": served, "replays": {"colocated": {"chat": [[steps]]}}}, path)
    assert path.endswith("disagg_steps.json.gz")
    iso = dataclasses.replace(truth, padding=None)
    loaded = disagg.load_steps(path)
    assert loaded["replays"]["colocated"]["chat"][0][0] == json.loads(json.dumps(steps))
    got = disagg.served_models(loaded["warmup"], iso)
    assert got == disagg.served_models(served, iso)
    disagg.save_steps(served, path)  # a file of warm-ups alone (before the replays were kept)
    assert disagg.load_steps(path) == {"warmup": json.loads(json.dumps(served)), "replays": {}}
    assert got["colocated"]["compile_fits"] == [None]  # no step compiled
    fit, raw = got["colocated"]["fits"][0], got["colocated"]["fits_unpadded"][0]
    assert fit["rel_max"] < 1e-6 < raw["rel_rms"]
    model = LatencyModel.from_dict(json.loads(json.dumps(got["colocated"]["models"][0])))
    assert model.padding == pad and model.prefill == pytest.approx(truth.prefill)


def test_prompt_texts_share_no_prefix():
    take = disagg.text_windows(list(range(100)))
    a, b, c = take(30), take(30), take(40)
    assert a + b + c == list(range(100))  # consecutive, disjoint
    with pytest.raises(PlanningError, match="too few"):
        take(1)


def served_model(**kw):
    from benchmarks.disagg.planner import LatencyModel

    return LatencyModel(prefill=(0.05, 1e-3, 1e-7), decode=(0.05, 4e-3, 1e-5),
                        transfer=(0.0, 1e-9), kv_bytes_per_token=100, max_kv_tokens=100_000,
                        max_num_seqs=disagg.MAX_NUM_SEQS, max_batched_tokens=disagg.BUDGET,
                        padding=disagg.padding(), **kw)  # fmt: skip


def timed_steps(model, factor: float, n: int = 12) -> list[dict]:
    """Steps as an instance logs them, each `factor` x what `model` predicts; one more that
    compiled, 10x slower."""
    out = []
    for i in range(n + 1):
        chunks = [[20 + 7 * i, 0]] if i % 3 == 0 else []
        rows, context = 1 + i % 4, 60 * (1 + i % 4)
        seconds = factor * model.mixed_seconds(chunks, rows, context) * (10 if i == n else 1)
        out.append(dict(chunks=chunks, decode_rows=rows, decode_context=context,
                        seconds=seconds, compiled=i == n))  # fmt: skip
    return out


def test_speed_of_a_replay_leaves_compiles_out():
    m = served_model()
    assert disagg.speed_of(timed_steps(m, 1.5), m) == pytest.approx(1.5)
    assert disagg.speed_of([], m) == 1.0


def test_resimulate_a_deployment_as_it_ran():
    """The simulated side of a (synthetic) measured result: the deployment's warm-ups and then
    its replays, the compiled programs carried over, and the served model at each replay's own
    speed (its saved steps ran 1x and 3x the model)."""
    model = served_model(compile=(2.0, 0.0, 0.0, 0.0, 0.0))
    n, scale = 12, disagg.SCALE
    spec = disagg.cpu_traces(scale)["chat"]
    assert len(traces.sample_lengths(spec, n, 0)) == n
    rates = [0.2, 0.4]
    runs = [dict(rate=r, attainment=1.0, compiles=0, ttft_s=[1.2] * n, tpot_s=[0.1] * n,
                 transfer={}) for r in rates]  # fmt: skip
    result = {
        "scale": scale, "requests": n, "model": dataclasses.replace(model, compile=()).to_dict(),
        "served": {"colocated": {"models": [model.to_dict()]}},
        "traces": {"chat": {"slo": {"ttft": 1.5, "tpot": 0.2, "target": 0.9},
                            "warmup": {"colocated": {"overhead_s": 0.01}},
                            "runs": {"colocated": runs}}},
    }  # fmt: skip
    replays = {
        "colocated": {
            "chat": [
                [timed_steps(model, 1.0), []],
                [timed_steps(model, 3.0), timed_steps(model, 3.0)],
            ]
        }
    }
    repeated = copy.deepcopy(result)
    repeated["traces"]["chat"]["warmup"]["colocated"]["repeated_rates"] = [0.4, 3.0]
    disagg.resimulate(result, steps={"replays": replays})  # fmt: skip
    disagg.resimulate(repeated, steps={"replays": replays}, sweep=False)  # fmt: skip
    # The simulated life includes a run's repeated warm-ups: the same requests replay the same
    # way at a rate already warmed up, and a busier one batches (and compiles) more; the
    # replays then compile no more than without them.
    sims = [r["traces"]["chat"]["simulated"]["colocated"] for r in (result, repeated)]
    assert sims[1]["warmup_compiles"] > sims[0]["warmup_compiles"]
    runs = [r["traces"]["chat"]["runs"]["colocated"] for r in (result, repeated)]
    assert sum(x["served_compiles"] for x in runs[1]) <= sum(x["served_compiles"] for x in runs[0])
    first, second = result["traces"]["chat"]["runs"]["colocated"]
    assert first["speed"] == pytest.approx([1.0]) and second["speed"] == pytest.approx([3.0])
    # At the model's own speed the two served sides agree; 3x slower, fewer requests meet
    # the SLOs. The warm-ups compiled most of the replays' programs (the replays batch a
    # little differently: no compile stalls them where one stalled the warm-up).
    assert first["speed_attainment"] == first["served_attainment"]
    assert second["speed_attainment"] < second["served_attainment"]
    warm = result["traces"]["chat"]["simulated"]["colocated"]["warmup_compiles"]
    assert first["served_compiles"] + second["served_compiles"] < warm
    assert first["isolated_compiles"] == 0  # the isolated model prices no compile
    good = result["traces"]["chat"]["goodput"]["colocated"]
    assert {"measured", "served", "speed", "isolated"} <= good.keys()
    assert result["traces"]["chat"]["simulated"]["colocated"]["served"] is not None
    # The SLO sweep: at scale 1 the run's own goodputs; every scale keeps the measured
    # requests' own times (1.2 s TTFT: all meet a 1.5 s SLO, none a 0.75 x 1.5 s one).
    sweep = result["slo_scales"]
    assert set(sweep) == {f"{x:g}" for x in disagg.SLO_SCALES}
    assert sweep["1"]["chat"]["colocated"] == good
    assert sweep["1.5"]["chat"]["colocated"]["measured"] == {"rps": 0.4, "bound": ">="}
    assert sweep["0.75"]["chat"]["colocated"]["measured"] == {"rps": 0.2, "bound": "<"}
    assert result["traces"]["chat"]["slo"]["ttft"] == 1.5  # the run's own SLOs are kept
    served = [sweep[k]["chat"]["colocated"]["served"]["rps"] for k in ("0.75", "1", "2")]
    assert served == sorted(served)  # looser SLOs: no lower simulated goodput
    assert "SLOs x1.5" in disagg.sweep_text(result)


def test_stalls_count_the_misses_alive_during_a_compile():
    """A replay's missed requests against its steps: one alive while a step compiled (its
    life runs to its last token: TTFT + TPOT x the answer's other tokens), one missed with
    no compile beside it, one met both SLOs while the compile ran."""
    slo = search.SLO(ttft=1.0, tpot=0.1, target=0.9)
    reqs = [simulator_request(5), simulator_request(3), simulator_request(2)]
    run = {"sent": [100.0, 200.0, 104.0], "ttft_s": [0.5, 2.0, 0.2],
           "tpot_s": [0.5, 0.05, 0.05]}  # fmt: skip
    # The first request lives 100.0-102.5 s; the compile runs 102.0-106.0 s (logged as it
    # landed). A 2.5 s step that compiled nothing is listed with its host.
    host = dict(cpu_seconds=0.4, gc_seconds=0.0, trace_seconds=0.0, compile_seconds=0.0,
                jax_compiles=0, compiled_functions=[])  # fmt: skip
    steps = [[{"time": 106.0, "seconds": 4.0, "compiled": True}],
             [{"time": 150.0, "seconds": 0.3, "covered": True}, {"time": 151.0, "seconds": 0.1},
              {"time": 160.0, "seconds": 2.5, **host}]]  # fmt: skip
    got = disagg.stalls(run, reqs, slo, steps)
    assert got == {"misses": 2, "during_compile": 1, "longest_covered_s": 0.3,
                   "long_steps": [[2.5, 0.4, 0.0, 0.0, 0.0, 0, []]]}  # fmt: skip
    # A shorter answer ends before the compile starts.
    reqs[0] = simulator_request(3)
    assert disagg.stalls(run, reqs, slo, steps)["during_compile"] == 0
    failed = {**run, "ttft_s": [None, 2.0, 0.2], "tpot_s": [None, 0.05, 0.05]}
    assert disagg.stalls(failed, reqs, slo, steps) == {**got, "during_compile": 0}
    result = {"traces": {"chat": {"runs": {"colocated": [{**run, "stalls": got}]}}}}
    assert "chat colocated 1 of 2 (longest step on a larger program 0.30 s)" in (
        disagg.stall_text(result)
    )
    assert disagg.stall_text({"traces": {"chat": {"runs": {"colocated": [run]}}}}) == ""


def simulator_request(output_len: int):
    from benchmarks.disagg import simulator

    return simulator.Request(arrival=0.0, prompt_len=16, output_len=output_len)


def test_slos_let_every_request_meet_the_ttft_alone():
    """The TTFT SLO is SLO_TTFT_X x the longest prompt's prefill alone (with the SLO of a
    median prompt, the longest prompts missed it on an idle deployment); the TPOT SLO is
    SLO_TPOT_X x one decode step at the median prompt's context."""
    model = served_model()
    lengths = [(100, 5), (700, 3), (50, 9), (120, 4), (90, 2)]
    slo = disagg.slos(model, lengths)
    assert slo.ttft == pytest.approx(disagg.SLO_TTFT_X * model.prefill_seconds([(700, 0)]))
    assert slo.tpot == pytest.approx(disagg.SLO_TPOT_X * model.decode_seconds(1, 100))
    assert all(model.prefill_seconds([(p, 0)]) * disagg.SLO_TTFT_X <= slo.ttft for p, _ in lengths)


def test_request_results_recount_attainment():
    run = dict(ttft_s=[0.5, None, 2.0], tpot_s=[0.1, None, 0.1])
    got = disagg.request_results(run)
    assert got[1] == {"error": "failed"}
    assert disagg.attainment_of(got, search.SLO(ttft=1.0, tpot=0.2)) == pytest.approx(1 / 3)
    assert disagg.attainment_of(got, search.SLO(ttft=3.0, tpot=0.2)) == pytest.approx(2 / 3)


def test_phase_split_of_a_disaggregated_ttft():
    """The router's prefill hop against the simulator's, and the rest of the TTFT, per rate
    (medians over the requests that have both; a failed request left out)."""
    run = dict(rate=0.5, ttft_s=[1.0, 2.0, None], prefill_s=[0.6, 1.2, None],
               served_ttft_s=[0.8, 1.6, 1.0], served_prefill_s=[0.5, 1.0, 0.7])  # fmt: skip
    (got,) = disagg.phase_split([run])
    assert got["hop"] == pytest.approx(0.9) and got["sim_hop"] == pytest.approx(0.75)
    assert got["rest"] == pytest.approx(0.6) and got["sim_rest"] == pytest.approx(0.45)
    assert disagg.phase_split([dict(run, prefill_s=None)]) is None  # a result before the hops


def test_disaggregation_text_from_the_run_itself():
    """Whether disaggregation paid comes from the run's goodput ratios, and the requests that
    missed each SLO are counted per deployment (a failed request misses neither here)."""
    runs = {
        "colocated": [dict(ttft_s=[1.0, 3.0, None], tpot_s=[0.5, 0.1, None])],
        "disaggregated": [dict(ttft_s=[3.0, 3.0, 1.0], tpot_s=[0.1, 0.1, 0.1])],
    }
    result = {"traces": {"chat": {"slo": {"ttft": 2.0, "tpot": 0.2}, "runs": runs,
                                  "goodput_ratio": 1.5}}}  # fmt: skip
    assert disagg.misses(result) == {
        "colocated": {"ttft": 1, "tpot": 1},
        "disaggregated": {"ttft": 2, "tpot": 0},
    }
    text = disagg.disaggregation_text(result)
    assert text.startswith("Disaggregation pays here") and "chat 1.50x" in text
    result["traces"]["summarization"] = dict(result["traces"]["chat"], goodput_ratio=0.7)
    text = disagg.disaggregation_text(result)
    assert text.startswith("Disaggregation pays on chat and not on summarization")
    result["traces"]["chat"]["goodput_ratio"] = 0.5
    assert disagg.disaggregation_text(result).startswith("Disaggregation does not pay")


def shaped(key, time: float) -> dict:
    names = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "decode_blocks",
             "prefill_fresh", "num_rows")  # fmt: skip
    shape = dict(zip(names, key, strict=True))
    return dict(time=time, seconds=0.1, chunks=[], decode_rows=key[0], decode_context=0,
                shape=shape, compiled=False, covered=False)  # fmt: skip


# A step log's `shape`, in `Padding.program`'s order.
SHAPE_FIELDS = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "decode_blocks",
                "prefill_fresh", "num_rows")  # fmt: skip


def test_a_replay_is_simulated_with_the_programs_its_instances_held():
    """Before each measured replay the simulated instances hold what the deployment's held
    then: the ahead-of-time programs (`jaxgen serve`'s `serving_buckets`) and every program
    their step logs show they ran before the replay began (not after)."""
    aot = disagg.ahead_of_time_programs()
    assert (0, 1, 32, 8, 0, True, 1) in aot
    assert (disagg.MAX_NUM_SEQS, 0, 0, 16, 0, True, disagg.MAX_NUM_SEQS) in aot
    a, b, c = (2, 0, 0, 8, 12, True, 2), (0, 2, 64, 8, 0, False, 2), (4, 0, 0, 8, 8, True, 4)
    steps = {"warmup": {"colocated": [[shaped(a, 1.0)], [shaped(b, 5.0)]]},
             "replays": {"colocated": {"chat": [[[shaped(c, 3.0)], []]]}}}  # fmt: skip
    assert disagg.deployed_programs(steps, "colocated", 4.0) == {0: {a, c}, 1: set()}
    assert disagg.deployed_programs(steps, "colocated", 9.0) == {0: {a, c}, 1: {b}}
    # A replay whose programs the instances all held compiles nothing in the simulation; with
    # none held but the ahead-of-time ones it compiles its own.
    from benchmarks.disagg import simulator

    model = served_model(compile=(2.0, 0.0, 0.0, 0.0, 0.0))
    n = 12
    reqs = traces.poisson_requests(traces.sample_lengths(disagg.cpu_traces()["chat"], n, 0), 0.4,
                                   traces.unit_gaps(n, 0))  # fmt: skip
    ran = simulator.Programs(ahead_of_time=aot)
    disagg.simulate("colocated", reqs, model, programs=ran)
    assert ran.compiles > 0
    logged = [[shaped(k, 1.0) for k in ran.known[i] - aot] for i in (0, 1)]
    run = dict(rate=0.4, attainment=1.0, compiles=0, ttft_s=[1.2] * n, tpot_s=[0.1] * n,
               transfer={}, sent=[100.0 + q.arrival for q in reqs])  # fmt: skip
    # The instances' own lists as they froze (`POST /freeze_programs`): every program, also
    # one compiled in the background that no logged step ran.
    shapes = [[dict(zip(SHAPE_FIELDS, k, strict=True)) for k in ran.known[i]] for i in (0, 1)]
    frozen_list = disagg.frozen_programs([{"programs": len(x), "shapes": x} for x in shapes])
    assert frozen_list["held"] == [sorted(ran.known[i]) for i in (0, 1)]
    for warm, want, frozen, listed in (
        (logged, 0, False, {}), ([[], []], None, False, {}), ([[], []], "frozen", True, {}),
        ([[], []], 0, True, frozen_list),
    ):  # fmt: skip
        result = {
            "scale": disagg.SCALE, "requests": n, "freeze_replays": frozen,
            "model": dataclasses.replace(model, compile=()).to_dict(),
            "served": {"colocated": {"models": [model.to_dict()]}},
            "traces": {"chat": {"slo": {"ttft": 1.5, "tpot": 0.2, "target": 0.9},
                                "warmup": {"colocated": {"overhead_s": 0.0, **listed}},
                                "runs": {"colocated": [dict(run)]}}},
        }  # fmt: skip
        steps = {"warmup": {"colocated": warm},
                 "replays": {"colocated": {"chat": [[[], []]]}}}  # fmt: skip
        disagg.resimulate(result, steps=steps, sweep=False)
        (got,) = result["traces"]["chat"]["runs"]["colocated"]
        if want is None:
            held_none = got["served_compiles"]
        elif want == "frozen":
            # Replays on frozen programs (`FREEZE_REPLAYS`): a step of a new shape runs on the
            # least-work ahead-of-time program covering it; only what none covers compiles.
            assert got["served_compiles"] < held_none and got["served_covered"] > 0
            assert got["served_background_compiles"] == 0
        else:
            assert got["served_compiles"] == want
    assert held_none > 0
