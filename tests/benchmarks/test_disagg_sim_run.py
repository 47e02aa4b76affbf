"""`python -m benchmarks disagg-sim --quick` end to end (its numbers are not judged here), the H200
latency model's derivation from docs/gpu, and the engine profile on a tiny model."""

import pytest

from benchmarks.disagg import sim as disagg_sim
from benchmarks.disagg.planner import LatencyModel
from tests.engine.conftest import tiny  # noqa: F401  (fixture)
from tests.helpers import run_quick_bench


def test_bench_disagg_sim_quick(tmp_path):
    result, stdout = run_quick_bench("disagg-sim", tmp_path)
    assert "engine_profile" not in result  # --quick skips the engine
    assert result["host_copy"]["fit"]["num_samples"] == 5
    for name in ("summarization", "chat"):
        sim = result["sim"][name]
        kinds = {r["placement"]["kind"] for r in sim["placements"]}
        assert kinds == {"colocated", "disaggregated"}
        assert all(r["devices"] <= 4 for r in sim["placements"])
        assert [p["gpus"] for p in sim["projection"]] == [8, 8, 16, 16, 32, 32, 64, 64]
        for p in sim["projection"]:
            assert p["goodput_rps"] == pytest.approx(p["per_device_rps"] * p["gpus"])
    assert "SIMULATED" in stdout and "### Disaggregation planner" in stdout


def test_h200_model_reproduces_committed_step_times():
    model, src = disagg_sim.h200_model()
    assert isinstance(model, LatencyModel)
    ctx = src["decode_context"]
    for b, ms in src["decode_step_ms"].items():
        assert model.decode_seconds(b, int(b * ctx)) * 1e3 == pytest.approx(ms, rel=1e-3)
    p = src["prompt_len"]
    for b, tok_s in src["prefill_tok_s"].items():
        assert model.prefill_seconds([(p, 0)] * b) == pytest.approx(b * p / tok_s, rel=1e-6)
    weights, kv = disagg_sim.llama8b_bytes()
    assert kv == 131072 and 16.0e9 < weights < 16.1e9  # Llama-3-8B in bf16


def test_profile_engine_tiny(tiny, tmp_path):  # noqa: F811
    from jaxgen import LLM
    from jaxgen.model import save_checkpoint

    cfg, params, tok = tiny
    save_checkpoint(str(tmp_path), cfg, params, tok)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_seqs=4, warmup=False)
    prof = disagg_sim.profile_engine(
        llm,
        prefill=((1, 8), (1, 32), (2, 16), (1, 64)),
        decode_batches=(1, 2, 4),
        decode_prompt=8,
        decode_tokens=6,
    )
    assert [s["prompt_lens"] for s in prof["prefill_samples"]] == [[8], [32], [16, 16], [64]]
    # Contexts read back from the engine's per-step byte count lie within each batch's range.
    assert {s["batch"] for s in prof["decode_samples"]} <= {1, 2, 4}
    for s in prof["decode_samples"]:
        assert s["batch"] * 8 <= s["context"] <= s["batch"] * (8 + 6)
        assert s["seconds"] > 0
    assert prof["decode_fit"]["num_samples"] == len(prof["decode_samples"]) >= 3
    assert all(c >= 0 for c in prof["prefill_fit"]["coef"].values())
