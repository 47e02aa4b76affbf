"""Block-scaled FP8 weights (DeepSeek-V3's e4m3 values + weight_scale_inv per block): the block
arithmetic, a tiny DeepSeek-V3 checkpoint written as FP8 loaded dequantized (equal to the
dequantized weights; logits against transformers holding them) and kept FP8 as QArrays (logits
equal to the dequantized model's)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.model import forward, load_model
from jaxgen.model.errors import ModelLoadError
from jaxgen.quant.block_fp8 import (
    block_fp8_qarray,
    dequantize_block_fp8,
    quantize_block_fp8,
)
from jaxgen.quant.formats import QArray
from jaxgen.quant.matmul import matmul
from tests.helpers import hf_logits
from tests.model.test_mla import _model, _tokens

BLOCK = (16, 8)  # (out, in) sides small enough for the tiny model's several, ragged blocks


def test_block_arithmetic():
    rng = np.random.RandomState(0)
    w = rng.randn(2, 37, 21).astype(np.float32) * np.exp(rng.randn(2, 37, 1))
    values, scale_inv = quantize_block_fp8(w, BLOCK)
    assert values.dtype == jnp.float8_e4m3fn and scale_inv.shape == (2, 3, 3)
    deq = dequantize_block_fp8(values, scale_inv, BLOCK)
    # Each block's scale maps its absmax onto 448; e4m3 keeps 3 mantissa bits (2^-4 relative).
    np.testing.assert_allclose(deq, w, rtol=2**-4, atol=float(np.abs(w).max()) * 2**-9)
    q = block_fp8_qarray(values, scale_inv, BLOCK)
    assert isinstance(q, QArray) and q.shape == (2, 21, 37) and q.values.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.swapaxes(deq, -1, -2))
    x = rng.randn(5, 21).astype(np.float32)
    got = np.asarray(matmul(jnp.asarray(x), jax.tree.map(lambda a: a[1], q)))
    np.testing.assert_allclose(got, x @ deq[1].T, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="blocks"):
        dequantize_block_fp8(values, scale_inv[..., :2], BLOCK)


def _is_fp8_linear(name, w):
    return w.ndim == 2 and name.endswith("proj.weight")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The case's checkpoint with every linear ("*proj.weight", experts included) stored as
    block FP8; returns (directory, the dequantized tensors, transformers model, cfg)."""
    from safetensors.numpy import load_file, save_file

    hf, directory, cfg, _ = _model("v3-q-lora-grouped")
    out = tmp_path_factory.mktemp("fp8")
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        if _is_fp8_linear(name, w):
            values, scale_inv = quantize_block_fp8(w, BLOCK)
            stored[name], stored[name + "_scale_inv"] = values, scale_inv
            dequantized[name] = dequantize_block_fp8(values, scale_inv, BLOCK)
        else:
            stored[name] = w
    assert len(dequantized) > 20
    save_file(stored, str(out / "model.safetensors"))
    return str(out), dequantized, hf, cfg


def test_fp8_checkpoint_loads_dequantized_and_matches_transformers(fp8_checkpoint):
    import torch
    import transformers
    from safetensors.numpy import save_file

    from jaxgen.model.safetensors_io import HFCheckpoint

    directory, dequantized, _, cfg = fp8_checkpoint
    cfg2, params = load_model(directory, show_progress=False, fp8_weights="dequantize")
    assert cfg2 == cfg
    attn = params["layers"]["attn"]
    np.testing.assert_array_equal(
        attn["q_b_proj"]["kernel"][1], dequantized["model.layers.2.self_attn.q_b_proj.weight"].T
    )
    experts = params["layers"]["moe"]["experts"]["down_proj"]
    np.testing.assert_array_equal(
        experts[0, 3], dequantized["model.layers.1.mlp.experts.3.down_proj.weight"].T
    )
    # The same checkpoint written in f32 with the dequantized weights: the same params, and
    # transformers' logits on it.
    plain = os.path.join(os.path.dirname(directory), "dequantized")
    os.makedirs(plain, exist_ok=True)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(config, f)
    ckpt = HFCheckpoint(directory)
    tensors = {n: np.asarray(ckpt.get(n)) for n in ckpt.names() if not n.endswith("_scale_inv")}
    save_file({**tensors, **dequantized}, os.path.join(plain, "model.safetensors"))
    _, plain_params = load_model(plain, show_progress=False)
    jax.tree.map(np.testing.assert_array_equal, params, plain_params)
    ref = transformers.AutoModelForCausalLM.from_pretrained(plain, attn_implementation="eager")
    tokens = _tokens(cfg, seed=5)
    want = hf_logits(ref.eval().to(torch.float32), tokens)
    err = np.abs(np.asarray(forward(cfg, params, tokens)) - want).max()
    print(f"block FP8 dequantized vs transformers on the dequantized weights: {err:.3g}")
    assert err <= 1e-4


def test_fp8_checkpoint_kept_fp8_matches_dequantized(fp8_checkpoint):
    directory, _, _, cfg = fp8_checkpoint
    _, deq = load_model(directory, show_progress=False, fp8_weights="dequantize")
    _, kept = load_model(directory, show_progress=False, fp8_weights="keep")
    q_b = kept["layers"]["attn"]["q_b_proj"]["kernel"]
    assert isinstance(q_b, QArray) and q_b.values.dtype == jnp.float8_e4m3fn
    assert q_b.values.shape[0] == cfg.num_layers - 1  # stacked over the MoE layers
    # kv_b_proj is split per head by MLA, and routed experts run as grouped GEMMs: full precision
    assert not isinstance(kept["layers"]["attn"]["kv_b_proj"]["kernel"], QArray)
    assert not isinstance(kept["layers"]["moe"]["experts"]["gate_proj"], QArray)
    tokens = _tokens(cfg, seed=6)
    err = np.abs(np.asarray(forward(cfg, kept, tokens)) - np.asarray(forward(cfg, deq, tokens)))
    print(f"block FP8 kept vs dequantized: {err.max():.3g}")
    assert err.max() <= 1e-4


def test_fp8_typed_errors(fp8_checkpoint, tmp_path):
    directory, _, _, _ = fp8_checkpoint
    with pytest.raises(ValueError, match="fp8_weights"):
        load_model(directory, show_progress=False, fp8_weights="int8")
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    os.symlink(os.path.join(directory, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="block-scaled e4m3"):
        load_model(str(tmp_path), show_progress=False)
