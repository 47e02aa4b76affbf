"""Logical axis names -> mesh axes, declared once.

The model names its parameter and activation axes (`model.llama.param_logical_axes`, and
`nn.with_logical_constraint` calls on activations); these rules map the names onto the mesh:

  batch -> data        vocab, heads, kv_heads, mlp -> model        seq -> seq (sequence parallel)
  experts -> expert (expert parallel)   expert_mlp, shared_mlp -> model
  layers -> stage (pipeline) or replicated        embed, head_dim -> replicated

A dimension that the mesh axis does not divide is replicated instead: e.g. SmolLM2's 3 KV
heads on tp=4 keep every KV head on every model shard (the K/V projections are computed
redundantly), and its 9 query heads on tp=2 or 4 stay whole; the MLP and vocabulary still split.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def logical_rules(cfg, mesh, *, sequence_parallel: bool = False, pipeline: bool = False):
    """Rules for `nn.logical_axis_rules` given the model config and the mesh."""
    tp = mesh.shape["model"]
    ep = mesh.shape["expert"]
    shared = cfg.moe.shared_intermediate_size if cfg.moe else None
    if ep > 1 and cfg.moe is None:
        raise ValueError(f"an expert-parallel mesh (ep={ep}) needs a Mixture-of-Experts model")
    if ep > 1 and cfg.moe.num_experts % ep:
        raise ValueError(
            f"ep={ep} must divide the model's {cfg.moe.num_experts} experts (each device holds "
            "the same number)"
        )

    def split(count):
        return "model" if count % tp == 0 else None

    return (
        ("batch", "data"),
        ("vocab", split(cfg.vocab_size)),
        ("heads", split(cfg.num_heads)),
        ("kv_heads", split(cfg.num_kv_heads)),
        ("mlp", split(cfg.intermediate_size)),
        # Mixture-of-Experts: experts split over "expert" (model.moe exchanges tokens with
        # all-to-all); each expert's and the shared experts' widths split like the MLP's.
        ("experts", "expert" if ep > 1 else None),
        ("expert_mlp", split(cfg.moe.intermediate_size) if cfg.moe else None),
        ("shared_mlp", split(shared) if shared else None),
        ("embed", None),
        ("head_dim", None),
        ("layers", "stage" if pipeline else None),
        ("seq", "seq" if sequence_parallel else None),
        ("kv_seq", None),
        # The contiguous cache's rows and KV heads. Inside a pipeline stage XLA's SPMD
        # partitioner cannot split the cache-write scatter over the remaining auto axes (a
        # Check failure), so there the cache stays whole on each device of a stage.
        ("cache_batch", None if pipeline else "data"),
        ("cache_kv_heads", None if pipeline else split(cfg.num_kv_heads)),
    )


def to_spec(axes, rules) -> PartitionSpec:
    return nn.logical_to_mesh_axes(axes, rules)


def param_shardings(mesh, rules, logical_tree):
    """NamedShardings for a tree of logical-axis tuples."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, to_spec(axes, rules)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _place(x, sharding):
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    # Multi-process: every process holds the same host array and fills its own shards.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params, mesh, rules, logical_tree):
    """Places each leaf on the mesh shard by shard (no full copy on one device first)."""
    shardings = param_shardings(mesh, rules, logical_tree)
    return jax.tree.map(_place, params, shardings)


def to_host(tree):
    """Host numpy copies of (replicated) arrays, also when they span several processes."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(one, tree)
