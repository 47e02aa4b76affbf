"""Quantization-aware training: fake quantization with a straight-through estimator (Bengio et
al. 2013; as used by Jacob et al. 2018). The forward pass sees quantize->dequantize(W); the
backward pass treats that round trip as the identity, so the full-precision weights learn to
sit where rounding hurts the loss least. The trained weights export as a real QArray (RTN)."""

from __future__ import annotations

import functools

import jax
import optax

from jaxgen.quant.apply import map_linears
from jaxgen.quant.formats import quantize_rtn


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quant(w, fmt: str, group_size):
    """quantize->dequantize(W) with the straight-through gradient."""
    return quantize_rtn(w, fmt, group_size).dequantize(w.dtype)


def _fake_quant_fwd(w, fmt, group_size):
    return fake_quant(w, fmt, group_size), None


def _fake_quant_bwd(fmt, group_size, _, g):
    return (g,)  # straight-through: d fake_quant / d w := I


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant_params(params, fmt: str, group_size):
    return map_linears(params, lambda path, w: fake_quant(w, fmt, group_size))


def train(
    params,
    loss_fn,
    batches,
    fmt: str,
    group_size,
    *,
    learning_rate: float = 1e-5,
    steps: int = 100,
    progress=None,
):
    """Fine-tunes full-precision `params` to minimise loss_fn(fake_quant_params(params), batch).

    Args:
      loss_fn: (params, batch) -> scalar loss (e.g. next-token cross-entropy).
      batches: an iterable of batches (cycled).
    Returns:
      (trained full-precision params, [loss per step]).
    """
    optimizer = optax.adam(learning_rate)
    state = optimizer.init(params)

    def quantized_loss(params, batch):
        return loss_fn(fake_quant_params(params, fmt, group_size), batch)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(quantized_loss)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    batches = list(batches)
    for i in range(steps):
        params, state, loss = step(params, state, batches[i % len(batches)])
        losses.append(float(loss))
        if progress:
            progress(i, losses[-1])
    return params, losses
