"""Fixtures of the engine tests."""

import jax
import pytest

from jaxgen.model import ModelConfig, init_params
from tests.helpers import LORA_ADAPTERS, save_peft_adapter, tiny_hf_model


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


@pytest.fixture(scope="module")
def tiny_adapters(tiny, tmp_path_factory):
    """{name: directory} of the PEFT LoRA adapters of `tests.helpers.LORA_ADAPTERS`, saved by
    peft for a transformers Llama of the tiny model's shapes."""
    cfg = tiny[0]
    root = tmp_path_factory.mktemp("adapters")
    base = tiny_hf_model(
        str(root / "base"),
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    dirs = {}
    for seed, (name, kwargs) in enumerate(LORA_ADAPTERS.items()):
        dirs[name] = str(root / name)
        save_peft_adapter(base, dirs[name], seed, **kwargs)
    return dirs
