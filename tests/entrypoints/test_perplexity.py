"""Perplexity of the default model on wikitext-2 matches the same computation in transformers."""

import os

import numpy as np
import pytest
import torch

from jaxgen.entrypoints.perplexity import perplexity, windows
from jaxgen.model.tokenizer import read_text_tokens

WIKITEXT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "wikitext-2")


def test_windows_score_every_token_once():
    for n, length, stride in [(10, 4, 2), (4096, 1024, 512), (3, 8, 4), (100, 7, 6)]:
        scored = [t for _, end, first in windows(n, length, stride) for t in range(first, end)]
        assert scored == list(range(1, n))
    # Non-overlapping windows (stride == max_length): a window's first token has no context.
    scored = [t for _, end, first in windows(17, 5, 5) for t in range(first, end)]
    assert scored == [t for t in range(1, 17) if t % 5]


def hf_perplexity(model, ids, max_length, stride):
    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), max_length, stride):
        x = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
        nll = -logp.gather(-1, x[0, 1:, None])[:, 0].numpy()
        part = nll[first - begin - 1 :]
        total += part.sum()
        count += part.size
    return float(np.exp(total / count)), count


@pytest.mark.slow
def test_wikitext_perplexity_matches_transformers(
    default_model, default_tokenizer, hf_default_model
):
    path = os.path.join(WIKITEXT, "test.txt")
    ids = read_text_tokens(default_tokenizer, path, max_tokens=4096)
    assert len(ids) == 4096
    cfg, params = default_model
    ours = perplexity(cfg, params, ids, max_length=1024, stride=512)
    theirs, count = hf_perplexity(hf_default_model, ids, 1024, 512)
    print(f"perplexity ours={ours['perplexity']:.4f} transformers={theirs:.4f}")
    assert ours["tokens"] == count == 4095
    assert abs(ours["perplexity"] / theirs - 1) < 1e-3


def tiny_model():
    import jax

    from jaxgen.model import ModelConfig, init_params

    cfg = ModelConfig(
        arch="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    return cfg, init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("kv_quant", ["int8", "fp8"])
def test_perplexity_through_a_quantized_kv_cache_is_close(kv_quant):
    cfg, params = tiny_model()
    ids = np.random.RandomState(0).randint(0, 128, 300)
    full = perplexity(cfg, params, ids, max_length=128, stride=64)["perplexity"]
    quant = perplexity(cfg, params, ids, max_length=128, stride=64, kv_quant=kv_quant)
    assert quant["tokens"] == 299
    assert abs(quant["perplexity"] / full - 1) < 0.02


def test_progress_shows_the_job_and_the_running_perplexity(capsys):
    cfg, params = tiny_model()
    ids = np.random.RandomState(0).randint(0, 128, 100)
    result = perplexity(cfg, params, ids, max_length=32, stride=16, progress=True)
    err = capsys.readouterr().err
    assert "perplexity over 100 tokens (32-token windows, stride 16)" in err
    assert f"ppl={result['perplexity']:.3f}" in err and "6/6" in err
