"""EAGLE heads in the Hugging Face layout the public checkpoints use: ``config.json`` plus
``model.safetensors`` (linear weights [out, in], as PyTorch stores them).

EAGLE-3 (yuhuili/EAGLE3-*, SpecForge; what vLLM's and SGLang's llama_eagle3 load):
  fc.weight [D, 3 Dt]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
  midlayer.self_attn.{q,k,v}_proj.weight [*, 2D], o_proj; midlayer.mlp.{gate,up,down}_proj;
  norm.weight; lm_head.weight [Vd, D]; d2t i64[Vd] (target id - draft id); t2d bool[V];
  optionally embed_tokens.weight. config.json: architectures ["LlamaForCausalLMEagle3"],
  draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids.
EAGLE-1/2 (yuhuili/EAGLE-*): fc.weight [D, 2D] and fc.bias; layers.0.self_attn.*,
  layers.0.post_attention_layernorm, layers.0.mlp.*; optionally embed_tokens.weight (and an
  input_layernorm EAGLE-1 never applies). config.json: a one-layer LlamaConfig with "bias".
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxgen.model.config import ModelConfig, RopeScaling
from jaxgen.model.eagle import EagleConfig, default_aux_layers
from jaxgen.model.errors import ModelLoadError
from jaxgen.model.safetensors_io import HFCheckpoint

WEIGHTS = "model.safetensors"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _prefix(cfg: EagleConfig) -> str:
    return "midlayer." if cfg.version == 3 else "layers.0."


def hf_config(cfg: EagleConfig) -> dict:
    """The head's config.json."""
    out = {
        "architectures": [EAGLE3_ARCH if cfg.version == 3 else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "jaxgen_eagle_version": cfg.version,
    }
    if cfg.rope_scaling.rope_type != "default":
        rs = {k: v for k, v in vars(cfg.rope_scaling).items() if v is not None}
        out["rope_scaling"] = rs
    if cfg.version == 3:
        out["draft_vocab_size"] = cfg.head_vocab_size
        out["target_hidden_size"] = cfg.target_hidden_size
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
            "use_aux_hidden_state": True,
        }
    else:
        out["bias"] = True
    return out


def config_from_hf(hf: dict, target: ModelConfig) -> EagleConfig:
    """An `EagleConfig` from a head's config.json, for drafting on `target`."""
    archs = hf.get("architectures") or []
    version = hf.get("jaxgen_eagle_version") or (3 if any("Eagle3" in a for a in archs) else 2)
    rope = hf.get("rope_scaling") or {}
    aux = ()
    if version == 3:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else default_aux_layers(target.num_layers)
    try:
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        return EagleConfig(
            version=int(version),
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            vocab_size=hf.get("vocab_size", target.vocab_size),
            target_hidden_size=hf.get("target_hidden_size") or hidden,
            draft_vocab_size=(hf.get("draft_vocab_size") if version == 3 else None),
            aux_layers=aux,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=RopeScaling(
                rope_type=rope.get("rope_type", rope.get("type", "default")),
                **{k: v for k, v in rope.items() if k not in ("rope_type", "type")},
            ),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
        )
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"EAGLE head config.json lacks or mistypes {e}") from e


def _hf_tensors(cfg: EagleConfig, params: dict, draft_to_target) -> dict[str, np.ndarray]:
    """HF-named tensors of a head's params ([in, out] kernels transposed to [out, in])."""
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    p, layer = _prefix(cfg), params["layer"]
    out = {"fc.weight": f32(params["fc"]["kernel"]).T.copy()}
    if cfg.version < 3:
        out["fc.bias"] = f32(params["fc"]["bias"])
    for name in _LINEARS:
        out[f"{p}self_attn.{name}.weight"] = f32(layer[name]["kernel"]).T.copy()
    for name in _MLP:
        out[f"{p}mlp.{name}.weight"] = f32(layer["mlp"][name]["kernel"]).T.copy()
    out[f"{p}post_attention_layernorm.weight"] = f32(layer["mlp_norm"]["scale"])
    if cfg.version == 3:
        out[f"{p}input_layernorm.weight"] = f32(layer["attn_norm"]["scale"])
        out[f"{p}hidden_norm.weight"] = f32(layer["hidden_norm"]["scale"])
        out["norm.weight"] = f32(params["norm"]["scale"])
        out["lm_head.weight"] = f32(params["lm_head"]["kernel"]).T.copy()
        ids = (
            np.arange(cfg.head_vocab_size)
            if draft_to_target is None
            else np.asarray(draft_to_target, np.int64)
        )
        out["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        t2d = np.zeros(cfg.vocab_size, np.bool_)
        t2d[ids] = True
        out["t2d"] = t2d
    if "embed" in params:
        out["embed_tokens.weight"] = f32(params["embed"])
    return out


def save_head(directory: str, cfg: EagleConfig, params: dict, draft_to_target=None) -> None:
    """Writes config.json + model.safetensors in the public EAGLE layout."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f, indent=2)
    save_file(_hf_tensors(cfg, params, draft_to_target), os.path.join(directory, WEIGHTS))


def load_head(directory: str, target: ModelConfig, dtype=np.float32):
    """Reads an EAGLE head for `target` from its HF layout: (EagleConfig, params,
    draft_to_target i32[Vd] or None). Shapes are checked against the config."""
    ckpt = HFCheckpoint(directory)
    cfg = config_from_hf(ckpt.config, target)
    cfg.check_target(target)
    d, kh = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    nh, f = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    attn_in = 2 * d if cfg.version == 3 else d

    def read(name, shape, transpose=False):
        w = ckpt.get(name)
        if tuple(w.shape) != tuple(shape):
            raise ModelLoadError(
                f"{ckpt.file_of(name)}: tensor {name!r} has shape {tuple(w.shape)} but the head's "
                f"config expects {tuple(shape)}"
            )
        w = np.asarray(w, dtype)
        return w.T.copy() if transpose else w

    p = _prefix(cfg)
    shapes = {"q_proj": (nh, attn_in), "k_proj": (kh, attn_in), "v_proj": (kh, attn_in)}
    shapes |= {"o_proj": (d, nh)}
    layer = {n: {"kernel": read(f"{p}self_attn.{n}.weight", s, True)} for n, s in shapes.items()}
    layer |= {
        "mlp": {
            "gate_proj": {"kernel": read(f"{p}mlp.gate_proj.weight", (f, d), True)},
            "up_proj": {"kernel": read(f"{p}mlp.up_proj.weight", (f, d), True)},
            "down_proj": {"kernel": read(f"{p}mlp.down_proj.weight", (d, f), True)},
        },
        "mlp_norm": {"scale": read(f"{p}post_attention_layernorm.weight", (d,))},
    }
    fc_in = 3 * cfg.target_hidden_size if cfg.version == 3 else 2 * d
    params = {"fc": {"kernel": read("fc.weight", (d, fc_in), True)}, "layer": layer}
    draft_to_target = None
    if cfg.version == 3:
        layer["attn_norm"] = {"scale": read(f"{p}input_layernorm.weight", (d,))}
        layer["hidden_norm"] = {"scale": read(f"{p}hidden_norm.weight", (d,))}
        params["norm"] = {"scale": read("norm.weight", (d,))}
        params["lm_head"] = {"kernel": read("lm_head.weight", (cfg.head_vocab_size, d), True)}
        if "d2t" in ckpt:
            offsets = np.asarray(ckpt.get("d2t"), np.int64)
            if offsets.shape != (cfg.head_vocab_size,):
                raise ModelLoadError(
                    f"{ckpt.file_of('d2t')}: d2t has shape {offsets.shape}, expected "
                    f"({cfg.head_vocab_size},)"
                )
            ids = offsets + np.arange(cfg.head_vocab_size)
            if ids.min() < 0 or ids.max() >= cfg.vocab_size:
                raise ModelLoadError(f"{ckpt.file_of('d2t')}: d2t maps outside the vocabulary")
            if not np.array_equal(ids, np.arange(cfg.head_vocab_size)):
                draft_to_target = ids.astype(np.int32)
        elif cfg.head_vocab_size != cfg.vocab_size:
            raise ModelLoadError(
                f"{directory}: a reduced draft vocabulary ({cfg.head_vocab_size} of "
                f"{cfg.vocab_size}) needs its d2t map"
            )
    else:
        params["fc"]["bias"] = read("fc.bias", (d,))
    if "embed_tokens.weight" in ckpt:
        params["embed"] = read("embed_tokens.weight", (cfg.vocab_size, d))
    return cfg, params, draft_to_target
