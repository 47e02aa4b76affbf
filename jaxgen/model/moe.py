"""Mixture-of-Experts feed-forward block (Mixtral, Qwen3-MoE, DeepSeek-V3's routing).

Each token picks k of E experts (`route`); the chosen (token, expert) pairs are sorted by
expert so that every expert's tokens are contiguous, and the three expert projections run as
grouped GEMMs (`jax.lax.ragged_dot`) over those groups: the work is T*k rows whatever the
routing, with no per-expert loop and no all-experts compute. Nothing is dropped: there is no
capacity limit (inference needs every token's chosen experts).

Extra axis letters: E experts, k experts per token (`K` is taken by KV heads), M = T*k routed rows.
Expert weights are stacked [E, in, out] (the `experts` logical axis first).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgen.model.config import ModelConfig, MoEConfig
from jaxgen.model.layers import MLP, _init, constrain


def route(logits_te: jax.Array, moe: MoEConfig, bias_e: jax.Array | None = None):
    """Picks each token's experts and their weights.

    Args:
      logits_te: f32[T, E] router logits.
      moe: the block's config (scoring function, group limits, renormalisation, scaling).
      bias_e: f32[E] DeepSeek-V3's e_score_correction_bias (selection only), or None.
    Returns:
      (weights f32[T, k], experts i32[T, k]).
    """
    k = moe.num_experts_per_tok
    if moe.scoring_func == "softmax":
        scores = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    else:
        scores = jax.nn.sigmoid(logits_te.astype(jnp.float32))
    choice = scores if bias_e is None else scores + bias_e.astype(jnp.float32)
    if moe.n_group is not None and moe.n_group > 1:
        # DeepSeek-V3: keep the topk_group groups whose two best (biased) scores sum highest.
        t, e = choice.shape
        grouped = choice.reshape(t, moe.n_group, e // moe.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, n_group]
        _, keep = jax.lax.top_k(group_scores, moe.topk_group)
        group_mask = jnp.zeros_like(group_scores, bool).at[jnp.arange(t)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, e // moe.n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        # DeepSeek adds 1e-20 so all-zero sigmoid weights cannot divide by zero; softmax
        # weights are positive, and there transformers adds nothing.
        eps = 1e-20 if moe.scoring_func == "sigmoid" else 0.0
        weights = weights / (weights.sum(-1, keepdims=True) + eps)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


def grouped_experts(x_td, weights_tk, experts_tk, gate_edf, up_edf, down_efd):
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) with tokens grouped by expert.

    Args:
      x_td: [T, D]; weights_tk: f32[T, k]; experts_tk: i32[T, k].
      gate_edf, up_edf: [E, D, F]; down_efd: [E, F, D].
    Returns:
      [T, D] in x's dtype.
    """
    t, k = experts_tk.shape
    num_experts = gate_edf.shape[0]
    flat_m = experts_tk.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True)  # routed rows sorted by expert
    group_sizes = jnp.bincount(flat_m, length=num_experts).astype(jnp.int32)
    x_md = jnp.take(x_td, order_m // k, axis=0)
    dtype = x_td.dtype

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs.astype(dtype), group_sizes)

    act_mf = nn.silu(grouped(x_md, gate_edf)) * grouped(x_md, up_edf)
    out_md = grouped(act_mf, down_efd)
    # Unsort, then reduce over k in a fixed order (a scatter-add would sum in any order).
    unsorted = jnp.zeros_like(out_md).at[order_m].set(out_md).reshape(t, k, -1)
    combined = jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights_tk)
    return combined.astype(dtype)


class Experts(nn.Module):
    """E stacked SwiGLU experts: gate_proj and up_proj [E, D, F], down_proj [E, F, D]."""

    moe: MoEConfig

    @nn.compact
    def __call__(self, x_td, weights_tk, experts_tk):
        e, f, d = self.moe.num_experts, self.moe.intermediate_size, x_td.shape[-1]
        gate = self.param("gate_proj", _init, (e, d, f))
        up = self.param("up_proj", _init, (e, d, f))
        down = self.param("down_proj", _init, (e, f, d))
        return grouped_experts(x_td, weights_tk, experts_tk, gate, up, down)


class MoE(nn.Module):
    """Router, routed experts and (DeepSeek) shared experts; x [B, T, D] -> [B, T, D]."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_btd):
        moe = self.cfg.moe
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        router = self.param("router", _init, (d, moe.num_experts))
        # Router logits in f32 whatever the weights' dtype (DeepSeek-V3 keeps its gate in f32).
        logits_te = x_td.astype(jnp.float32) @ router.astype(jnp.float32)
        bias = (
            self.param("e_score_correction_bias", nn.initializers.zeros, (moe.num_experts,))
            if moe.score_correction_bias
            else None
        )
        weights_tk, experts_tk = route(logits_te, moe, bias)
        out = Experts(moe, name="experts")(x_td, weights_tk, experts_tk).reshape(b, t, d)
        if moe.shared_intermediate_size is not None:
            shared = MLP(
                self.cfg, moe.shared_intermediate_size, "shared_mlp", name="shared_experts"
            )
            out = out + shared(x_btd)
        return constrain(out, "batch", "seq", "embed")
