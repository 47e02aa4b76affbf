"""`python -m benchmarks moe --quick` runs end to end (its numbers are not judged here)."""

import pytest

from tests.helpers import run_quick_bench


@pytest.mark.slow
def test_bench_moe_quick(tmp_path):
    result, stdout = run_quick_bench("moe", tmp_path)
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 2, 1, 2, 1, 2]
    assert {r["model"].split(":")[0] for r in rows} == {"mixtral", "qwen3_moe", "deepseek_v3"}
    assert all(r["ours_tok_s"] > 0 and r["ratio"] == r["ours_tok_s"] / r["hf_tok_s"] for r in rows)
    assert "### Mixture-of-Experts decode" in stdout
