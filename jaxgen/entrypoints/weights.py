"""Weights handed to a running engine (`LLM.update_weights`): checked against the model's
layout on the host, then placed like the engine's own leaves without a trip through the host.

A leaf already of the engine's dtype and sharding is taken as is (a pointer swap); any other
float leaf is cast and/or resharded on the device (`jax.device_put` between shardings copies
device to device). An engine that runs quantized quantizes float weights to its format first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.errors import WeightsMismatch


def layout(params) -> dict:
    """{path: (shape, dtype)} of a params pytree: what `check_layout` compares against."""
    return {
        jax.tree_util.keystr(path): (tuple(leaf.shape), jnp.dtype(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }


def check_layout(params, expected: dict) -> None:
    """Raises WeightsMismatch (reading only shapes and dtypes) unless `params` has exactly the
    leaves of `expected` (`layout` of the model's weights), each of its shape, and float where
    the model's is float."""
    try:
        got = layout(params)
    except AttributeError as e:
        raise WeightsMismatch(
            f"weights must be a pytree of arrays in the layout load_model returns: {e}"
        ) from None
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    if missing or extra:
        raise WeightsMismatch(
            f"the weights' leaves differ from the model's: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, extra {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''} (give the pytree load_model returns)"
        )
    for path, (shape, dtype) in expected.items():
        got_shape, got_dtype = got[path]
        if got_shape != shape:
            raise WeightsMismatch(f"weights{path} has shape {got_shape}; the model's is {shape}")
        if jnp.issubdtype(dtype, jnp.floating) != jnp.issubdtype(got_dtype, jnp.floating):
            raise WeightsMismatch(f"weights{path} is {got_dtype}; the model's is {dtype}")


def place_like(params, target):
    """`params` with each leaf of `target`'s dtype and sharding (`target`: arrays or
    `jax.ShapeDtypeStruct`s with shardings, same tree). Leaves that match are not copied."""

    def place(new, like):
        if not isinstance(new, jax.Array):
            new = np.asarray(new)  # a host array (e.g. from a checkpoint): one transfer
        if new.dtype != like.dtype:
            new = new.astype(like.dtype)
        if isinstance(new, jax.Array) and new.sharding == like.sharding:
            return new
        return jax.device_put(new, like.sharding)

    return jax.tree.map(place, params, target)


def spec(params):
    """The abstract of a params pytree: shapes, dtypes and shardings (no buffers held; a host
    leaf, e.g. a numpy array an engine was built from, has no sharding: placed on the default
    device)."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
        params,
    )
