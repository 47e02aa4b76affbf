"""Model configuration: one frozen dataclass for every supported decoder family.

Built from a Hugging Face ``config.json`` dict (`ModelConfig.from_hf`) or from GGUF metadata
(`ModelConfig.from_gguf_fields`). Families differ only in flags (biases, qk-norm, sliding window,
rope scaling), for Mixture-of-Experts families a `MoEConfig`, and for Multi-head Latent Attention
(DeepSeek-V2/V3) an `MLAConfig`; the model code in `model/llama.py`, `model/moe.py` and
`model/mla.py` reads those flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SCORING_FUNCS = ("softmax", "sigmoid")


_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def _yarn_only_mla(arch) -> str:
    return (
        f"rope scaling type 'yarn' is not supported for {arch!r}: only for Multi-head Latent "
        f"Attention models ({', '.join(MLA_ARCHITECTURES)})"
    )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF ``rope_scaling`` / ``rope_parameters``)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 and yarn
    # yarn (Peng et al. 2023, as DeepSeek-V2/V3 use it; MLA models only): the ramp between
    # extrapolated and interpolated frequencies, and the attention magnitude factors.
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and None in (
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        ):
            raise ValueError(
                "llama3 rope scaling needs low_freq_factor, high_freq_factor and "
                "original_max_position_embeddings"
            )
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("yarn rope scaling needs original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A Mixture-of-Experts feed-forward block (Mixtral, Qwen3-MoE, DeepSeek-V3 routing).

    Routing: ``softmax`` scores then top-k (Mixtral; Qwen3-MoE renormalises the k weights when
    `norm_topk_prob`), or ``sigmoid`` scores with DeepSeek-V3's rules: a learned
    `e_score_correction_bias` used only to select experts, group-limited selection (the best
    `topk_group` of `n_group` groups, a group scored by the sum of its top-2 scores), weights
    renormalised when `norm_topk_prob` and multiplied by `routed_scaling_factor`.
    """

    num_experts: int  # E
    num_experts_per_tok: int  # k
    intermediate_size: int  # F of one routed expert
    shared_intermediate_size: int | None = None  # F of the always-on shared expert(s)
    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    score_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    first_dense_layers: int = 0  # the first layers keep a dense MLP (first_k_dense_replace)

    def __post_init__(self):
        for field in ("num_experts", "num_experts_per_tok", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{field} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts})"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported; "
                f"supported: {', '.join(SCORING_FUNCS)}"
            )
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError("n_group and topk_group must be set together (or both None)")
        if self.n_group is not None:
            if self.num_experts % self.n_group:
                raise ValueError(
                    f"num_experts ({self.num_experts}) must be a multiple of n_group "
                    f"({self.n_group})"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in [1, n_group], got {self.topk_group}")
            if self.num_experts // self.n_group < 2:
                raise ValueError("group-limited routing needs >= 2 experts per group (top-2 sum)")
            if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(
                    "num_experts_per_tok exceeds the experts in the topk_group selected groups"
                )
        if self.shared_intermediate_size is not None and self.shared_intermediate_size < 1:
            raise ValueError(
                f"shared_intermediate_size must be >= 1 or None, got "
                f"{self.shared_intermediate_size}"
            )
        if self.first_dense_layers < 0:
            raise ValueError(f"first_dense_layers must be >= 0, got {self.first_dense_layers}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoEConfig:
        """The MoE block of a ``config.json``: mixtral, qwen3_moe, deepseek_v2 or deepseek_v3."""
        model_type = hf.get("model_type")
        if model_type == "mixtral":
            return cls(
                num_experts=hf.get("num_local_experts", hf.get("num_experts")),
                num_experts_per_tok=hf["num_experts_per_tok"],
                intermediate_size=hf["intermediate_size"],
            )
        if model_type == "qwen3_moe":
            num_layers = hf["num_hidden_layers"]
            step = hf.get("decoder_sparse_step", 1) or 1
            dense_only = set(hf.get("mlp_only_layers") or ())
            # transformers' rule: layer i is sparse unless listed in mlp_only_layers, when
            # (i + 1) is a multiple of decoder_sparse_step.
            sparse = [i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
            first = sparse.index(True) if any(sparse) else num_layers
            if not all(sparse[first:]):
                raise ValueError(
                    f"qwen3_moe with decoder_sparse_step={step} and mlp_only_layers="
                    f"{sorted(dense_only)}: dense layers must all come before the sparse ones "
                    "(decoder_sparse_step=1 and mlp_only_layers a prefix 0..k-1)"
                )
            if first == num_layers:
                raise ValueError("qwen3_moe config has no sparse layer; load it as qwen3")
            return cls(
                num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                num_experts_per_tok=hf["num_experts_per_tok"],
                intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                first_dense_layers=first,
            )
        if model_type in ("deepseek_v2", "deepseek_v3"):
            v3 = model_type == "deepseek_v3"
            method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
            if v3 and method != "noaux_tc":
                raise ValueError(f"deepseek_v3 topk_method {method!r} is not supported")
            if not v3 and method != "greedy":
                raise ValueError(
                    f"deepseek_v2 topk_method {method!r} is not supported (only 'greedy': "
                    "group_limited_greedy scores a group by its best expert, which MoEConfig's "
                    "group routing does not express)"
                )
            n_group = hf.get("n_group") or 1
            # V3: sigmoid scores, bias-corrected group-limited selection. V2 (greedy): softmax
            # top-k, never renormalised (transformers' V2 router ignores norm_topk_prob).
            routing = (
                dict(
                    scoring_func="sigmoid",
                    norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    score_correction_bias=True,
                    n_group=n_group,
                    topk_group=hf.get("topk_group") or n_group,
                )
                if v3
                else dict(norm_topk_prob=False)
            )
            shared = hf.get("n_shared_experts") or 0
            return cls(
                num_experts=hf.get("n_routed_experts")
                or hf.get("num_local_experts")
                or hf.get("num_experts"),
                num_experts_per_tok=hf["num_experts_per_tok"],
                intermediate_size=hf["moe_intermediate_size"],
                shared_intermediate_size=shared * hf["moe_intermediate_size"] or None,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                first_dense_layers=hf.get("first_k_dense_replace", 0),
                **routing,
            )
        raise ValueError(f"model_type {model_type!r} has no Mixture-of-Experts block")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2 §2.1, DeepSeek-V3): queries through an optional
    low-rank bottleneck, keys and values from one shared latent of `kv_lora_rank` per token plus
    a rope key of `qk_rope_head_dim` shared by all heads (what the cache stores)."""

    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # per-head key/query width without rope
    qk_rope_head_dim: int  # the decoupled rope part (query per head, key shared)
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q_proj
    rope_interleave: bool = True  # rope pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)

    def __post_init__(self):
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLAConfig.{field} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's cache entry in one layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MLAConfig:
        return cls(
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf.get("v_head_dim") or hf["qk_nope_head_dim"],
            q_lora_rank=hf.get("q_lora_rank"),
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-style decoder (Llama 1/2/3, Mistral, Qwen2, Qwen3, SmolLM2;
    Mixtral, Qwen3-MoE and DeepSeek-V2/V3 with `moe` set, DeepSeek's attention with `mla`)."""

    arch: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    moe: MoEConfig | None = None  # None: every layer has a dense MLP
    mla: MLAConfig | None = None  # None: grouped-query attention (q/k/v_proj)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 and self.mla is None:  # MLA rotates only its rope part
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if (self.moe is not None) != (self.arch in MOE_ARCHITECTURES):
            raise ValueError(
                f"architecture {self.arch!r} "
                + ("needs a MoEConfig (moe=...)" if self.moe is None else "has no MoE block")
            )
        rope_type = self.rope_scaling.rope_type
        if self.mla is None and rope_type == "yarn":
            raise ValueError(_yarn_only_mla(self.arch))
        if self.mla is not None and rope_type not in ("default", "yarn"):
            raise ValueError(
                f"{self.arch} with rope_type {rope_type!r}: Multi-head Latent Attention supports "
                "'default' and 'yarn' rope only"
            )
        if (self.mla is not None) != (self.arch in MLA_ARCHITECTURES):
            raise ValueError(
                f"architecture {self.arch!r} "
                + ("needs an MLAConfig (mla=...)" if self.mla is None else "has no MLA attention")
            )
        if self.mla is not None and (
            self.head_dim != self.mla.qk_head_dim or self.num_kv_heads != self.num_heads
        ):
            raise ValueError(
                f"an MLA model has head_dim = qk_nope_head_dim + qk_rope_head_dim "
                f"({self.mla.qk_head_dim}) and num_kv_heads = num_heads ({self.num_heads}), got "
                f"head_dim={self.head_dim} num_kv_heads={self.num_kv_heads}"
            )
        if self.moe is not None and self.moe.first_dense_layers >= self.num_layers:
            raise ValueError(
                f"first_dense_layers ({self.moe.first_dense_layers}) must be < num_layers "
                f"({self.num_layers})"
            )

    @property
    def num_groups(self) -> int:  # G = N / K
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.mla is not None:
            shapes = self.linear_shapes
            names = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
            attn = sum(i * o for i, o in (shapes[n] for n in names if n in shapes))
            attn += (self.mla.q_lora_rank or 0) + self.mla.kv_lora_rank  # the latent norms
        per_layer = attn + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        total = self.num_layers * per_layer + emb + d
        moe = self.moe
        if moe is None:
            return total + self.num_layers * 3 * d * f
        sparse = self.num_layers - moe.first_dense_layers
        expert = 3 * d * moe.intermediate_size
        shared = 3 * d * (moe.shared_intermediate_size or 0)
        router = d * moe.num_experts + moe.num_experts * moe.score_correction_bias
        dense = moe.first_dense_layers * 3 * d * f
        return total + dense + sparse * (moe.num_experts * expert + shared + router)

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) widths of each decoder layer's linears, by Hugging Face module name."""
        d, f = self.hidden_size, self.intermediate_size
        if self.mla is not None:
            return self._mla_linear_shapes()
        nh, kh = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (d, nh),
            "k_proj": (d, kh),
            "v_proj": (d, kh),
            "o_proj": (nh, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }

    def _mla_linear_shapes(self) -> dict[str, tuple[int, int]]:
        d, f, n, mla = self.hidden_size, self.intermediate_size, self.num_heads, self.mla
        q = (
            {"q_proj": (d, n * mla.qk_head_dim)}
            if mla.q_lora_rank is None
            else {
                "q_a_proj": (d, mla.q_lora_rank),
                "q_b_proj": (mla.q_lora_rank, n * mla.qk_head_dim),
            }
        )
        return {
            **q,
            "kv_a_proj_with_mqa": (d, mla.latent_dim),
            "kv_b_proj": (mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim)),
            "o_proj": (n * mla.v_head_dim, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }

    # ----------------------------------------------------------------------------------------
    # Hugging Face config.json
    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads

        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope.update({k: v for k, v in legacy.items() if k not in rope})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "yarn" and model_type not in MLA_ARCHITECTURES:
            raise ValueError(_yarn_only_mla(model_type))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=rope.get("low_freq_factor"),
            high_freq_factor=rope.get("high_freq_factor"),
            original_max_position_embeddings=rope.get("original_max_position_embeddings"),
            **{key: rope[key] for key in _YARN_KEYS if rope.get(key) is not None},
        )

        mla = None
        if model_type in MLA_ARCHITECTURES:
            mla = MLAConfig.from_hf(hf)
            head_dim = mla.qk_head_dim  # transformers' head_dim is the rope part only

        sliding_window = None
        if model_type in ("mistral", "mixtral"):
            sliding_window = hf.get("sliding_window")
        elif hf.get("use_sliding_window"):
            raise ValueError(
                f"{model_type} with use_sliding_window=True (per-layer sliding windows) "
                "is not supported"
            )
        layer_types = hf.get("layer_types")
        if (
            layer_types
            and model_type not in ("mistral", "mixtral")
            and set(layer_types) != {"full_attention"}
        ):
            raise ValueError(f"layer_types {sorted(set(layer_types))} are not supported")

        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        o_bias = attention_bias and model_type != "qwen2"
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            # MLA's keys are per head (expanded from the shared latent).
            num_kv_heads=num_heads if mla else hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=hf.get("_name_or_path", "") or "",
            moe=MoEConfig.from_hf(hf) if model_type in MOE_ARCHITECTURES else None,
            mla=mla,
        )

    # ----------------------------------------------------------------------------------------
    # GGUF metadata
    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Builds a config from decoded GGUF key/value metadata.

        Args:
          fields: GGUF metadata as plain Python values (``general.architecture`` etc.).
          tensor_names: names of the tensors in the file (tied embeddings and biases are
            detected from which tensors exist).
        """
        arch = fields.get("general.architecture")
        dense = [a for a in SUPPORTED_ARCHITECTURES if a not in MOE_ARCHITECTURES]
        if arch not in (*dense, *GGUF_MOE_ARCHITECTURES):
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported; supported: "
                f"{', '.join((*dense, *GGUF_MOE_ARCHITECTURES))} (Mixtral files say 'llama'; "
                "other Mixture-of-Experts models load from Hugging Face safetensors)"
            )
        if "rope_freqs.weight" in tensor_names:
            raise ValueError(
                "GGUF files with a rope_freqs tensor (Llama 3.1-style frequency factors) are not "
                "supported; load the Hugging Face safetensors directory instead"
            )

        def get(key, default=None):
            return fields.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv_heads = get("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, (list, np.ndarray)):
            raise ValueError("GGUF files with per-layer head counts are not supported")
        head_dim = int(get("attention.key_length", hidden // num_heads))
        vocab = get("vocab_size")
        if vocab is None:
            raise ValueError("GGUF metadata has neither a vocab_size nor a token list")
        mla = _gguf_mla(arch, get)
        if mla is not None:  # the file's MQA view of MLA: one latent "head"; ours is per head
            head_dim, num_kv_heads = mla.qk_head_dim, num_heads
        scaling_type = get("rope.scaling.type", "none")
        scaling = RopeScaling()
        if scaling_type == "linear":
            scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
        elif scaling_type == "yarn" and mla is not None:
            # llama.cpp keeps DeepSeek's mscale_all_dim as yarn_log_multiplier = 0.1 x it, and
            # no separate mscale (it takes the two as equal, as DeepSeek's checkpoints have them).
            mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1 or None
            scaling = RopeScaling(
                rope_type="yarn",
                factor=float(get("rope.scaling.factor")),
                original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                mscale=mscale,
                mscale_all_dim=mscale,
            )
        elif scaling_type not in ("none", None):
            raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        moe = _gguf_moe(arch, get, tensor_names)
        if arch == "deepseek2":
            ours = "deepseek_v3" if moe.scoring_func == "sigmoid" else "deepseek_v2"
        else:
            ours = GGUF_MOE_ARCHITECTURES.get(arch, "mixtral") if moe else arch
        mla_bias = "blk.0.attn_kv_a_mqa.bias" in tensor_names
        return cls(
            arch=ours,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names or mla_bias,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sliding_window=get("attention.sliding_window") if arch == "mistral" else None,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            name=str(fields.get("general.name", "")),
            moe=moe,
            mla=mla,
        )

    # ----------------------------------------------------------------------------------------
    # jaxgen's own JSON (orbax checkpoints)
    # ----------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("moe") is not None:
            d["moe"] = MoEConfig(**d["moe"])
        if d.get("mla") is not None:
            d["mla"] = MLAConfig(**d["mla"])
        return cls(**d)


# GGUF architectures of Mixture-of-Experts models -> ours. A Mixtral file says "llama" (with an
# expert count); llama.cpp stacks each layer's experts into one tensor (ffn_*_exps).
GGUF_MOE_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3"}
# llama.cpp's expert_gating_func values.
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _gguf_mla(arch: str, get) -> MLAConfig | None:
    """DeepSeek's MLA from a "deepseek2" file. llama.cpp writes the attention as MQA over the
    latent (key_length = kv_lora_rank + rope, value_length = kv_lora_rank) and the per-head
    widths as key_length_mla / value_length_mla; files from before that have the per-head
    widths in key_length / value_length."""
    if arch != "deepseek2":
        return None
    rank, rope = int(get("attention.kv_lora_rank")), int(get("rope.dimension_count"))
    key, value = get("attention.key_length_mla"), get("attention.value_length_mla")
    if key is None:
        key, value = get("attention.key_length"), get("attention.value_length")
    q_rank = get("attention.q_lora_rank")
    return MLAConfig(
        kv_lora_rank=rank,
        qk_nope_head_dim=int(key) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(value),
        q_lora_rank=int(q_rank) if q_rank else None,
    )


def _gguf_moe(arch: str, get, tensor_names: set[str]) -> MoEConfig | None:
    """The MoE block of a GGUF file (None for a dense model): llama.cpp's keys
    ``{arch}.expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``; dense
    leading layers are those without a router tensor (``blk.N.ffn_gate_inp``)."""
    experts = get("expert_count")
    if not experts:
        if arch in GGUF_MOE_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} without {arch}.expert_count")
        return None
    if arch not in ("llama", *GGUF_MOE_ARCHITECTURES):
        raise ValueError(
            f"GGUF Mixture-of-Experts files of architecture {arch!r} are not supported; "
            "supported: llama (Mixtral), qwen3moe, deepseek2 (DeepSeek-V2/V3)"
        )
    layers = int(get("block_count"))
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers)]
    first = sparse.index(True) if any(sparse) else layers
    if first == layers or not all(sparse[first:]):
        raise ValueError(
            "GGUF MoE file: every layer after the first sparse one must have a router "
            "(blk.N.ffn_gate_inp.weight); found sparse layers "
            f"{[i for i, s in enumerate(sparse) if s]} of {layers}"
        )
    if f"blk.{first}.ffn_gate_exps.weight" not in tensor_names:
        raise ValueError(
            "GGUF MoE file with one tensor per expert (blk.N.ffn_gate.E.weight, llama.cpp's "
            "layout before stacked ffn_*_exps tensors): re-convert it with a current "
            "convert_hf_to_gguf.py, or load the Hugging Face safetensors"
        )
    width = int(get("expert_feed_forward_length") or get("feed_forward_length"))
    if arch != "deepseek2":
        return MoEConfig(
            num_experts=int(experts),
            num_experts_per_tok=int(get("expert_used_count")),
            intermediate_size=width,
            # llama.cpp renormalises Mixtral's and Qwen3-MoE's top-k weights unless told not to.
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            first_dense_layers=first,
        )
    if first != int(get("leading_dense_block_count", 0)):
        raise ValueError(
            f"GGUF deepseek2 file: leading_dense_block_count is "
            f"{get('leading_dense_block_count', 0)} but the first router is in layer {first}"
        )
    gating = _GGUF_GATING.get(int(get("expert_gating_func", 1)))
    if gating is None:
        raise ValueError(f"GGUF expert_gating_func {get('expert_gating_func')!r} is not supported")
    # DeepSeek-V3's group-limited selection where the file has it (llama.cpp reads files
    # without expert_group_count as one group: no limit).
    groups, used = get("expert_group_count"), get("expert_group_used_count")
    if gating == "softmax" and groups and int(groups) > 1:
        raise ValueError(
            "GGUF deepseek2 file with softmax gating and expert groups (DeepSeek-V2's "
            "group_limited_greedy scores a group by its best expert, which MoEConfig's group "
            "routing does not express)"
        )
    shared = int(get("expert_shared_count", 0))
    return MoEConfig(
        num_experts=int(experts),
        num_experts_per_tok=int(get("expert_used_count")),
        intermediate_size=width,
        shared_intermediate_size=shared * width or None,
        scoring_func=gating,
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        score_correction_bias=f"blk.{first}.exp_probs_b.bias" in tensor_names,
        n_group=int(groups) if groups and used else None,
        topk_group=int(used) if groups and used else None,
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        first_dense_layers=first,
    )


def rope_inv_freq(cfg: ModelConfig, dim: int | None = None) -> np.ndarray:
    """Inverse rotary frequencies f32[dim/2] (default dim: head_dim), with the config's scaling
    applied (MLA rotates only its qk_rope_head_dim part).

    ``llama3`` follows Meta's Llama 3.1 reference: wavelengths longer than
    ``original_max / low_freq_factor`` are divided by ``factor``, shorter than
    ``original_max / high_freq_factor`` are kept, and the band between is interpolated.
    """
    h = cfg.head_dim if dim is None else dim
    # f32 throughout, as transformers computes it, so logits agree to ~1e-5.
    exponent = np.arange(0, h, 2, dtype=np.float32) / np.float32(h)
    inv_freq = np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exponent)
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        smooth = (old_len / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        interpolated = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen > low_wavelen,
            inv_freq / rs.factor,
            np.where(wavelen < high_wavelen, inv_freq, interpolated),
        )
    elif rs.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, h, cfg.rope_theta, rs)
    return inv_freq.astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude for a context `factor` (DeepSeek-V2's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor yarn applies to rope's cos and sin (1 for every other rope type)."""
    rs = cfg.rope_scaling
    if rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def _yarn_inv_freq(inv_freq, dim: int, base: float, rs: RopeScaling) -> np.ndarray:
    """YaRN: interpolated (divided by factor) frequencies for the slow dimensions, the original
    ones for the fast, a linear ramp between the dims that turn beta_fast and beta_slow times
    over the original context (transformers' _compute_yarn_parameters)."""
    old_len = rs.original_max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast or 32), correction_dim(rs.beta_slow or 1)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = np.power(np.float32(base), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    interpolated = np.float32(1.0) / (np.float32(rs.factor) * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation
