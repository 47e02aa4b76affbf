"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers."""

import os

import jax
import numpy as np
import pytest

from jaxgen.model import forward
from jaxgen.model.loading import DEFAULT_MODEL_NAME, JAXGEN_CONFIG
from tests.helpers import hf_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius at sea level, but on a mountain",
]


def test_default_config(default_model):
    cfg, params = default_model
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    # On the device, not host numpy: numpy params would be re-uploaded on every jitted call.
    assert all(isinstance(p, jax.Array) for p in jax.tree.leaves(params))


@pytest.mark.slow
def test_default_logits_match_transformers(default_model, default_tokenizer, hf_default_model):
    cfg, params = default_model
    worst = 0.0
    for prompt in PROMPTS:
        ids = np.asarray([default_tokenizer(prompt)["input_ids"]])
        err = np.abs(np.asarray(forward(cfg, params, ids)) - hf_logits(hf_default_model, ids)).max()
        worst = max(worst, float(err))
    print(f"default model max |dlogit| = {worst:.3g}")
    assert worst <= 1e-3


def test_tokenizer_round_trips(default_tokenizer):
    texts = PROMPTS + ["naïve café — 東京 🚀", "  leading and trailing spaces  ", "a\n\nb\tc"]
    for text in texts:
        ids = default_tokenizer(text)["input_ids"]
        assert default_tokenizer.decode(ids) == text


def test_chat_template(default_tokenizer):
    ids = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert ids.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in ids


@pytest.mark.slow
def test_default_model_converted_once_into_cache(tmp_path, monkeypatch, capsys):
    from jaxgen.model import load_model

    monkeypatch.setenv("JAXGEN_CACHE", str(tmp_path))
    cfg, params = load_model(None)
    converted = tmp_path / "models" / DEFAULT_MODEL_NAME
    assert (converted / JAXGEN_CONFIG).is_file()
    assert "reading SmolLM2" in capsys.readouterr().err  # progress bar the first time
    mtime = os.path.getmtime(converted / JAXGEN_CONFIG)
    cfg2, _ = load_model(None)
    assert cfg2 == cfg and os.path.getmtime(converted / JAXGEN_CONFIG) == mtime
    assert "reading SmolLM2" not in capsys.readouterr().err
