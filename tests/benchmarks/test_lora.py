"""`python -m benchmarks lora --quick` runs end to end (its numbers are not judged here), and the
random adapters it writes are PEFT adapters the loader reads."""

import numpy as np

from benchmarks import lora
from tests.helpers import run_quick_bench


def test_bench_lora_quick(tmp_path):
    result, stdout = run_quick_bench("lora", tmp_path)
    quick = lora.QUICK
    assert (result["batch"], result["num_adapters"], result["rank"]) == (
        quick["batch"],
        quick["num_adapters"],
        quick["rank"],
    )
    base, unused, adapted = result["rows"]
    assert [r["adapters"] for r in result["rows"]] == [0, 0, quick["num_adapters"]]
    assert base["ratio"] == 1 and all(r["tok_s"] > 0 for r in result["rows"])
    assert unused["differ"] == 0 < adapted["differ"]  # no adapter: the base model's tokens
    assert result["ratio"] == adapted["ratio"] and result["met"] == (adapted["ratio"] >= 0.7)
    assert "| LoRA engine, 2 adapters |" in stdout


def test_random_adapters_load(tmp_path):
    from jaxgen.model import ModelConfig, load_adapter

    cfg = ModelConfig(
        arch="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    adapter = load_adapter(lora.write_random_adapter(cfg, str(tmp_path), rank=4, seed=0), cfg)
    assert adapter.rank == 4 and len(adapter.modules) == 7
    a, b = adapter.modules["down_proj"]
    assert a.shape == (2, 48, 4) and b.shape == (2, 4, 32)
    assert np.abs(b).min() > 0  # B non-zero: the adapter changes the outputs
