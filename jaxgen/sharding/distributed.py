"""Multi-host start-up: `jax.distributed.initialize` from flags or environment variables.

    jaxgen generate --coordinator HOST:PORT --num-processes N --process-id I ...

or JAXGEN_COORDINATOR / JAXGEN_NUM_PROCESSES / JAXGEN_PROCESS_ID. On CPU devices the gloo
collectives carry the cross-process traffic. Must run before any other JAX call.
"""

from __future__ import annotations

import os

import jax


def initialize(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Joins the multi-process job if one is configured; returns whether it did."""
    coordinator = coordinator or os.environ.get("JAXGEN_COORDINATOR")
    if not coordinator:
        return False
    num_processes = num_processes or int(os.environ.get("JAXGEN_NUM_PROCESSES", "1"))
    if process_id is None:
        process_id = int(os.environ.get("JAXGEN_PROCESS_ID", "0"))
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
    return True
