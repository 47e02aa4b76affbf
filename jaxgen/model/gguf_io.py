"""Reading and writing GGUF files (llama.cpp) with the `gguf` package: metadata, tensors,
tokenizer.

GGUF stores Llama/Mistral Q and K projection rows permuted for llama.cpp's interleaved
("GPT-J") rotary layout; `unpermute_qk` undoes that so the weights fit the rotate-half layout
that transformers and we use, and `permute_qk` redoes it when we write. Qwen2/Qwen3 files are
written unpermuted.
"""

from __future__ import annotations

import os

import numpy as np

from jaxgen.model.errors import ModelLoadError

# GGUF tensor name -> Hugging Face name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    # DeepSeek's Multi-head Latent Attention ("deepseek2" files)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a.bias": "self_attn.q_a_proj.bias",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_mqa.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PERMUTED_ARCHS = ("llama", "mistral")
# A MoE layer's tensors -> names under the family's MoE block (`MOE_BLOCKS`): the router as
# Hugging Face names it, and llama.cpp's stacked experts ([E, out, in] each) as
# "experts.{gate,up,down}_exps", which the loader reads whole.
_MOE_LAYER_NAMES = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_exps.weight": "experts.gate_exps",
    "ffn_up_exps.weight": "experts.up_exps",
    "ffn_down_exps.weight": "experts.down_exps",
    "exp_probs_b.bias": "gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "shared_experts.down_proj.weight",
}
# GGUF architecture -> the Hugging Face module holding a layer's experts (Mixtral says "llama").
MOE_BLOCKS = {"llama": "block_sparse_moe", "qwen3moe": "mlp", "deepseek2": "mlp"}


def hf_name(gguf_name: str, moe_block: str | None = None) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return None
    if parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    if moe_block is not None and parts[2] in _MOE_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{moe_block}.{_MOE_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permutation of Q/K rows ([out, ...] layout)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert-time permutation of Q/K rows ([out, ...] layout); inverse of
    `unpermute_qk`."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _field_value(field):
    import gguf

    value = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.types) > 1:
        if field.types[-1] != gguf.GGUFValueType.STRING and not isinstance(value, list):
            return np.asarray(value)
    return value


def _open(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
            "is it truncated or corrupt?"
        ) from e


def read_tokenizer_metadata(path: str) -> dict:
    """The file's ``tokenizer.*`` metadata, keyed without the ``tokenizer.`` prefix."""
    meta = {}
    for key, field in _open(path).fields.items():
        if key.startswith("tokenizer."):
            try:
                meta[key.removeprefix("tokenizer.")] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{path}: cannot decode metadata field {key!r}: {e}") from e
    return meta


class GGUFCheckpoint:
    """A GGUF file: config metadata and dequantized tensors under Hugging Face names."""

    def __init__(self, path: str):
        self.path = path
        self._reader = _open(path)
        size = os.path.getsize(path)
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"{path}: tensor {t.name!r} runs past the end of the file")
        self.fields = {}
        for key, field in self._reader.fields.items():
            if key.startswith("tokenizer.ggml.") and key.endswith(
                ("tokens", "merges", "token_type", "scores")
            ):
                continue  # large arrays: read_tokenizer_metadata reads them when asked
            try:
                self.fields[key] = _field_value(field)
            except Exception as e:
                raise ModelLoadError(f"{path}: cannot decode metadata field {key!r}: {e}") from e
        vocab_key = f"{self.arch}.vocab_size"
        if vocab_key not in self.fields and "tokenizer.ggml.tokens" in self._reader.fields:
            self.fields[vocab_key] = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        self._tensors = {}
        moe_block = (
            MOE_BLOCKS.get(self.arch) if self.fields.get(f"{self.arch}.expert_count") else None
        )
        for t in self._reader.tensors:
            name = hf_name(t.name, moe_block)
            if name is not None:
                self._tensors[name] = t
        self.tensor_names = {t.name for t in self._reader.tensors}
        # llama.cpp splits DeepSeek's kv_b_proj per head into attn_k_b ([N, R, nope], the key
        # part transposed for the absorbed form) and attn_v_b ([N, v, R]); get() joins them.
        by_name = {t.name: t for t in self._reader.tensors}
        self._kv_b = {}
        for t in self._reader.tensors:
            if t.name.endswith(".attn_k_b.weight"):
                v_b = by_name.get(t.name.replace("attn_k_b", "attn_v_b"))
                layer = t.name.split(".")[1]
                if v_b is not None:
                    self._kv_b[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = (t, v_b)

    @property
    def arch(self) -> str:
        return self.fields.get("general.architecture", "")

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._kv_b

    def _dequantize(self, t) -> np.ndarray:
        from gguf import quants

        try:
            return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: cannot dequantize {t.name!r} of type {t.tensor_type.name}: {e}"
            ) from e

    def get(self, name: str) -> np.ndarray:
        if name in self._kv_b and name not in self._tensors:
            k_b, v_b = (self._dequantize(t) for t in self._kv_b[name])
            if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
                raise ModelLoadError(
                    f"{self.path}: {name!r}: attn_k_b {k_b.shape} and attn_v_b {v_b.shape} are "
                    "not [heads, rank, nope] and [heads, v, rank]"
                )
            kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [N, nope + v, R]
            return kv.reshape(-1, k_b.shape[1])
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor for {name!r} is missing from the GGUF file")
        t = self._tensors[name]
        w = self._dequantize(t)
        if self.arch in _PERMUTED_ARCHS:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_qk(w, int(self.fields[f"{self.arch}.attention.head_count"]))
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                heads = self.fields.get(f"{self.arch}.attention.head_count_kv")
                w = unpermute_qk(w, int(heads or self.fields[f"{self.arch}.attention.head_count"]))
        return w

    def file_of(self, name: str) -> str:
        return self.path


# Our parameter path (under "layers") -> GGUF tensor suffix.
_WRITE_LINEARS = {
    ("attn", "q_proj"): "attn_q",
    ("attn", "k_proj"): "attn_k",
    ("attn", "v_proj"): "attn_v",
    ("attn", "o_proj"): "attn_output",
    ("mlp", "gate_proj"): "ffn_gate",
    ("mlp", "up_proj"): "ffn_up",
    ("mlp", "down_proj"): "ffn_down",
}


def write_gguf(path: str, cfg, params, metadata_from: str, dtype=np.float32) -> None:
    """Writes a float model (dense Llama-style params) as a GGUF file llama.cpp can read.

    Args:
      cfg: the model's `ModelConfig`; params: its float parameter tree (no QArrays).
      metadata_from: a GGUF file of the same model whose metadata (architecture, hyper-
        parameters, tokenizer) is copied; its `general.file_type` is set from `dtype`.
      dtype: np.float32 or np.float16 for the tensors (norms stay f32, as llama.cpp writes them).
    """
    import gguf

    if cfg.qk_norm or "layers" not in params or "experts" in params["layers"].get("mlp", {}):
        raise ModelLoadError("write_gguf writes dense Llama-style models without q/k norms")
    source = _open(metadata_from)
    arch = str(source.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(path, arch)
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    ftype = gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(ftype)

    def add(name, w, keep_f32=False):
        w = np.asarray(w, np.float32 if keep_f32 else dtype)
        writer.add_tensor(name, np.ascontiguousarray(w))

    add("token_embd.weight", params["embed"])
    add("output_norm.weight", params["final_norm"]["scale"], keep_f32=True)
    if "lm_head" in params:
        add("output.weight", np.asarray(params["lm_head"]["kernel"]).T)
    layers = params["layers"]
    permuted = arch in _PERMUTED_ARCHS
    for i in range(cfg.num_layers):
        add(f"blk.{i}.attn_norm.weight", layers["attn_norm"]["scale"][i], keep_f32=True)
        add(f"blk.{i}.ffn_norm.weight", layers["mlp_norm"]["scale"][i], keep_f32=True)
        for (group, name), gname in _WRITE_LINEARS.items():
            linear = layers[group][name]
            w = np.asarray(linear["kernel"][i], np.float32).T  # [out, in], as GGUF stores it
            heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(name)
            if permuted and heads:
                w = permute_qk(w, heads)
            add(f"blk.{i}.{gname}.weight", w)
            if "bias" in linear:
                b = np.asarray(linear["bias"][i], np.float32)
                add(f"blk.{i}.{gname}.bias", permute_qk(b, heads) if permuted and heads else b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
