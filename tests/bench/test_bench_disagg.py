"""bench.disagg's own arithmetic (the deployments themselves run in the benchmark): the CPU-sized
traces, the goodput crossing between measured rates, SLO attainment of client results, and the
summary's transfer figures and simulator error."""

from jaxgen.bench import disagg
from jaxgen.entrypoints.disagg import search, traces


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
    def runs(att, sim, transfer=None):
        return [
            dict(rate=r, attainment=a, simulated_attainment=s, ttft_s=[1.0, 2.0, None],
                 transfer=transfer or {})
            for r, a, s in zip((1.0, 2.0, 3.0), att, sim, strict=True)
        ]  # fmt: skip

    moved = {"decode_bytes_read": 2e9, "decode_lookup_s": 0.5}
    result = {"traces": {"chat": {
        "simulated_goodput": {"colocated": 2.4, "disaggregated": None},
        "runs": {
            "colocated": runs((1.0, 0.9, 0.5), (1.0, 0.95, 0.7)),
            "disaggregated": runs((1.0, 1.0, 0.8), (1.0, 1.0, 1.0), moved),
        },
    }}}  # fmt: skip
    disagg.summarize(result)
    row = result["traces"]["chat"]
    colo, dis = row["goodput"]["colocated"], row["goodput"]["disaggregated"]
    assert colo["measured"] == {"rps": 2.0, "bound": "="}
    assert abs(colo["simulated_at_rates"]["rps"] - 2.2) < 1e-9
    assert abs(colo["simulator_error"] - 0.1) < 1e-9
    assert abs(dis["measured"]["rps"] - 2.5) < 1e-9 and dis["simulator_error"] is None  # >= 3
    assert abs(row["goodput_ratio"] - 1.25) < 1e-9
    # 3 replays x 2e9 bytes in 3 x 0.5 s; 1.5 s of the 9 s of TTFT.
    assert abs(row["transfer"]["gbps"] - 4.0) < 1e-9
    assert abs(row["transfer"]["share_of_ttft"] - 1.5 / 9.0) < 1e-9
