"""`python -m benchmarks overhead --quick` runs end to end (its numbers are not judged here),
and its span arithmetic."""

import json
import subprocess
import sys

import pytest

from benchmarks import study_env


@pytest.mark.slow
def test_bench_overhead_quick(tmp_path):
    out_json = tmp_path / "overhead.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "overhead",
            "--quick",
            "--out",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=study_env(),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [
        (1, "on"),
        (1, "off"),
        (4, "on"),
        (4, "off"),
    ]
    for r in rows:
        parts = sum(r[f"{k}_ms"] for k in ("schedule", "pack", "dispatch", "wait", "update"))
        assert 0 < parts <= r["step_ms"] and r["outside_engine_ms"] >= 0
        assert r["host_ms"] == pytest.approx(r["step_ms"] - r["wait_ms"])
        assert 0 < r["device_ms"] and 0 < r["alone_over_step"] <= 1.5  # replay vs in-loop noise
        assert 0 < r["device_busy"] <= 1  # a share of the traced call's wall time
        assert r["steps"] >= 4  # a prefill step and decode steps
    assert [g["shape"] for g in result["gemm"]] == [
        "[32,576] x [576,1536]",
        "[32,1536] x [1536,576]",
        "[32,576] x [576,49152]",
    ]
    assert all(g["xla_gflops"] > 0 and g["torch_gflops"] > 0 for g in result["gemm"])
    whole = result["whole_calls"]
    assert [(r["batch"], r["overlap"]) for r in whole] == [
        (1, "on"),
        (1, "off"),
        (2, "on"),
        (2, "off"),
    ]
    for r in whole:
        assert r["ratio"] == pytest.approx(r["hf_s"] / r["ours_s"]) and r["ours_s"] > 0
        assert r["ours_decode_tok_s"] > 0 and r["hf_decode_tok_s"] > 0
    assert "| batch | overlap | step ms | device ms |" in out.stdout
    assert "| batch | overlap | jaxgen s | transformers s |" in out.stdout


def test_union_of_spans_is_clipped_and_counts_overlaps_once():
    from benchmarks.overhead import _union_ms

    spans = [(5, 8), (0, 2), (1, 3), (7, 12), (20, 30)]
    # [0,3) + [5,12) inside [1, 25): [1,3) + [5,12) + [20,25)
    assert _union_ms(spans, 1, 25) == 2 + 7 + 5
    assert _union_ms(spans, 13, 19) == 0
    assert _union_ms([], 0, 10) == 0
