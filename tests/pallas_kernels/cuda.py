"""Lowering kernels for CUDA on a host without a GPU.

JAX 0.10 lowers a Triton kernel for the `cuda` platform from the kernel alone; JAX 0.11+ asks
which GPU it is compiling for (the Triton lowering reads the compute capability) and takes it
from an abstract device in the current abstract mesh. The target is the H200, the GPU of our
benchmark machines.
"""

import warnings

import jax

TARGET = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
# The Pallas Triton backend is deprecated from JAX 0.11 (still present in 0.12). Our Triton
# kernels move to Mosaic GPU in the roofline issues; until then each lowering must raise exactly
# this warning and no other.
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"
TRITON_DEPRECATED = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def lower_for_cuda(f, *args):
    """``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` aimed at an H200."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=TARGET
    )
    with warnings.catch_warnings(record=True) as caught, jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("always")
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    for w in caught:
        if (
            TRITON_DEPRECATED
            and issubclass(w.category, DeprecationWarning)
            and str(w.message).startswith(TRITON_DEPRECATION)
        ):
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if TRITON_DEPRECATED and "xla.gpu.triton" in lowered.as_text():
        assert any(str(w.message).startswith(TRITON_DEPRECATION) for w in caught), (
            "JAX stopped warning about the Triton backend: drop TRITON_DEPRECATION"
        )
    return lowered


__all__ = ["lower_for_cuda"]
