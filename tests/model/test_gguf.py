"""GGUF loading: name mapping, llama.cpp's Q/K permutation, and every supported tensor type."""

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from jaxgen.model import forward, load_model
from jaxgen.model.gguf_io import GGUFCheckpoint, permute_qk, unpermute_qk, write_gguf
from tests.helpers import hf_logits, tiny_hf_model

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_hf_gguf(path, hf_model, arch, types=None):
    """Writes an HF model as GGUF the way llama.cpp's converter does (F32 unless `types`)."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    types = types or {}
    for name, t in hf_model.state_dict().items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            gname = f"blk.{layer}.{_NAMES[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                arr = permute_qk(arr, c.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                arr = permute_qk(arr, c.num_key_value_heads)
        qtype = types.get(gname)
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(arr))
        elif callable(qtype):
            w.add_tensor(gname, qtype(arr), raw_dtype=qtype.qtype)
        else:
            w.add_tensor(gname, quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_logits_match_transformers(tmp_path, arch):
    hf = tiny_hf_model(str(tmp_path / "hf"), arch, tie_word_embeddings=arch == "llama")
    write_hf_gguf(tmp_path / "m.gguf", hf, arch)
    cfg, params = load_model(str(tmp_path / "m.gguf"), show_progress=False)
    assert cfg.tie_word_embeddings == (arch == "llama")
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24))
    err = np.abs(np.asarray(forward(cfg, params, tokens)) - hf_logits(hf, tokens)).max()
    assert err <= 1e-4


def test_unpermute_inverts_permute():
    w = np.random.RandomState(0).randn(3 * 16, 5)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


def _random_kquant_blocks(qtype, rows, cols, seed):
    """Random K-quant bytes with finite f16 super-block scales (gguf cannot quantize K-types)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.RandomState(seed)
    data = rng.randint(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    half = np.array([0.01], np.float16).view(np.uint8)
    if qtype == QT.Q4_K:  # d and dmin are the first two halves
        data[..., 0:2] = half
        data[..., 2:4] = half
    else:  # Q6_K: d is the last half
        data[..., -2:] = half
    return data.reshape(rows, -1)


@pytest.mark.parametrize(
    "qtype", [QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K], ids=lambda q: q.name
)
def test_tensor_types_dequantize(tmp_path, qtype):
    hf = tiny_hf_model(str(tmp_path / "hf"), "llama", intermediate_size=256)
    if qtype in (QT.Q4_K, QT.Q6_K):
        raw = _random_kquant_blocks(qtype, 64, 256, seed=3)

        def encoder(arr):
            return raw

        encoder.qtype = qtype
        spec = encoder
    else:
        spec = qtype
    write_hf_gguf(tmp_path / "m.gguf", hf, "llama", types={"blk.0.ffn_down.weight": spec})
    ckpt = GGUFCheckpoint(str(tmp_path / "m.gguf"))
    got = ckpt.get("model.layers.0.mlp.down_proj.weight")
    original = hf.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    assert got.shape == original.shape == (64, 256)
    if qtype in (QT.Q4_K, QT.Q6_K):
        np.testing.assert_array_equal(got, quants.dequantize(raw, qtype))
        assert np.isfinite(got).all() and got.std() > 0
    else:
        # Error bounded by the format's step: per-block absmax / levels.
        levels = {QT.F16: 2048, QT.Q8_0: 127, QT.Q4_0: 7, QT.Q4_1: 15}[qtype]
        blocks = np.abs(original.reshape(64, -1, 32)).max(-1, keepdims=True)
        step = np.broadcast_to(blocks, (64, 8, 32)).reshape(64, 256) / levels
        assert (np.abs(got - original) <= step + 1e-6).all()


def test_written_gguf_reads_back_exactly(tmp_path):
    """Our writer (f32 and f16): metadata copied from a source file, Q/K rows permuted the way
    llama.cpp stores them, and the loader's unpermutation gives back the same parameters."""
    hf = tiny_hf_model(str(tmp_path / "hf"), "llama", tie_word_embeddings=False)
    write_hf_gguf(tmp_path / "src.gguf", hf, "llama")
    cfg, params = load_model(str(tmp_path / "src.gguf"), show_progress=False)
    for dtype, tol in ((np.float32, 0.0), (np.float16, 1e-3)):
        out = str(tmp_path / f"out-{np.dtype(dtype).name}.gguf")
        write_gguf(out, cfg, params, metadata_from=str(tmp_path / "src.gguf"), dtype=dtype)
        cfg2, params2 = load_model(out, show_progress=False)
        assert cfg2 == cfg
        flat, flat2 = jax.tree.leaves(params), jax.tree.leaves(params2)
        assert len(flat) == len(flat2)
        for a, b in zip(flat, flat2, strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=tol, rtol=tol)
    assert GGUFCheckpoint(out)._reader.fields["general.file_type"].contents() == 1  # f16
