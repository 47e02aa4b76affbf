"""Multi-LoRA on one base model: PEFT adapters loaded, stacked, and applied per token.

    adapters = [load_adapter(path, cfg) for path in paths]     # host numpy, one per adapter
    weights = stack_adapters(cfg, adapters)                      # LoRAWeights, on the device
    lora = LoRABatch(weights, adapter_ids)                       # i32[B, T]; -1 = base model
    logits, kv = Transformer(cfg).apply({"params": params}, tokens, positions, kv, md,
                                        lora=lora)

A targeted linear computes ``y = x @ W + (x @ A[i]) @ B[i]`` with i the token's adapter
(Hu et al. 2021, eq. 3). PEFT's scaling (alpha / r; alpha / sqrt(r) with rsLoRA, Kalajdzievski
2023) is folded into B, and every adapter is zero-padded to the stack's rank R, so adapters of
different ranks (and PEFT's per-module `rank_pattern`) share one stack. The base weight W may be
quantized (`quant.QArray`): the LoRA term is added to what the matmul helper returns.

How a batch mixes adapters, measured on this CPU (XLA:CPU, f32, x [T, 576] through A [8, 576, r]
and B [8, r, 576], token adapters random in [-1, 8), jitted, best of 3 runs):

    T, r, adapters     one-hot (kept)   gathered einsum   ragged_dot
    64, 8, 8               67 us            128 us           311 us
    64, 16, 8             129 us            171 us           307 us
    8, 16, 8               32 us             31 us            74 us
    512, 16, 8            520 us          12490 us          1822 us
    64, 16, 32            348 us            191 us          1414 us

Kept, the one-hot: each token multiplies x by every adapter's A (one [I, A*R] matmul), a one-hot
of its adapter zeroes the other adapters' columns (all of them for -1), and one [A*R, O] matmul
with B follows -- two plain matmuls that read the adapter weights once. The gathered einsum
(each token's A[i] and B[i] gathered, then batched matvecs) was 1.3-1.9x slower at 64 tokens and
24x at 512 (it copies a token's matrices per token); `jax.lax.ragged_dot` over the tokens sorted
by adapter was 2.4-4.6x slower at 64 tokens (XLA:CPU computes it group by group over all rows,
plus the sort and the scatter back). The one-hot's work grows with adapters x rank: at 32 adapters
x r16 it was 1.8x slower than gathering, so a stack far wider than that wants a grouped kernel
(ragged_dot, or Punica's SGMV/BGMV on a GPU) in `LoRABatch.delta`, the one place that computes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxgen.model.config import ModelConfig
from jaxgen.model.errors import LoRAError
from jaxgen.model.safetensors_io import SafetensorsFile

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The linears an adapter may target, each with its parent module in Hugging Face names.
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

# Tensor names as peft's save_pretrained writes them (adapter name dropped), e.g.
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(model\.layers\.(\d+)\.(\w+)\.(\w+))\.lora_([AB])\.weight"
)

# adapter_config.json fields that change what an adapter computes, when set: what to change.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora=True) is not supported; use a plain LoRA adapter",
    "lora_bias": "LoRA biases (lora_bias=True) are not supported; train with lora_bias=False",
    "modules_to_save": "fully trained modules (modules_to_save) are not supported; only LoRA "
    "A/B matrices of the decoder's linears are",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices) are not "
    "supported",
    "fan_in_fan_out": "fan_in_fan_out=True (Conv1D weights) does not apply to Llama-style models",
    "layer_replication": "layer_replication changes the base model's depth; it is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported; target the "
    "linear modules",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora=True) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}


# ----------------------------------------------------------------------------------------------
# One adapter on the host
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One PEFT LoRA adapter on the host, laid out like the base params (``x @ W``, W [in, out]).

    `modules` maps a target's name to (a f32[L, I, r], b f32[L, r, O]) with the scaling folded
    into b; layers the adapter leaves alone, and ranks below the module's r, are zero.
    """

    path: str
    rank: int  # the largest rank of any of its modules
    modules: dict[str, tuple[np.ndarray, np.ndarray]]


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise LoRAError(
            f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory; peft's "
            "save_pretrained writes one)"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{path}: cannot parse: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(
            f"{path}: a {config['peft_type']} adapter; only LoRA adapters are supported"
        )
    if config.get("bias", "none") != "none":
        raise LoRAError(
            f"{path}: bias={config['bias']!r} trains the base model's biases; only bias='none' "
            "is supported (retrain with bias='none')"
        )
    for field, hint in _UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise LoRAError(f"{path}: {hint}")
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field), int | float) or config[field] <= 0:
            raise LoRAError(f"{path}: {field} must be a positive number, got {config.get(field)!r}")
    return config


def _pattern_value(patterns: dict, module_key: str, default):
    """The value of the first pattern matching the end of the module's name, as
    `peft.utils.other.get_pattern_key` picks `rank_pattern` / `alpha_pattern` entries."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return value
    return default


def _scaling(config: dict, module_key: str, rank: int, where: str) -> float:
    expected = _pattern_value(config.get("rank_pattern") or {}, module_key, config["r"])
    if rank != expected:
        raise LoRAError(
            f"{where}: {module_key} has rank {rank} but {ADAPTER_CONFIG} says {expected} "
            "(r / rank_pattern); the adapter files do not belong together"
        )
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_key, config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _parse_name(name: str, cfg: ModelConfig, where: str):
    """(module key, layer, module, "A" or "B") of a PEFT tensor name, or a LoRAError."""
    match = _TENSOR_NAME.fullmatch(name)
    if match is None or TARGET_MODULES.get(match[4]) != match[3]:
        raise LoRAError(
            f"{where}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
            f"{'/'.join(TARGET_MODULES)}; jaxgen runs LoRA on those linears only (retrain "
            "without targeting other modules)"
        )
    layer = int(match[2])
    if layer >= cfg.num_layers:
        raise LoRAError(
            f"{where}: tensor {name!r} adapts layer {layer} but the base model has "
            f"{cfg.num_layers} layers; load the adapter on the model it was trained for"
        )
    return match[1], layer, match[4], match[5]


def load_adapter(directory: str, cfg: ModelConfig) -> LoRAAdapter:
    """Reads a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as
    peft's ``save_pretrained`` writes them) for the base model `cfg`.

    Raises:
      LoRAError: unreadable files, an adapter feature jaxgen does not run (DoRA, biases, embedding
        or LM-head LoRA, ...), or tensors that do not fit the base model.
    """
    config = _read_config(directory)
    where = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(where):
        found = [n for n in os.listdir(directory) if n.startswith("adapter_model")]
        raise LoRAError(
            f"{directory}: no {ADAPTER_WEIGHTS}"
            + (f" (found {found}; re-save with safe_serialization=True)" if found else "")
        )
    tensors = SafetensorsFile(where)
    # Before the names: with embedding LoRA peft also saves the whole embedding matrix, whose
    # name would be reported instead.
    embedding = [name for name in tensors.keys() if "lora_embedding" in name]
    if embedding:
        raise LoRAError(
            f"{where}: {embedding[0]!r}: LoRA on the embeddings is not supported; target only "
            f"{', '.join(TARGET_MODULES)}"
        )
    found: dict[tuple[str, int], dict[str, tuple[str, np.ndarray]]] = {}
    # LoRA tensors first: an unsupported target's lora_A names it better than the whole layer
    # peft saves beside it (e.g. lm_head.base_layer.weight).
    for name in sorted(tensors.keys(), key=lambda name: ".lora_" not in name):
        key, layer, module, side = _parse_name(name, cfg, where)
        found.setdefault((module, layer), {})[side] = (key, tensors.get(name))
    if not found:
        raise LoRAError(f"{where}: holds no LoRA weights")

    modules = {}
    for module in TARGET_MODULES:
        layers = {layer: sides for (m, layer), sides in found.items() if m == module}
        if not layers:
            continue
        d_in, d_out = cfg.linear_shapes[module]
        pairs = {}
        for layer, sides in layers.items():
            if len(sides) != 2:
                key = next(iter(sides.values()))[0]
                raise LoRAError(f"{where}: {key} has lora_{''.join(sides)} but not its pair")
            (key, a), (_, b) = sides["A"], sides["B"]
            r = a.shape[0]
            if a.shape != (r, d_in) or b.shape != (d_out, r):
                raise LoRAError(
                    f"{where}: {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but "
                    f"the base model's {module} needs [r, {d_in}] and [{d_out}, r]: the adapter "
                    "was trained for another base model; load it on that one"
                )
            pairs[layer] = (a, b, _scaling(config, key, r, where))
        rank = max(a.shape[0] for a, _, _ in pairs.values())
        a_lir = np.zeros((cfg.num_layers, d_in, rank), np.float32)
        b_lro = np.zeros((cfg.num_layers, rank, d_out), np.float32)
        for layer, (a, b, scaling) in pairs.items():
            r = a.shape[0]
            a_lir[layer, :, :r] = np.asarray(a, np.float32).T
            b_lro[layer, :r, :] = np.asarray(b, np.float32).T * scaling
        modules[module] = (a_lir, b_lro)
    rank = max(a.shape[-1] for a, _ in modules.values())
    return LoRAAdapter(path=directory, rank=rank, modules=modules)


# ----------------------------------------------------------------------------------------------
# Adapters stacked on the device, and a step's per-token choice among them
# ----------------------------------------------------------------------------------------------
@struct.dataclass
class LoRAPair:
    a: jax.Array  # [L, A, I, R] (one layer's [A, I, R] inside the layer scan)
    b: jax.Array  # [L, A, R, O] with each adapter's scaling folded in


@struct.dataclass
class LoRAWeights:
    """A adapters stacked per target linear, zero-padded to rank R; None: the linear is not
    adapted (no work is spent on it)."""

    q_proj: LoRAPair | None = None
    k_proj: LoRAPair | None = None
    v_proj: LoRAPair | None = None
    o_proj: LoRAPair | None = None
    gate_proj: LoRAPair | None = None
    up_proj: LoRAPair | None = None
    down_proj: LoRAPair | None = None

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(m for m in TARGET_MODULES if getattr(self, m) is not None)

    @property
    def num_adapters(self) -> int:  # A, the slots of the stack
        return getattr(self, self.targets[0]).a.shape[-3]

    @property
    def max_rank(self) -> int:  # R
        return getattr(self, self.targets[0]).a.shape[-1]


def check_fits(adapter: LoRAAdapter, max_rank: int, targets: Sequence[str]) -> None:
    """LoRAError unless `adapter` fits a stack of rank `max_rank` adapting `targets`."""
    if adapter.rank > max_rank:
        raise LoRAError(f"{adapter.path}: rank {adapter.rank} exceeds {max_rank=}; raise it")
    extra = sorted(set(adapter.modules) - set(targets))
    if extra:
        raise LoRAError(
            f"{adapter.path}: adapts {extra}, not in the stack's targets={list(targets)}"
        )


def stack_adapters(
    cfg: ModelConfig,
    adapters: Sequence[LoRAAdapter],
    *,
    num_slots: int | None = None,
    max_rank: int | None = None,
    targets: Sequence[str] | None = None,
    dtype=jnp.float32,
) -> LoRAWeights:
    """Stacks adapters into slots 0, 1, ... of a `LoRAWeights`; unused slots are zero.

    Fix `num_slots`, `max_rank` and `targets` to keep the stack's shapes -- and so a step's
    compiled program -- the same while adapters come and go.

    Args:
      num_slots: A, adapters the stack holds (default: len(adapters)).
      max_rank: R, the rank every adapter is zero-padded to (default: the largest rank).
      targets: names of the linears the stack adapts (default: all that some adapter targets).
    """
    num_slots = len(adapters) if num_slots is None else num_slots
    rank = max((a.rank for a in adapters), default=0) if max_rank is None else max_rank
    if targets is None:
        targets = [m for m in TARGET_MODULES if any(m in a.modules for a in adapters)]
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown or not targets:
        raise LoRAError(
            f"targets must be a non-empty subset of {list(TARGET_MODULES)}, got {targets}"
        )
    if num_slots < max(len(adapters), 1):
        raise LoRAError(f"{num_slots=} cannot hold {len(adapters)} adapters; raise num_slots")
    if rank < 1:
        raise LoRAError(f"max_rank must be >= 1 (an empty stack needs it given), got {max_rank}")
    for adapter in adapters:
        check_fits(adapter, rank, targets)

    fields = {}
    for module in targets:
        d_in, d_out = cfg.linear_shapes[module]
        a = np.zeros((cfg.num_layers, num_slots, d_in, rank), np.float32)
        b = np.zeros((cfg.num_layers, num_slots, rank, d_out), np.float32)
        for slot, adapter in enumerate(adapters):
            if module not in adapter.modules:
                continue
            a_lir, b_lro = adapter.modules[module]
            if a_lir.shape[:2] != (cfg.num_layers, d_in) or b_lro.shape[2] != d_out:
                raise LoRAError(
                    f"{adapter.path}: was loaded for another base model than {cfg.name!r}"
                )
            r = a_lir.shape[-1]
            a[:, slot, :, :r] = a_lir
            b[:, slot, :r, :] = b_lro
        fields[module] = LoRAPair(a=jnp.asarray(a, dtype), b=jnp.asarray(b, dtype))
    return LoRAWeights(**fields)


@struct.dataclass
class LoRABatch:
    """What a step passes as the model's ``lora=``: the stack and each token's adapter."""

    weights: LoRAWeights  # leaves [L, A, ...]; one layer's [A, ...] inside the layer scan
    adapter_ids: jax.Array  # i32[B, T] each token's slot in the stack; -1 = the base model only

    def check(self, tokens_shape) -> None:
        """Host-side validation (before any device work): ValueError on a bad id or shape."""
        ids = np.asarray(self.adapter_ids)
        if ids.shape != tuple(tokens_shape) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"adapter_ids must be integers shaped like the tokens {tuple(tokens_shape)}, "
                f"got {ids.dtype}{list(ids.shape)}"
            )
        bad = ids[(ids < -1) | (ids >= self.weights.num_adapters)]
        if bad.size:
            raise ValueError(
                f"adapter_ids must lie in [-1, {self.weights.num_adapters}) (-1: no adapter), "
                f"got {bad[0]}"
            )

    def delta(self, name: str, x: jax.Array) -> jax.Array | None:
        """The LoRA term of linear `name` for x [B, T, I]: [B, T, O] in x's dtype, or None when
        the stack does not adapt that linear. One layer's weights (inside the scan)."""
        pair = getattr(self.weights, name, None)
        if pair is None:
            return None
        # one_hot(-1) is all zeros: base-model tokens get an exact 0 (see the module docstring).
        onehot_bta = jax.nn.one_hot(self.adapter_ids, pair.a.shape[0], dtype=x.dtype)
        xa_btar = jnp.einsum("BTI,AIR->BTAR", x, pair.a.astype(x.dtype)) * onehot_bta[..., None]
        return jnp.einsum("BTAR,ARO->BTO", xa_btar, pair.b.astype(x.dtype))
