"""What an engine records of its steps beside the tokens: where the host's time goes
(`HostProfile`), what the host did during a logged step (`HostClock`), and the step program's
shape as a step log records it (`shape_record`)."""

from __future__ import annotations

import gc
import threading
import time

import jax

from jaxgen.engine import roofline
from jaxgen.engine.runner.shapes import StepShape


class HostProfile:
    """Where an engine's step time goes, summed over steps: `schedule` (scheduler, drafts),
    `pack` (host arrays of the step), `dispatch` (the jitted call returning, and compiles),
    `wait` (the host blocked on the device for a step's tokens), `update` (tokens into
    sequences, stops, detokenizing, pages)."""

    PHASES = ("schedule", "pack", "dispatch", "wait", "update")

    def __init__(self):
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def reset(self) -> None:
        self.__init__()

    def per_step_ms(self) -> dict[str, float]:
        return {k: 1e3 * v / max(self.steps, 1) for k, v in self.seconds.items()}


class HostClock:
    """What a step log records of the host beside each step's wall time, to tell a slow step's
    cause from outside the device: the process's CPU seconds (all its threads; a step whose
    wall time runs far past them waited for a core another process had), the Python garbage
    collector's pauses (every thread's: they hold the GIL), and the seconds JAX spent tracing
    and compiling on the engine's own thread, with the names of the functions compiled (a
    program the engine believed compiled that compiled again, or a helper compiled for a new
    shape). One per engine that logs steps (`LLMEngine.on_step`): its listeners are installed
    by `install` and removed by `close`, so no clock outlives the step log it serves."""

    TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
    COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self._lock = threading.Lock()
        self._installed = False
        self._gc_started = 0.0
        self.gc_seconds = 0.0
        self._jax: dict[int, list] = {}  # thread -> [trace s, compile s, compiles]
        self._names: dict[int, list[str]] = {}  # thread -> the functions it compiled

    def install(self) -> HostClock:
        with self._lock:
            if not self._installed:
                self._installed = True
                gc.callbacks.append(self._on_gc)
                jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def close(self) -> None:
        with self._lock:
            if self._installed:
                self._installed = False
                gc.callbacks.remove(self._on_gc)
                jax.monitoring.unregister_event_duration_listener(self._on_event)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_started

    def _on_event(self, event: str, seconds: float, **kwargs) -> None:
        if event not in (self.TRACE_EVENT, self.COMPILE_EVENT):
            return
        thread = threading.get_ident()
        mine = self._jax.setdefault(thread, [0.0, 0.0, 0])
        if event == self.TRACE_EVENT:
            mine[0] += seconds
        else:
            mine[1] += seconds
            mine[2] += 1
            self._names.setdefault(thread, []).append(str(kwargs.get("fun_name", "?")))

    def mark(self) -> tuple:
        """The counters now, as the calling (engine) thread sees them (after `install`)."""
        mine = self._jax.get(threading.get_ident(), (0.0, 0.0, 0))
        return (time.process_time(), self.gc_seconds, *mine)

    def since(self, mark: tuple) -> dict:
        """The step log's host fields between `mark` and now."""
        now = self.mark()
        cpu, gcs, trace, compiled, compiles = (b - a for a, b in zip(mark, now, strict=True))
        names = self._names.get(threading.get_ident(), [])
        names = names[len(names) - int(compiles) :] if compiles else []
        return dict(cpu_seconds=cpu, gc_seconds=gcs, trace_seconds=trace,
                    compile_seconds=compiled, jax_compiles=int(compiles),
                    compiled_functions=names)  # fmt: skip


def step_record(cfg, weight_bytes, kv_itemsize, step, elapsed: float, flight, shape: bool):
    """A landed step's record: its rows and roofline numerators (bytes, FLOPs: the live MBU /
    MFU of `stats()`); with `shape`, also what a latency model is fitted to (`serve
    --step-log`): the step's rows, context and padded shape, and the host beside it.
    `elapsed`: from the later of its dispatch and the previous step's landing to its own
    landing, so back-to-back steps' records add up to the busy wall time."""
    rows = step.decode + step.verify + step.prefill
    cost = roofline.step_cost(
        cfg,
        weight_bytes,
        new_tokens=step.num_tokens,
        context_tokens=sum(r.end for r in rows),
        kv_itemsize=kv_itemsize,
        attended_pairs=sum((r.end - r.start) * (r.start + r.end + 1) // 2 for r in rows),
    )
    record = {
        "seconds": elapsed,
        "tokens": step.num_tokens,
        "decode_rows": len(step.decode),
        "prefill_rows": len(step.prefill),
        **cost,
    }
    if shape:
        record.update(
            # decode rows' KV tokens read, and each prefill chunk as (tokens, cached before)
            decode_context=sum(r.end for r in step.decode),
            chunks=[(r.end - r.start, r.start) for r in step.prefill],
            # what decides the step's program (`planner.Padding.program`): each decode
            # row's tokens once this step's is written, each prefill row's prompt length
            decode_lens=[r.end for r in step.decode],
            prompt_lens=[len(r.state.seq.prompt_ids) for r in step.prefill],
            compiled=flight.compiled,
            covered=flight.covered,  # `shape` is the larger program's it ran on
            compiling=flight.compiling,  # background compiles sharing the host meanwhile
            deferred=flight.deferred,  # prefill rows left to the next step (frozen)
            **(flight.host or {}),  # `HostClock.since`: CPU, GC, traces and compiles
        )
        if flight.shape is not None:  # what the program computed: the rows padded to buckets
            record["shape"] = shape_record(flight.shape)
    return record


def shape_record(shape: StepShape) -> dict:
    """A step program's shape as the step log records it (`serve --step-log`: the sizes the
    simulator's `planner.Padding.key_of` reads); a ragged step's as its token bucket and rows."""
    if not hasattr(shape, "num_decode"):  # `shapes.FlatShape`
        return dict(num_tokens=shape.num_tokens, num_rows=shape.num_rows)
    return dict(
        num_decode=shape.num_decode,
        prefill_rows=shape.prefill_rows,
        prefill_len=shape.prefill_len,
        max_pages=shape.max_pages,
        decode_blocks=shape.decode_blocks,
        prefill_fresh=shape.prefill_fresh,
        num_rows=shape.num_rows,
    )


class CompileCounter:
    """XLA compiles in this process, on any thread, while installed: what `jaxgen serve` reports
    as `jaxgen_xla_compiles_total` (a compile while serving holds every running request)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._installed = False
        self.compiles = 0
        self.seconds = 0.0

    def install(self) -> CompileCounter:
        with self._lock:
            if not self._installed:
                self._installed = True
                jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def close(self) -> None:
        with self._lock:
            if self._installed:
                self._installed = False
                jax.monitoring.unregister_event_duration_listener(self._on_event)

    def _on_event(self, event: str, seconds: float, **kwargs) -> None:
        if event == HostClock.COMPILE_EVENT:
            with self._lock:
                self.compiles += 1
                self.seconds += seconds
