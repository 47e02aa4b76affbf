"""`python -m benchmarks sharing --quick` runs end to end (its numbers are not judged here)."""

import json
import subprocess
import sys

import pytest

from benchmarks import study_env
from tests.helpers import docs_pages


@pytest.mark.slow
def test_bench_sharing_quick(tmp_path):
    from benchmarks import sharing

    out_json = tmp_path / "sharing.json"
    before = docs_pages()
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "sharing", "--quick", "--out", str(out_json)],
        env=study_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_json.read_text())
    quick = sharing.QUICK
    assert len(result["prompt_lens"]) == quick["requests"]
    assert all(
        quick["prompt_range"][0] <= n <= quick["prompt_range"][1] for n in result["prompt_lens"]
    )
    assert len(result["output_lens"]) == quick["requests"]
    assert all(
        quick["output_range"][0] <= n <= quick["output_range"][1] for n in result["output_lens"]
    )
    rows = {(r["kind"], r["k"], r["engine"]): r for r in result["rows"]}
    engines = ("jaxgen, sharing on", "jaxgen, sharing off", "transformers")
    configs = [("sampling", n) for n in quick["samples"]] + [("beam", w) for w in quick["widths"]]
    assert set(rows) == {(kind, k, e) for kind, k in configs for e in engines}
    for kind, k in configs:
        on, off = rows[kind, k, engines[0]], rows[kind, k, engines[1]]
        assert on["fork_pages_copied"] == 0 < off["fork_pages_copied"]
        assert 0 < on["peak_pages"] <= result["pool_pages"]
        assert 0 < off["peak_pages"] <= result["pool_pages"]
        assert on["tok_s"] > 0 and off["tok_s"] > 0 and rows[kind, k, engines[2]]["tok_s"] > 0
    assert len(result["targets"]) == len(sharing.TARGETS)
    assert f"| sampling | {quick['samples'][0]} | jaxgen, sharing on |" in out.stdout
    assert docs_pages() == before
