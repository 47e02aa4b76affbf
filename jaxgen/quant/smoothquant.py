"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights.

For linears sharing an input X: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j
(max over tokens for X, over output channels of every linear for W); X' = X / s (folded into
the preceding op) and W' = diag(s) W leave X W unchanged while flattening X's outlier channels
so per-token int8 activations lose less.
"""

from __future__ import annotations

import numpy as np


def smooth_scales(
    act_absmax: np.ndarray, weights: list[np.ndarray], alpha: float = 0.5, eps: float = 1e-5
) -> np.ndarray:
    """s [in] from per-channel activation abs-max [in] and the weights W_i [in, out_i]."""
    w_absmax = np.max(np.stack([np.abs(w).max(axis=1) for w in weights]), axis=0)
    s = np.maximum(act_absmax, eps) ** alpha / np.maximum(w_absmax, eps) ** (1 - alpha)
    return np.where(np.isfinite(s) & (s > 0), s, 1.0).astype(np.float32)
