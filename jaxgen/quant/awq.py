"""AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization"), scale search for one
group of linears that share an input.

Salient input channels are those with large activations. Scaling W's input row j by s_j and the
activation by 1/s_j (folded into the preceding op) leaves the float function unchanged but
shrinks the relative rounding error of salient rows. s = mean|x|^alpha, normalised, with alpha
found by a grid search minimising the output error || X W - Q(W s) (X / s) || on calibration
inputs (§3.2).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxgen.quant.formats import quantize_rtn


def awq_scales(
    x: np.ndarray,
    weights: list[np.ndarray],
    fmt: str = "int4",
    group_size: int | None = 128,
    grid: int = 20,
):
    """Searches per-input-channel scales for linears sharing input `x`.

    Args:
      x: calibration inputs [tokens, in]; weights: the linears' W [in, out_i].
    Returns:
      (s [in], best alpha, {alpha: error}).
    """
    x = jnp.asarray(x, jnp.float32)
    w = jnp.concatenate([jnp.asarray(m, jnp.float32) for m in weights], axis=1)
    reference = x @ w
    x_mag = jnp.mean(jnp.abs(x), axis=0)
    errors, best = {}, (None, None, np.inf)
    for alpha in np.linspace(0.0, 1.0, grid + 1):
        s = jnp.maximum(x_mag, 1e-8) ** alpha
        s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))  # keep the scales centred around 1
        deq = quantize_rtn(w * s[:, None], fmt, group_size).dequantize()
        err = float(jnp.mean((reference - (x / s) @ deq) ** 2))
        errors[float(alpha)] = err
        if err < best[2]:
            best = (np.asarray(s), float(alpha), err)
    return best[0], best[1], errors
