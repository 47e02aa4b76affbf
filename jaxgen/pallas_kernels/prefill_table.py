"""The fastest prefill attention kernel per GPU and shape class, as measured.

Written by `python -m benchmarks.kernels flash --table` on the GPU (the suite's `flash` step)
and committed; `dispatch.attention` reads it on the GPU. Keys: the device kind, then
`dispatch.shape_class`. A shape class without an entry runs the Triton kernel.

No GPU run has measured the Hopper kernel yet, so no entry picks it.
"""

TABLE: dict[str, dict[str, str]] = {}
