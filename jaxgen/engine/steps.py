"""The public home of the jitted steps (`from jaxgen.engine.steps import prefill, decode`, as
DESIGN.md names them); they are defined in `jaxgen.engine.runner.steps`, beside the rest of the
model runner."""

from jaxgen.engine.runner.steps import decode, decode_loop, paged_step, prefill

__all__ = ["decode", "decode_loop", "paged_step", "prefill"]
