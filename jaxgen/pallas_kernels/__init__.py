"""GPU kernels (Pallas, Triton backend) with a pure-jnp reference for each.

Imports nothing else of jaxgen. Callers go through `pallas_kernels.dispatch`.
"""
