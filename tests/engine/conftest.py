"""Fixtures of the engine tests."""

import jax
import pytest

from jaxgen.model import ModelConfig, init_params


@pytest.fixture(scope="module")
def tiny(default_tokenizer):
    """(cfg, params, tokenizer) of a tiny random Llama with the default tokenizer's vocabulary:
    fast to compile, real text in and out."""
    cfg = ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_ids=(2,),
    )
    return cfg, init_params(cfg, jax.random.key(0)), default_tokenizer
