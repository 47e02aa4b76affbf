"""Mixture-of-Experts feed-forward block (Mixtral, Qwen3-MoE, DeepSeek-V3's routing).

Each token picks k of E experts (`route`); the chosen (token, expert) pairs are sorted by
expert so that every expert's tokens are contiguous, and the three expert projections run as
grouped GEMMs (`grouped_matmul`: `jax.lax.ragged_dot`, or on the CPU a device-side loop over
row tiles of the experts in use) over those groups: the work is T*k rows whatever the routing,
with no per-expert Python loop and no all-experts compute. Nothing is dropped: there is no
capacity limit (inference needs every token's chosen experts).

Expert parallelism: on a mesh whose "expert" axis has ep > 1 devices, each holds E / ep experts;
tokens go to their experts' devices and back with all-to-all inside a `shard_map` over that axis
(`expert_parallel_experts`), with buffers sized so that nothing is dropped.

Extra axis letters: E experts, k experts per token (`K` is taken by KV heads), M = T*k routed rows.
Expert weights are stacked [E, in, out] (the `experts` logical axis first).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgen.model.config import ModelConfig, MoEConfig
from jaxgen.model.layers import MLP, _init, constrain

EXPERT_AXIS = "expert"  # the mesh axis experts are split over (`sharding.mesh`)


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


def _tile_rows(m: int, e: int) -> int:
    """Rows per tile of the CPU grouped matmul: about the rows of an expert if M rows were
    spread evenly (a power of two, 1 to 128), so decode-sized batches read only the experts
    they use and a prefill wastes at most a tile per expert."""
    return min(128, 1 << max(0, -(-m // e) - 1).bit_length())


def _tiled_grouped_matmul(lhs_mi, rhs_eio, group_sizes):
    """`ragged_dot` as a device-side loop over the non-empty (expert, row tile) pairs: each
    step multiplies one tile of an expert's rows by that expert's matrix, so only the experts
    some row chose are read, and the work is about M rows (plus at most a tile per expert)."""
    m, _ = lhs_mi.shape
    e, _, o = rhs_eio.shape
    tile = _tile_rows(m, e)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles_e = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_e)
    lhs = jnp.pad(lhs_mi, ((0, tile), (0, 0)))  # a tile starting at any row stays in bounds
    offsets = jnp.arange(tile)

    def step(carry):
        n, out = carry
        expert = jnp.searchsorted(tile_ends, n, side="right")
        first = starts[expert] + (n - tile_ends[expert] + tiles_e[expert]) * tile
        x = jax.lax.dynamic_slice_in_dim(lhs, first, tile)
        w = jax.lax.dynamic_index_in_dim(rhs_eio, expert, keepdims=False)  # lhs's dtype
        y = jnp.dot(x, w)
        old = jax.lax.dynamic_slice_in_dim(out, first, tile)
        mine = (first + offsets < ends[expert])[:, None]  # the next expert's rows stay
        return n + 1, jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), first, 0)

    out = jnp.zeros((m + tile, o), lhs_mi.dtype)  # rows past the groups stay zero
    _, out = jax.lax.while_loop(lambda c: c[0] < tile_ends[-1], step, (jnp.int32(0), out))
    return out[:m]


def grouped_matmul(lhs_mi, rhs_eio, group_sizes):
    """A grouped GEMM: rows in expert groups (group e: the next group_sizes[e] rows) times
    their expert's [I, O] matrix; rows past the groups come out zero. `jax.lax.ragged_dot` on
    GPU and TPU. On the CPU, XLA has no ragged dot and JAX's fallback multiplies every row by
    every expert (one GEMM of M x E*I, dense all-experts compute): there the tiled loop
    (`_tiled_grouped_matmul`) runs when it reads fewer experts (fewer rows than experts:
    small-batch decode) or saves most of the work (at least 8 rows per expert: prefill). In
    between, the fallback's single GEMM beats a loop of tiny ones on XLA:CPU (`jaxgen bench
    moe`, batch 8: 16 experts x 32 rows)."""
    rhs_eio = rhs_eio.astype(lhs_mi.dtype)
    m, e = lhs_mi.shape[0], rhs_eio.shape[0]
    cpu = _tiled_grouped_matmul if m < e or m >= 8 * e else jax.lax.ragged_dot
    return jax.lax.platform_dependent(
        lhs_mi, rhs_eio, group_sizes, cpu=cpu, default=jax.lax.ragged_dot
    )


def _expert_ffn(rows_md, group_sizes, gate_edf, up_edf, down_efd):
    """SwiGLU of rows sorted by expert: group e is the next group_sizes[e] rows (rows past the
    groups come out zero)."""

    def grouped(lhs, rhs):
        return grouped_matmul(lhs, rhs, group_sizes)

    act_mf = nn.silu(grouped(rows_md, gate_edf)) * grouped(rows_md, up_edf)
    return grouped(act_mf, down_efd)


def _combine(out_md, order_m, weights_tk):
    """Unsorts routed rows [M, D] (sorted by `order_m`) and sums each token's k rows, weighted,
    in a fixed order (a scatter-add would sum in any order): [T, D] in f32."""
    t, k = weights_tk.shape
    unsorted = jnp.zeros_like(out_md).at[order_m].set(out_md).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights_tk)


def grouped_experts(x_td, weights_tk, experts_tk, gate_edf, up_edf, down_efd):
    """sum_k weights[t, k] * FFN_{experts[t, k]}(x[t]) with tokens grouped by expert.

    Args:
      x_td: [T, D]; weights_tk: f32[T, k]; experts_tk: i32[T, k].
      gate_edf, up_edf: [E, D, F]; down_efd: [E, F, D].
    Returns:
      [T, D] in x's dtype.
    """
    k = experts_tk.shape[1]
    flat_m = experts_tk.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True)  # routed rows sorted by expert
    group_sizes = jnp.bincount(flat_m, length=gate_edf.shape[0]).astype(jnp.int32)
    x_md = jnp.take(x_td, order_m // k, axis=0)
    out_md = _expert_ffn(x_md, group_sizes, gate_edf, up_edf, down_efd)
    return _combine(out_md, order_m, weights_tk).astype(x_td.dtype)


def expert_parallel_size() -> int:
    """Size of the "expert" axis of the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[EXPERT_AXIS]


def _dispatch_combine(x_cd, weights_ck, experts_ck, gate_ldf, up_ldf, down_lfd, ep):
    """One device of the expert-parallel group: its chunk of tokens out to the devices holding
    their experts (all-to-all), through this device's L = E / ep experts, and back.

    Each destination's buffer has room for all M = C*k of the chunk's routed rows, the most one
    device can be sent, so no row is ever dropped (no capacity factor)."""
    c, k = experts_ck.shape
    m, num_local = c * k, gate_ldf.shape[0]
    flat_m = experts_ck.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True)  # by expert, so also by destination device
    expert_m = flat_m[order_m]
    dest_m = expert_m // num_local
    counts = jnp.bincount(dest_m, length=ep)
    slot_m = jnp.arange(m) - (jnp.cumsum(counts) - counts)[dest_m]
    x_md = jnp.take(x_cd, order_m // k, axis=0)
    send = jnp.zeros((ep, m, x_cd.shape[1]), x_cd.dtype).at[dest_m, slot_m].set(x_md)
    # Local expert id of each row; `num_local` marks an empty slot (counted in no group).
    send_ids = (
        jnp.full((ep, m), num_local, jnp.int32)
        .at[dest_m, slot_m]
        .set(expert_m - dest_m * num_local)
    )
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0).reshape(ep * m, -1)
    recv_ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0).reshape(ep * m)
    order_r = jnp.argsort(recv_ids, stable=True)
    sizes = jnp.bincount(recv_ids, length=num_local).astype(jnp.int32)
    out_r = _expert_ffn(recv[order_r], sizes, gate_ldf, up_ldf, down_lfd)
    out = jnp.zeros_like(out_r).at[order_r].set(out_r).reshape(ep, m, -1)
    back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0)  # back[d]: my rows, computed on d
    return _combine(back[dest_m, slot_m], order_m, weights_ck).astype(x_cd.dtype)


def expert_parallel_experts(x_td, weights_tk, experts_tk, gate_edf, up_edf, down_efd, ep):
    """`grouped_experts` with experts split over the mesh's "expert" axis (ep devices): each
    device routes a 1/ep share of the tokens (they arrive replicated over the axis), exchanges
    rows with all-to-all, and the results are gathered back to every device."""
    t = x_td.shape[0]
    pad = -t % ep
    if pad:  # padded rows carry zero weight
        x_td = jnp.pad(x_td, ((0, pad), (0, 0)))
        weights_tk = jnp.pad(weights_tk, ((0, pad), (0, 0)))
        experts_tk = jnp.pad(experts_tk, ((0, pad), (0, 0)))
    split = P(EXPERT_AXIS)
    out = jax.shard_map(
        functools.partial(_dispatch_combine, ep=ep),
        in_specs=(split,) * 6,
        out_specs=split,
        axis_names={EXPERT_AXIS},
        check_vma=False,
    )(x_td, weights_tk, experts_tk, gate_edf, up_edf, down_efd)
    return out[:t]


class Experts(nn.Module):
    """E stacked SwiGLU experts: gate_proj and up_proj [E, D, F], down_proj [E, F, D]."""

    moe: MoEConfig

    @nn.compact
    def __call__(self, x_td, weights_tk, experts_tk):
        e, f, d = self.moe.num_experts, self.moe.intermediate_size, x_td.shape[-1]
        gate = self.param("gate_proj", _init, (e, d, f))
        up = self.param("up_proj", _init, (e, d, f))
        down = self.param("down_proj", _init, (e, f, d))
        ep = expert_parallel_size()
        if ep > 1:
            return expert_parallel_experts(x_td, weights_tk, experts_tk, gate, up, down, ep)
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
