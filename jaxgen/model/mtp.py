"""DeepSeek-V3's multi-token-prediction (MTP) module (DeepSeek-V3 report §2.2), used as a
speculative drafter.

The module at position i combines the main model's last hidden state h_i (after the final norm:
the tensor DeepSeek's modeling code and vLLM's DeepseekV2Model hand the module as
previous_hidden_states) with the embedding of the next token t_{i+1}, and predicts t_{i+2}:

    x_i = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])       ([D] from [2D])
    g_i = decoder block (MLA + MoE, causal over the module's own entries at positions <= i)
    logits_i = lm_head(norm(g_i))                              (shared_head.norm; the head and
                                                                the embedding are the main
                                                                model's)

Drafting k tokens with one module reuses it recursively (as vLLM and SGLang do): the second
draft combines norm(g_i) -- normalised like the main model's h, so hnorm sees what it was fit
on (vLLM #45895, SGLang's deepseek_nextn) -- with the first draft's embedding at position i + 1,
and so on.

Params (`params["mtp"]`, loaded from `model.layers.{num_layers}.*`): enorm, hnorm, eh_proj
(kernel [2D, D]), layer (one decoder layer stacked on a leading axis of 1), norm. The module's
cache entries live in layer `cfg.num_layers` of a pool built for num_layers + 1 layers.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxgen.model.config import ModelConfig
from jaxgen.model.layers import Linear, RMSNorm
from jaxgen.model.llama import layer_segments, scanned_layers
from jaxgen.quant.matmul import matmul


def trunk(cfg: ModelConfig, params, tokens, positions, kv, md, attn_impl=None):
    """The main model's layers and final norm: (hidden [B, T, D], kv) -- what the target's
    `Transformer(..., return_hidden=True)` hands over."""
    x = jnp.take(params["embed"], tokens, axis=0)
    carry = (x, kv, jnp.int32(0))
    for key, count, sparse in layer_segments(cfg):
        carry, _ = scanned_layers(count)(cfg, attn_impl, sparse).apply(
            {"params": params[key]}, carry, positions, md
        )
    x = RMSNorm(cfg.rms_norm_eps).apply({"params": params["final_norm"]}, carry[0])
    return x, carry[1]


def mtp_block(cfg: ModelConfig, params, hidden, next_tokens, positions, kv, md, attn_impl=None):
    """The MTP module over hidden states [B, T, D] and the tokens after them [B, T]:
    (g [B, T, D] before the module's norm, kv with its entries written in layer num_layers)."""
    mtp = params["mtp"]
    eps = cfg.rms_norm_eps
    emb = jnp.take(params["embed"], next_tokens, axis=0)
    emb = RMSNorm(eps).apply({"params": mtp["enorm"]}, emb)
    h = RMSNorm(eps).apply({"params": mtp["hnorm"]}, hidden.astype(emb.dtype))
    x = Linear(cfg.hidden_size).apply({"params": mtp["eh_proj"]}, jnp.concatenate([emb, h], -1))
    sparse = cfg.moe is not None
    (g, kv, _), _ = scanned_layers(1)(cfg, attn_impl, sparse).apply(
        {"params": mtp["layer"]}, (x, kv, jnp.int32(cfg.num_layers)), positions, md
    )
    return g, kv


def mtp_norm(cfg: ModelConfig, params, g):
    """The module's output norm (shared_head.norm) over g [..., D]."""
    return RMSNorm(cfg.rms_norm_eps).apply({"params": params["mtp"]["norm"]}, g)


def shared_head(cfg: ModelConfig, params, x):
    """f32 logits of normalised module outputs x [..., D] (the main model's head)."""
    if cfg.tie_word_embeddings:
        return matmul(x, params["embed"].T).astype(jnp.float32)
    return Linear(cfg.vocab_size).apply({"params": params["lm_head"]}, x).astype(jnp.float32)


def mtp_logits(cfg: ModelConfig, params, g, logits_index=None):
    """f32 logits of the module's outputs g [B, T, D] (at `logits_index` [B, R] only)."""
    if logits_index is not None:
        g = jnp.take_along_axis(g, logits_index[:, :, None], axis=1)
    return shared_head(cfg, params, mtp_norm(cfg, params, g))


def check_mtp(cfg: ModelConfig, params) -> None:
    if "mtp" not in params:
        raise ValueError(
            f"speculative method 'mtp' needs the checkpoint's multi-token-prediction module "
            f"(model.layers.{cfg.num_layers}.* with num_nextn_predict_layers >= 1); this "
            f"{cfg.arch} model has none"
        )
