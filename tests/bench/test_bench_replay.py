"""`jaxgen bench replay` end to end at a tiny size: a real `jaxgen serve` process, streamed
completions, and the compile counters it reads from the server's /metrics."""

import pytest

from tests.helpers import run_quick_bench


@pytest.mark.slow
def test_bench_replay_quick(tmp_path):
    serve = "--max-num-seqs 4 --max-model-len 256"
    result, stdout = run_quick_bench("replay", tmp_path, "--serve-args", serve)
    assert result["requests"] == 6 and result["errors"] == []
    assert result["serve"] == f"jaxgen serve {serve}"
    # Every request was answered (its first token timed) with the tokens asked for.
    assert result["ttft_p90_s"] > 0 and result["output_tokens"] >= 6
    assert all(8 <= n <= 70 for n in result["prompt_tokens"])  # re-tokenized text: near 8-64
    # The server compiled its whole ladder of step programs before /health, and nothing while
    # serving (the counter sees every XLA compile in the server process).
    assert result["programs_at_health"] >= 1
    assert result["programs_at_end"] == result["programs_at_health"]
    assert result["compiles_after_health"] == 0
    assert "| 6 | 0 |" in stdout
