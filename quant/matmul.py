"""The model's matmul helper: dispatches on the weight's type, so model code never changes
when a weight is quantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype."""
    return jnp.matmul(x, w.astype(x.dtype))
