"""One tolerance table for every kernel test, keyed by input dtype (reference in f32)."""

import jax.numpy as jnp

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 5e-3}


def tol(dtype) -> float:
    return TOL[jnp.dtype(dtype)]
