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
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_proj.bias": "attn_q_a.bias",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_proj_with_mqa.bias": "attn_kv_a_mqa.bias",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
}


def _deepseek_keys(w, c, split_kv_b):
    """What llama.cpp's converter writes for DeepSeek-V2/V3 ("deepseek2"): MLA as MQA over the
    latent, the per-head widths as *_mla, the routing; kv_b_proj split per head into attn_k_b
    (transposed) and attn_v_b unless `split_kv_b` is False (older files keep attn_kv_b)."""
    rank, rope = c.kv_lora_rank, c.qk_rope_head_dim
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(c.qk_nope_head_dim + rope)
        w.add_value_length_mla(c.v_head_dim)
    else:
        w.add_key_length(c.qk_nope_head_dim + rope)
        w.add_value_length(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    v3 = c.model_type == "deepseek_v3"
    w.add_expert_weights_norm(bool(c.norm_topk_prob) if v3 else False)
    sigmoid = gguf.ExpertGatingFuncType.SIGMOID
    w.add_expert_gating_func(sigmoid if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3 and (c.n_group or 1) > 1:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(rope)
    rope_parameters = c.rope_parameters or {}
    if rope_parameters.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope_parameters["mscale_all_dim"])


def _split_kv_b(kv_b, c):
    """llama.cpp's split of kv_b_proj [N x (nope + v), R]: k_b [N, R, nope], v_b [N, v, R]."""
    heads = kv_b.shape[0] // (c.qk_nope_head_dim + c.v_head_dim)
    kv = kv_b.reshape(heads, c.qk_nope_head_dim + c.v_head_dim, -1)
    return kv[:, : c.qk_nope_head_dim].transpose(1, 2), kv[:, c.qk_nope_head_dim :]


def write_hf_gguf(path, hf_model, arch, types=None, tokenizer_from=None, split_kv_b=True):
    """Writes an HF model as GGUF the way llama.cpp's converter does (F32 unless `types`),
    with the tokenizer of the GGUF file `tokenizer_from` (llama.cpp needs one to load)."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer_from is not None:
        for key, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    experts = (
        getattr(c, "num_local_experts", None)
        or getattr(c, "num_experts", None)
        or getattr(c, "n_routed_experts", None)
    )
    if arch == "deepseek2":
        _deepseek_keys(w, c, split_kv_b)
    if experts:  # llama.cpp's MoE keys; Mixtral is written as "llama"
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
    types = types or {}
    state = dict(hf_model.state_dict())
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        # transformers 5 fuses each layer's experts [E, 2F, D]; llama.cpp stacks gate and up.
        gate_up = state.pop(name)
        half = gate_up.shape[1] // 2
        layer = name.split(".")[2]
        state[f"blk.{layer}.ffn_gate_exps.weight"] = gate_up[:, :half]
        state[f"blk.{layer}.ffn_up_exps.weight"] = gate_up[:, half:]
    for name in [n for n in state if n.endswith("kv_b_proj.weight") and split_kv_b]:
        layer = name.split(".")[2]
        k_b, v_b = _split_kv_b(state.pop(name), c)
        state[f"blk.{layer}.attn_k_b.weight"] = k_b
        state[f"blk.{layer}.attn_v_b.weight"] = v_b
    for name, t in state.items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name.startswith("blk."):
            gname = name
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


MOE_CASES = {
    "llama": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3moe": (
        "qwen3_moe",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True),
    ),
}


@pytest.mark.parametrize("arch", sorted(MOE_CASES))
def test_moe_gguf_logits_match_transformers(tmp_path, arch):
    """Mixtral (a "llama" file with an expert count) and Qwen3-MoE as llama.cpp writes them:
    each layer's experts stacked into ffn_{gate,up,down}_exps, the router as ffn_gate_inp."""
    from tests.model.test_moe import _decisive_routers

    hf_arch, overrides = MOE_CASES[arch]
    hf = tiny_hf_model(str(tmp_path / "hf"), hf_arch, num_hidden_layers=3, **overrides)
    _decisive_routers(hf)
    write_hf_gguf(tmp_path / "m.gguf", hf, arch)
    cfg, params = load_model(str(tmp_path / "m.gguf"), show_progress=False)
    experts = overrides.get("num_local_experts", overrides.get("num_experts"))
    assert cfg.arch == hf_arch and cfg.moe.num_experts == experts
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24))
    err = np.abs(np.asarray(forward(cfg, params, tokens)) - hf_logits(hf, tokens)).max()
    assert err <= 1e-4


@pytest.mark.parametrize("arch", [*sorted(MOE_CASES), "deepseek2"])
def test_moe_gguf_logits_match_llama_cpp(tmp_path, arch):
    """The same kind of file through llama.cpp itself (llama-cpp-python, the peers extra):
    equal logits say the stacked experts, the MoE and MLA keys and the split kv_b are read as
    llama.cpp reads them."""
    pytest.importorskip("llama_cpp", reason="the peers extra: pip install 'jaxgen[peers]'")
    import torch

    from jaxgen.bench import llamacpp
    from jaxgen.model.loading import default_gguf_path
    from tests.model.test_mla import CASES as MLA_CASES
    from tests.model.test_moe import _decisive_routers

    hf_arch, overrides = MOE_CASES.get(arch) or MLA_CASES["v3-q-lora-grouped"]
    # The default model's vocabulary: llama.cpp loads no file without a tokenizer.
    hf = tiny_hf_model(str(tmp_path / "hf"), hf_arch, **dict(overrides, vocab_size=49152))
    _decisive_routers(hf)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    path = str(tmp_path / "m.gguf")
    write_hf_gguf(path, hf, arch, tokenizer_from=default_gguf_path())
    cfg, params = load_model(path, show_progress=False)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, 16)
    ours = np.asarray(forward(cfg, params, tokens[None]))[0]
    llm = llamacpp.load(path, n_ctx=64, logits_all=True)
    llm.eval(tokens.tolist())
    theirs = np.asarray(llm.scores[: len(tokens)])
    assert np.abs(ours - hf_logits(hf, tokens[None])[0]).max() <= 1e-4
    assert np.abs(ours - theirs).max() <= 1e-3 * np.abs(theirs).max()


@pytest.mark.parametrize(
    "case,split_kv_b",
    [
        ("v3-q-lora-grouped", True),
        ("v2-greedy", True),
        ("v3-q-lora-grouped", False),
        ("v3-yarn", True),
    ],
    ids=["v3-grouped", "v2-greedy", "v3-kv_b-whole", "v3-yarn"],
)
def test_deepseek_gguf_logits_match_transformers(tmp_path, case, split_kv_b):
    """DeepSeek-V3 (sigmoid, bias-corrected, group-limited; with yarn) and V2 (softmax greedy)
    as llama.cpp writes them ("deepseek2"): MLA keys, kv_b_proj split per head into attn_k_b /
    attn_v_b (or whole, as older files have it), stacked and shared experts, dense leading
    layers."""
    from tests.model.test_mla import CASES, _model
    from tests.model.test_moe import _decisive_routers

    if case == "v3-yarn":
        # DeepSeek's yarn as llama.cpp keeps it: one mscale for both factors.
        yarn = CASES["v3-no-q-lora-yarn"][1]["rope_parameters"]
        yarn = dict(yarn, mscale=0.707, mscale_all_dim=0.707)
        overrides = dict(CASES["v3-q-lora-grouped"][1], rope_parameters=yarn)
        hf = tiny_hf_model(str(tmp_path / "hf"), "deepseek_v3", **overrides)
        _decisive_routers(hf)  # no near-ties for top-k to break either way
        hf.save_pretrained(str(tmp_path / "hf"))
        hf_cfg, hf_params = load_model(str(tmp_path / "hf"), show_progress=False)
        assert hf_cfg.rope_scaling.rope_type == "yarn"
    else:
        hf, _, hf_cfg, hf_params = _model(case)
    write_hf_gguf(tmp_path / "m.gguf", hf, "deepseek2", split_kv_b=split_kv_b)
    cfg, params = load_model(str(tmp_path / "m.gguf"), show_progress=False)
    assert cfg.arch == hf_cfg.arch and cfg.mla == hf_cfg.mla and cfg.moe == hf_cfg.moe
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 16))
    err = np.abs(np.asarray(forward(cfg, params, tokens)) - hf_logits(hf, tokens)).max()
    assert err <= 1e-4


def test_moe_gguf_files_we_cannot_read_are_typed_errors(tmp_path):
    """One tensor per expert (llama.cpp's old Mixtral layout) and MoE families we do not map
    fail before any tensor is read, naming what to do instead."""
    from jaxgen.model import ModelLoadError

    def write(path, arch, tensors, **keys):
        w = gguf.GGUFWriter(str(path), arch)
        for key, value in dict(
            block_count=1, context_length=64, embedding_length=8, feed_forward_length=16,
            head_count=2, vocab_size=4, expert_count=2, expert_used_count=1, **keys,
        ).items():  # fmt: skip
            getattr(w, f"add_{key}")(value)
        for name in tensors:
            w.add_tensor(name, np.zeros((2, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    old = ["token_embd.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate.0.weight"]
    write(tmp_path / "old.gguf", "llama", old)
    with pytest.raises(ModelLoadError, match="one tensor per expert.*re-convert"):
        load_model(str(tmp_path / "old.gguf"), show_progress=False)
    write(tmp_path / "qwen2moe.gguf", "qwen2moe", ["token_embd.weight"])
    with pytest.raises(ModelLoadError, match="'qwen2moe' is not supported.*qwen3moe"):
        load_model(str(tmp_path / "qwen2moe.gguf"), show_progress=False)
    # DeepSeek-V2's group_limited_greedy (softmax gating with expert groups)
    mla = dict(kv_lora_rank=4, rope_dimension_count=2, key_length=6, value_length=4)
    routing = dict(
        leading_dense_block_count=0,
        expert_gating_func=gguf.ExpertGatingFuncType.SOFTMAX,
        expert_group_count=2,
        expert_group_used_count=1,
    )
    moe = ["token_embd.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight"]
    write(tmp_path / "v2-groups.gguf", "deepseek2", moe, **mla, **routing)
    with pytest.raises(ModelLoadError, match="softmax gating and expert groups"):
        load_model(str(tmp_path / "v2-groups.gguf"), show_progress=False)


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
