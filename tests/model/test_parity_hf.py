"""Logit parity against transformers (PyTorch, CPU, f32) on tiny random models."""

import numpy as np
import pytest

from jaxgen.model import forward, load_model
from tests.helpers import hf_logits, tiny_hf_model

TOL = 1e-4
SEQ = 40

CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-head-dim-24": ("llama", dict(head_dim=24)),
    "llama3-rope": (
        "llama",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
        ),
    ),
    "llama-linear-rope": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "mistral-window": ("mistral", dict(sliding_window=7)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    hf = tiny_hf_model(str(tmp_path), arch, **overrides)
    cfg, params = load_model(str(tmp_path), show_progress=False)
    assert cfg.arch == arch
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, SEQ))
    want = hf_logits(hf, tokens)
    got = np.asarray(forward(cfg, params, tokens))
    err = np.abs(got - want).max()
    assert err <= TOL, f"{case}: max |dlogit| = {err:.3g}"


def test_config_flags_follow_hf(tmp_path):
    tiny_hf_model(str(tmp_path / "q3"), "qwen3")
    tiny_hf_model(str(tmp_path / "q2"), "qwen2")
    tiny_hf_model(str(tmp_path / "m"), "mistral", sliding_window=7)
    q3, _ = load_model(str(tmp_path / "q3"), show_progress=False)
    q2, _ = load_model(str(tmp_path / "q2"), show_progress=False)
    m, _ = load_model(str(tmp_path / "m"), show_progress=False)
    assert q3.qk_norm and not q3.qkv_bias
    assert q2.qkv_bias and not q2.o_bias
    assert m.sliding_window == 7


def test_sharded_safetensors(tmp_path):
    hf = tiny_hf_model(str(tmp_path), "llama", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg, params = load_model(str(tmp_path), show_progress=False)
    tokens = np.arange(12)[None] % cfg.vocab_size
    assert np.abs(np.asarray(forward(cfg, params, tokens)) - hf_logits(hf, tokens)).max() <= TOL
