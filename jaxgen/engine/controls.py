"""The controls of a training loop over a serving engine (`LLM.update_weights`, `pause`,
`sleep`, as vLLM's RL integrations use them): new weights in place, pausing admission or every
step, and freeing the device memory of the KV pool (and the weights) between generations.
Mixed into `LLMEngine`, whose scheduler, block manager, pool and step in flight they act on."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxgen.errors import EngineSleeping, JaxgenError

PAUSE_MODES = ("finish", "abort", "keep")


class EngineControls:
    """`replace_params`, `pause` / `resume` and `sleep` / `wake_up` of `LLMEngine`."""

    def _init_controls(self) -> None:
        # The nonce keeps one process's weights versions apart from another's in a shared or
        # disk KV tier.
        self.weights_version = 0
        self._weights_nonce = os.urandom(8).hex()
        self.paused: str | None = None  # a `PAUSE_MODES` mode while paused
        self._paused_version = 0  # the weights version `pause` saw
        self.sleep_level = 0  # 1: the KV pool is freed; 2: the weights too
        self._kv_alloc = None  # compiled on the first `sleep`: re-allocates the pool

    def replace_params(self, params) -> int:
        """Takes `params` in place of the weights: the same leaves, shapes, dtypes and
        shardings (the compiled steps take params as an argument, so nothing recompiles).
        Cached prefixes of older weights are never reused, on the device or in the tiers;
        sequences running keep their K/V (`pause("keep")` first has `resume` recompute them).
        Returns the new weights version."""
        self.params = params
        self.weights_version += 1
        self.bm.set_weights_key((self._weights_nonce, self.weights_version))
        return self.weights_version

    def pause(self, mode: str = "finish") -> list[str]:
        """Stops admitting requests. "finish": running sequences go on to their end; "abort":
        every request is aborted (finish reason "abort") and new ones are refused; "keep":
        no step runs, running sequences keep their pages (recomputed on `resume` when the
        weights changed meanwhile). Other requests wait for `resume`. Returns the ids of the
        requests aborted."""
        if mode not in PAUSE_MODES:
            raise JaxgenError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        aborted = []
        if mode == "abort":
            if self._flight is not None:  # its tokens belong to requests about to be aborted
                flight, self._flight = self._flight, None
                self._land(flight)
            aborted = list(self.scheduler.requests)
            for request_id in aborted:
                self.scheduler.abort(request_id)
        if self.paused is None:
            self._paused_version = self.weights_version
        self.paused = mode
        self.scheduler.admitting = False
        return aborted

    def resume(self) -> None:
        """Steps again after `pause`; sequences kept through a weight update recompute."""
        if self.paused == "keep" and self.weights_version != self._paused_version:
            if self._flight is not None:
                raise RuntimeError("a step flew while paused")  # `step` lands it when paused
            self.scheduler.preempt_running()
        self.paused = None
        self.scheduler.admitting = not self.sleep_level

    def sleep(self, level: int = 1) -> None:
        """Frees the KV page pool's device memory (level 2: drops the weights too; they come
        back by `replace_params`); the compiled step programs stay. Needs no sequence running;
        requests added meanwhile wait for `wake_up`."""
        if level not in (1, 2):
            raise JaxgenError(
                f"sleep level must be 1 (KV pool) or 2 (KV pool and weights), got {level!r}"
            )
        if self.scheduler.running or self._flight is not None:
            raise JaxgenError(
                "sleep frees the KV pool under running requests: pause(mode='finish' or "
                "'abort') and let them end first"
            )
        if self.drafter is not None:
            raise JaxgenError("sleep does not free a draft model's pool yet: drop speculative=")
        if self.sleep_level:
            if level == 2:
                self.params = None
            self.sleep_level = max(self.sleep_level, level)
            return
        if self._kv_alloc is None:  # compiled while the pool exists, reused by every wake_up
            spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.kv)
            self._kv_alloc = (
                jax.jit(
                    lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec),
                    out_shardings=jax.tree.map(lambda a: a.sharding, self.kv),
                )
                .lower()
                .compile()
            )
        self.flush_kv_tiers()
        self.bm.reset_prefix_cache()  # the pages' contents go with the pool
        for leaf in jax.tree.leaves(self.kv):
            leaf.delete()
        self.kv = self.runner.last_inputs = None
        if level == 2:
            self.params = None
        self.sleep_level = level
        self.scheduler.admitting = False

    def wake_up(self) -> None:
        """Re-allocates the KV pool (no compile: its program was compiled by `sleep`)."""
        if not self.sleep_level:
            return
        if self.params is None:
            raise EngineSleeping(
                "the engine slept at level 2 and holds no weights: update_weights(params) "
                "before wake_up()"
            )
        self.kv = self._kv_alloc()
        self.sleep_level = 0
        self.scheduler.admitting = self.paused is None
