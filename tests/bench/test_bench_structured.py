"""`jaxgen bench structured --quick` runs end to end (its numbers are not judged here)."""

import json
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def test_bench_structured_quick(tmp_path):
    from jaxgen.bench import structured

    out_json = tmp_path / "structured.json"
    before = DOCS.read_text()
    cmd = [sys.executable, "-m", "jaxgen.cli", "bench", "structured", "--quick"]
    out = subprocess.run(
        cmd + ["--out", str(out_json)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_json.read_text())
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
    assert "| greedy | 3 |" in out.stdout
    assert DOCS.read_text() == before
