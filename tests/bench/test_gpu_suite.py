"""The GPU suite's --dry-run exercises every step at tiny sizes on the CPU."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_suite_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "jaxgen", "bench", "gpu_suite.sh"), str(tmp_path), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert out.returncode == 0, out.stdout + out.stderr + summary
    for step in ("device", "env", "gpu-tests", "profile", "flash", "paged", "prefill", "e2e"):
        assert f"{step} ok" in summary, summary
    report = (tmp_path / "gpu_suite.md").read_text()
    assert "FlashAttention kernel" in report and "Paged decode attention" in report
    assert "End-to-end decode" in report and "One decode step, device time" in report
    assert "Chunked prefill over a paged prefix" in report
    assert "report ok" in summary, summary
