"""The step loop of `LLMEngine`: schedule -> dispatch -> land, overlapped (SGLang's overlap
scheduler, vLLM's async scheduling). A dispatched step stays in flight while the host schedules,
packs and dispatches the next one, whose decode rows read the tokens the first samples straight
from the device; only then does the host read the first step's tokens back and apply them
(stops, detokenizing, pages). A sequence that turns out to have finished costs one wasted row in
the next step, never a wrong token. Steps whose next step needs their tokens on the host first
(speculative verification and drafting, beam search, penalties, a pipelined mesh) and steps
that could make the next schedule preempt run synchronously, as does every step with
`EngineConfig(overlap=False)`. Each landed step is counted and, with a step log listening
(`on_step`), recorded with the host beside it."""

from __future__ import annotations

import contextlib
import time

import jax

from jaxgen.engine import kv_tiers
from jaxgen.engine.metrics import HostClock, step_record
from jaxgen.engine.runner.model_runner import Flight, record_prompt_logprobs
from jaxgen.engine.sample.sampling import uses_penalties
from jaxgen.engine.sched.state import ScheduledStep
from jaxgen.engine.spec_decode.speculative import propose, sync_drafter


class StepLoop:
    """`step` and what it runs of `LLMEngine` (mixed into it)."""

    def _init_loop(self) -> None:
        self._flight: Flight | None = None  # the dispatched step not handed back yet
        self.num_steps = 0
        self.tokens_generated = 0
        self.busy_time = 0.0
        self.peak_pages_used = 0
        self.overlapped_steps = 0  # steps dispatched while the previous one was in flight
        self.covered_steps = 0  # steps run on a larger compiled program (`cover_new_shapes`)
        self.deferred_prefills = 0  # prefill rows a frozen engine moved to the next step
        self.last_step: dict = {}
        self._on_step = None  # `on_step`
        self._clock: HostClock | None = None  # the host beside logged steps, while one listens
        self._last_landed = 0.0
        self._landed_mark = None  # `_clock` as the last step landed (a step log listens)

    @property
    def on_step(self):
        """Called with each landed step's `last_step` (`serve --step-log`); None: no step log.
        Setting it starts the engine's `HostClock` (its listeners), clearing it stops it."""
        return self._on_step

    @on_step.setter
    def on_step(self, callback) -> None:
        self._on_step = callback
        if callback is None and self._clock is not None:
            self._clock.close()
            self._clock = self._landed_mark = None
        elif callback is not None and self._clock is None:
            self._clock = HostClock().install()

    def step(self) -> list:
        """Runs one scheduling iteration; returns [(Sequence, text delta)] for the tokens handed
        back. With overlap, the step dispatched here stays in flight while the previous one is
        handed back: its tokens come with the next call (`has_work` holds until then)."""
        t0 = time.perf_counter()
        events = []
        flight, self._flight = self._flight, None
        if self.paused == "keep":  # only the step still in flight lands
            return [] if flight is None else self._land(flight)
        if flight is not None and not self.scheduler.decodes_fit():
            events += self._land(flight)  # the schedule may preempt: no pending tokens then
            flight = None
            t0 = time.perf_counter()
        drafts = None
        if self.spec is not None:
            decoding = self.scheduler.decoding()
            drafts, self._logq, self._logq_rows = propose(self.spec, self.drafter, decoding)
        step = self.scheduler.schedule(drafts)
        if self.bm.pending_offload or self.bm.pending_load:
            self.kv = kv_tiers.move_pages(self.bm, self.kv_store, self.kv)
        if self.adapters is not None:
            self.adapters.commit()  # adapters the schedule gave slots, before the step reads them
        self.peak_pages_used = max(self.peak_pages_used, self.bm.num_used_pages)
        self.profile.add("schedule", time.perf_counter() - t0)
        launched = None
        if not step.empty:
            with self.placement.context() if self.placement else contextlib.nullcontext():
                launched, landed = self._launch(step, flight)
            self.profile.steps += 1
            self.overlapped_steps += flight is not None
            if landed is not None:  # a constrained step landed `flight` before its masks
                events += landed
                flight = None
        elif flight is None and self.scheduler.has_work and not self.scheduler.running:
            raise RuntimeError("scheduler made no progress with free pages")  # a bug
        if flight is not None:
            events += self._land(flight)
        if launched is not None:
            if self._may_fly(step):
                self._flight = launched
            else:
                events += self._land(launched)
        if self.bm.write_through and self.bm.pending_offload:
            # Finished sequences' pages are in the tiers before their outputs are handed back
            # (a decode instance asked next finds them).
            self.kv = kv_tiers.move_pages(self.bm, self.kv_store, self.kv)
        return events

    def _may_fly(self, step: ScheduledStep) -> bool:
        """Whether the next step may be scheduled before this one's tokens are on the host."""
        if not self.engine_cfg.overlap or self.spec is not None or self.pipeline is not None:
            return False
        return not any(
            r.state.request.beam is not None or uses_penalties(r.state.seq.params)
            for r in step.decode + step.prefill + step.samples
        )

    def _launch(self, step: ScheduledStep, prev: Flight | None) -> tuple[Flight, list | None]:
        """Dispatches one step on the model runner; `prev`: the step still in flight. Returns
        the new flight, and `prev`'s events when the step had to land it first."""

        def land_prev() -> list:
            self.scheduler.launch(step)
            return [] if prev is None else self._land(prev)

        mark = self._clock.mark() if self._clock is not None else None
        alive = {s.id for s in self.scheduler.running}
        flight, self.kv, landed = self.runner.launch(
            step, prev, self._arrays(), land_prev, alive, (self._logq, self._logq_rows)
        )
        if landed is None:  # a step that landed `prev` first (constrained, compiling) launched
            self.scheduler.launch(step)
        flight.mark = mark
        self.covered_steps += flight.covered
        self.deferred_prefills += flight.deferred
        return flight, landed

    def _land(self, flight: Flight) -> list:
        """Reads a dispatched step's results back (waiting for the device) and applies them:
        prompt logprobs, tokens into sequences, stops, pages. Returns its events."""
        step = flight.step
        t0 = time.perf_counter()
        host, verified, prompt = self.runner.read(flight)
        t1 = time.perf_counter()
        self.profile.add("wait", t1 - t0)
        if flight.mark is not None and self._clock is not None:  # the host over the step's span
            later = flight.dispatched < self._last_landed and self._landed_mark is not None
            flight.host = self._clock.since(self._landed_mark if later else flight.mark)
            self._landed_mark = self._clock.mark()
        self._account(step, t1 - max(flight.dispatched, self._last_landed), flight)
        self._last_landed = t1
        if prompt is not None:
            if flight.parts is None:
                record_prompt_logprobs(step, prompt, flight.md)
            else:
                for m, part in enumerate(flight.parts):
                    part_info = jax.tree.map(lambda a, m=m: a[m], prompt)
                    record_prompt_logprobs(part, part_info, flight.md)

        rows = step.decode + step.prefill + step.samples
        logprobs, ranks = host.logprobs.tolist(), host.ranks.tolist()

        def row_info(r):
            n = rows[r].state.seq.params.logprobs or 0
            if not n:
                return logprobs[r], ranks[r], []
            ids, values = host.top_ids[r, :n].tolist(), host.top_logprobs[r, :n].tolist()
            return logprobs[r], ranks[r], list(zip(ids, values, strict=True))

        events = list(self.scheduler.update(step, host.tokens.tolist(), row_info, verified))
        if step.verify:
            self.spec_stats.add(step, verified)
            if self.drafter is not None:
                sync_drafter(self.drafter, {s.id: s for s in self.scheduler.running})
        self.tokens_generated += len(events)
        self.profile.add("update", time.perf_counter() - t1)
        return events

    def _account(self, step: ScheduledStep, elapsed: float, flight: Flight) -> None:
        """Counts a landed step and records it (`metrics.step_record`); a step log listening
        (`on_step`) gets the record with the step's shape."""
        self.num_steps += 1
        self.busy_time += elapsed
        self.last_step = step_record(
            self.cfg, self.weight_bytes, self.kv_itemsize, step, elapsed, flight,
            shape=self.on_step is not None,
        )  # fmt: skip
        if self.on_step is not None:
            self.on_step(self.last_step)
