"""`python -m benchmarks structured --quick` runs end to end (its numbers are not judged here)."""

import pytest

from benchmarks import structured
from tests.helpers import run_quick_bench


@pytest.mark.slow
def test_bench_structured_quick(tmp_path):
    result, stdout = run_quick_bench("structured", tmp_path)
    quick = structured.QUICK
    assert [v["outputs"] for v in result["validity"]] == [quick["num_schemas"]] * 2
    for v in result["validity"]:
        assert v["valid"] + len(v["failures"]) == v["outputs"]
        assert 0 <= v["finished"] <= v["outputs"]
    assert [r["batch"] for r in result["overhead"]] == list(quick["batches"])
    for r in result["overhead"]:
        assert r["tokens"] > 0 and r["constrained_tok_s"] > 0 and r["unconstrained_tok_s"] > 0
        assert r["mask_ms_per_step"] > 0
    assert result["grammar_cache"]["compiled"] == quick["num_schemas"]
    engine = result["engines"][0]  # llguidance (xgrammar too where it is importable)
    assert engine["engine"].startswith("llguidance") and engine["mask_us_per_token"] > 0
    assert "| greedy | 3 |" in stdout
