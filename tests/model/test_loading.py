"""Orbax round trip, conversion, and a clear error for every kind of bad model source."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.model import (
    ModelConfig,
    ModelLoadError,
    convert,
    init_params,
    load_model,
    save_checkpoint,
)
from jaxgen.model.loading import load_checkpoint
from tests.helpers import tiny_hf_model
from tests.model.test_gguf import write_hf_gguf


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_is_bit_exact(tmp_path, dtype):
    cfg = ModelConfig(
        arch="qwen3",
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        qk_norm=True,
    )
    params = init_params(cfg, jax.random.key(0), dtype)
    save_checkpoint(str(tmp_path), cfg, params)
    cfg2, params2 = load_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_hf_to_jaxgen(tmp_path):
    tiny_hf_model(str(tmp_path / "hf"), "llama")
    # A tokenizer is needed for conversion; borrow the default model's.
    from jaxgen.model import load_tokenizer

    load_tokenizer(None).save_pretrained(str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "out"), show_progress=False)
    cfg_a, pa = load_model(str(tmp_path / "hf"), show_progress=False)
    cfg_b, pb = load_model(str(tmp_path / "out"))
    assert cfg_a == cfg_b
    for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".convert-")]


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope"))


def test_empty_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a jaxgen checkpoint"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path):
    tiny_hf_model(str(tmp_path), "llama")
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    tiny_hf_model(str(tmp_path), "llama")
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors.*(truncated|corrupt)"):
        load_model(str(tmp_path))


def test_garbage_safetensors(tmp_path):
    tiny_hf_model(str(tmp_path), "llama")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    tiny_hf_model(str(tmp_path), "llama")
    cfg_path = tmp_path / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf["intermediate_size"] = 100
    cfg_path.write_text(json.dumps(hf))
    with pytest.raises(ModelLoadError, match="model.safetensors.*gate_proj.*expects"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    tiny_hf_model(str(tmp_path), "llama")
    cfg_path = tmp_path / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf["model_type"] = "gpt_neox"
    cfg_path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="gpt_neox.*not supported"):
        load_model(str(tmp_path))


def test_unsupported_rope_scaling(tmp_path):
    tiny_hf_model(str(tmp_path), "llama")
    cfg_path = tmp_path / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    cfg_path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="yarn.*not supported"):
        load_model(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(str(path))


def test_truncated_gguf(tmp_path):
    hf = tiny_hf_model(str(tmp_path / "hf"), "llama")
    write_hf_gguf(tmp_path / "m.gguf", hf, "llama")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: int(len(data) * 0.7)])
    with pytest.raises(ModelLoadError, match="t.gguf"):
        load_model(str(tmp_path / "t.gguf"))


def test_non_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ModelLoadError, match="must be .gguf"):
        load_model(str(tmp_path / "weights.bin"))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("anything", dtype="float8")
