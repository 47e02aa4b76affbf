"""`python -m benchmarks batch --quick` runs end to end on the small random model (its numbers
are not judged here): the local job and the Ray job compared, every id once in both."""

import pytest

from tests.helpers import run_quick_bench


@pytest.mark.slow
def test_bench_batch_quick(tmp_path):
    result, stdout = run_quick_bench(
        "batch", tmp_path, "--random-weights", "--batch-parts", "", "--batch-default-mode"
    )
    names = [r["system"] for r in result["rows"]]
    assert names == [
        "jaxgen batch (default: not invariant)",
        "jaxgen batch --no-batch-invariant --ray --replicas 1",
    ]
    assert result["fault"] is None and result["invariant_cost"] is None
    assert result["model"].startswith("a random Llama") and result["ray_version"]
    assert all(r["engine_tok_s"] > 0 for r in result["rows"])
    assert "Ray's overhead (--no-batch-invariant)" in stdout
    assert (tmp_path / "batch.json.partial").exists()  # the runs so far, after each command
