"""The public home of the jitted steps (`from jaxgen.engine.steps import prefill, decode`, as
DESIGN.md names them); they are defined in `jaxgen.engine.runner.steps` (the contiguous cache's
steps) and `jaxgen.engine.runner.packed` (the paged engine's packed step), beside the rest of
the model runner."""

from jaxgen.engine.runner.packed import paged_step
from jaxgen.engine.runner.steps import decode, decode_loop, prefill

__all__ = ["decode", "decode_loop", "paged_step", "prefill"]
