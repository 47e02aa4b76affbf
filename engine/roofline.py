"""Bytes moved and FLOPs of a model step, from the config: the numerators of MBU and MFU.

MBU (model bandwidth utilisation) = bytes a step must read / step time / peak bandwidth;
MFU (model FLOP utilisation) = FLOPs a step must do / step time / peak FLOP rate.
"""

from __future__ import annotations

import jax


def param_bytes(params) -> int:
    """Bytes of every parameter leaf (quantized weights count at their stored size)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def matmul_params(cfg) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not; the LM
    head does, tied or not)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attn + 3 * d * f) + cfg.vocab_size * d


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def step_cost(
    cfg,
    weight_bytes: int,
    *,
    new_tokens: int,
    context_tokens: int,
    kv_itemsize: int,
    attended_pairs: int | None = None,
) -> dict:
    """Minimum bytes and FLOPs of one forward step.

    Args:
      weight_bytes: `param_bytes(params)` (every weight is read once per step).
      new_tokens: tokens processed this step, summed over the batch.
      context_tokens: KV entries read this step, summed over the batch.
      attended_pairs: (query, key) pairs scored, summed over the batch; default
        new_tokens * context_tokens / batch is not knowable here, so decode callers pass
        context_tokens (one query per sequence).
    """
    pairs = context_tokens if attended_pairs is None else attended_pairs
    flops = 2 * matmul_params(cfg) * new_tokens
    flops += 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs  # QK^T and PV
    nbytes = weight_bytes + context_tokens * kv_bytes_per_token(cfg, kv_itemsize)
    return {"bytes": nbytes, "flops": flops}
