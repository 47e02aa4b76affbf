"""The one place that reaches into JAX's Mosaic GPU interpreter (a private module).

JAX ships an interpreter for Mosaic GPU kernels (`jax._src.pallas.mosaic_gpu.interpret`): it runs
a kernel on the CPU while simulating shared memory, TMA copies, barriers and warpgroups, and it
detects races between them. Our Hopper kernels are tested through it. JAX 0.12 exports its
parameters as `plgpu.InterpretGPUParams`; the race state is private in every version. JAX 0.10's
interpreter cannot run our kernels (it has no transposed wgmma operand): tests that need it run
in `make test-newest-jax`.
"""

from __future__ import annotations

import jax

MIN_JAX = (0, 12)


def available() -> bool:
    """Whether this JAX's interpreter runs our Hopper kernels."""
    return tuple(int(x) for x in jax.__version__.split(".")[:2]) >= MIN_JAX


def interpret_params(*, detect_races: bool = True):
    """Parameters that run a `plgpu.kernel` in the interpreter (pass as its `interpret=`)."""
    if not available():
        raise RuntimeError(
            f"JAX {jax.__version__}'s Mosaic GPU interpreter cannot run the Hopper kernels "
            f"(needs JAX >= {'.'.join(map(str, MIN_JAX))}; Python 3.12: make test-newest-jax)"
        )
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams

    return InterpretGPUParams(detect_races=detect_races)


def _state():
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return interpret_pallas_call


def races() -> bool:
    """Whether the interpreter saw a data race since the last `reset()`."""
    return bool(_state().get_races().races_found)


def reset() -> None:
    """Clear the interpreter's state (also needed after a kernel raised inside it)."""
    _state().reset_gpu_interpret_mode_state()
