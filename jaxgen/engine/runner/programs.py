"""The engine's compiled step programs: which program a step runs on, compiled (or loaded) when.

A ragged engine (`shapes.FlatShape`) has one program per token bucket of its ladder, compiled or
loaded from the executable cache before it serves (`precompile`), plus one page-copy program per
power-of-two count of copies; nothing compiles while it serves (batch-invariant mode: two
programs). A row-shaped engine (`shapes.StepShape`: pipelined meshes, MLA models, speculative
decoding, batch-invariant mode on the attention kernels) compiles a program per shape it meets,
and may dodge those compiles: a step runs on a compiled program that covers it
(`EngineConfig.cover_new_shapes`), compiles its own on a thread beside the loop meanwhile
(`compile_in_background`), or, frozen (`freeze`), waits a prefill row rather than compile
(`_defer_prefills`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import time

import jax
import numpy as np

from jaxgen.engine.metrics import shape_record
from jaxgen.engine.runner import aot, packed
from jaxgen.engine.runner.shapes import FlatShape, StepShape, empty_flat_step, empty_step
from jaxgen.engine.sample.sampling import row_keys

log = logging.getLogger("jaxgen.engine")

# The background compile's log lines, which `jaxgen bench disagg` counts to wait for them.
BACKGROUND_COMPILE_STARTED = "in the background ("
BACKGROUND_COMPILE_ENDED = ("compiled in the background", "background compile of")


def _compile_logged(shape, args, statics):
    """`compile_in_background`'s work on the compile thread: `shape`'s step program, logged
    as it ends (not when the loop next collects it: an idle engine collects nothing)."""
    try:
        out = aot.compile_or_load(packed.paged_step, "paged_step", args, statics, None)
    except Exception as e:
        log.warning("background compile of %s failed (%s): it compiles on first use",
                    shape.describe(), e)  # fmt: skip
        raise
    log.info("  %s compiled in the background in %.2f s", shape.describe(), out[1]["seconds"])
    return out


class StepPrograms:
    """The step programs of one engine, by shape, and the choice of the one a step runs on.

    Args:
      packer: the engine's `StepPacker` (shapes of steps and buckets).
      note: the `aot.ProgramLog` every program is announced to.
      flat: the engine runs the ragged step.
      statics: the static options of every plain step program (cfg, attn_impl, return_hidden).
      lora: steps carry LoRA slots.
      placement: the engine's mesh placement (None: one device); programs compile ahead of
        time on one device only.
      directory: where executables are saved as they compile, and loaded from by a later
        start (`aot.compile_or_load`; None: compiled in this process only).
    """

    def __init__(self, engine_cfg, packer, note, *, flat, statics, lora, placement, directory=None):
        self.engine_cfg, self.packer, self.note = engine_cfg, packer, note
        self.directory = directory
        self.flat, self.statics, self.lora, self.placement = flat, statics, lora, placement
        # Ahead-of-time compiled programs: steps by shape, ragged steps' page copies by count.
        self.executables: dict[StepShape | FlatShape | tuple, object] = {}
        # False: programs are frozen (`freeze`): a step whose program has not compiled runs on
        # the least-work compiled one covering it, at any padding, or defers prefill rows
        # until one does; it compiles only when even that fails.
        self.compile_new_shapes = True
        self.waited: set = set()  # sequences a step deferred that no step has run since
        self._cover_memo: tuple[int, dict] = (0, {})  # (programs known, {(shape, factor): cover})
        # `compile_in_background`: {shape: Future of (executable, info)} compiling on one worker
        # thread, and the shapes whose background compile failed (they compile inline).
        self.compiling: dict[StepShape, concurrent.futures.Future] = {}
        self._compile_failed: set[StepShape] = set()
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stops the background compiler (a compile under way finishes on its thread)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None

    # ------------------------------------------------------------------------------------------
    # Ahead of time
    # ------------------------------------------------------------------------------------------
    def bucket_shape(self, bucket, num_stop_ids: int) -> StepShape | FlatShape:
        """The step shape a declared `engine.runner.aot.Bucket` runs as (see `StepPacker`)."""
        shape = self.packer.bucket_shape(  # also checks the bucket against the limits
            bucket, num_stop_ids, self.packer.max_num_batched_tokens
        )
        if self.flat:
            return self.packer.flat_shape(
                bucket.size, 1 if bucket.kind == "prefill" else bucket.size
            )
        return shape

    def ladder(self) -> list[FlatShape]:
        """The ragged step's plain programs (`StepPacker.flat_ladder`)."""
        return self.packer.flat_ladder()

    def precompile(
        self, arrays, buckets, num_stop_ids: int, directory: str | None = None
    ) -> list[dict]:
        """Compiles the step of each declared bucket now (or loads it from `directory`, where
        it is also saved; None: the engine's). `arrays`: the engine's (params, kv, LoRA
        weights). Returns [{"program", "seconds", "source"}], one per program."""
        directory = directory or self.directory
        if self.placement is not None:
            raise ValueError(
                "ahead-of-time compile buckets run on one device; on a mesh the steps "
                "compile on first use (pass compile_buckets=[])"
            )
        # Every bucket is checked against the limits; a ragged engine compiles its whole
        # ladder, which holds every program serving can meet, whatever the buckets declared.
        shapes = list(dict.fromkeys(self.bucket_shape(b, num_stop_ids) for b in buckets))
        if self.flat:
            shapes = self.ladder()
        shapes = [s for s in shapes if s not in self.executables]
        t0 = time.perf_counter()

        def one(shape):
            return aot.compile_or_load(
                packed.paged_step, "paged_step", *self.step_program(shape, arrays), directory
            )

        # XLA compiles with the GIL released: two at once take about half the wall time on a
        # host with two cores or more.
        workers = min(2, os.cpu_count() or 1, max(len(shapes), 1))
        report = []
        if shapes:
            log.info(
                "compiling %d step program%s ahead of time (%d at once), %s",
                len(shapes),
                "s" if len(shapes) > 1 else "",
                workers,
                self.note.expected(),
            )
        with concurrent.futures.ThreadPoolExecutor(workers, "jaxgen-precompile") as pool:
            for i, (shape, (run, info)) in enumerate(
                zip(shapes, pool.map(one, shapes), strict=True)
            ):
                self.executables[shape] = run
                report.append({"program": shape.describe(), **info})
                compiled = info["source"] == "compiled"
                self.note.known(("paged_step", shape), info["seconds"] if compiled else None)
                done = (i + 1) * 20 // len(shapes)
                log.info(
                    "step programs [%s%s] %d/%d, %.0f s: %s %s in %.2f s",
                    "#" * done,
                    "." * (20 - done),
                    i + 1,
                    len(shapes),
                    time.perf_counter() - t0,
                    shape.describe(),
                    info["source"],
                    info["seconds"],
                )
        if self.flat:
            report += self._precompile_copies(arrays[1], directory)
            row_keys([0], [0])  # requests' PRNG keys: one program for any number of rows
        return report

    def _precompile_copies(self, kv, directory: str | None) -> list[dict]:
        """The ragged step's copy-on-write programs (`packed.copy_pages`), one per power-of-two
        count of copies up to a step's most (one per sequence)."""
        report, count = [], 1
        while True:
            key = ("copy_pages", count)
            if key not in self.executables:
                args = (kv, np.zeros(count, np.int32), np.zeros(count, np.int32))
                self.executables[key], info = aot.compile_or_load(
                    packed.copy_pages, "copy_pages", args, {}, directory
                )
                self.note.known(key)
                report.append({"program": f"copy_pages {count}", **info})
            if count >= self.engine_cfg.max_num_seqs:
                return report
            count *= 2

    def copy_pages(self, kv, copies: list[tuple[int, int]]):
        """A ragged step's copy-on-write page copies, run before it (padding repeats the last
        copy: a scatter's order among repeated targets is unspecified). Returns the pool."""
        count = 1 << (len(copies) - 1).bit_length()
        src, dst = (np.full(count, c, np.int32) for c in copies[-1])
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        key = ("copy_pages", count)
        run = self.executables.get(key)
        if run is None:
            self.note(*key)
            run = self.executables[key] = aot.compile_or_load(
                packed.copy_pages, "copy_pages", (kv, src, dst), {}, self.directory
            )[0]
        return run(kv, src, dst)

    def step_program(self, shape, arrays, abstract: bool = False) -> tuple[tuple, dict]:
        """The arguments and static options of the plain step program of `shape` (`abstract`:
        the engine's arrays as shapes and shardings, for a compile on another thread while
        the loop donates and replaces the arrays themselves)."""
        empty = empty_flat_step if isinstance(shape, FlatShape) else empty_step
        batch, sa = empty(shape, self.statics["cfg"].vocab_size, lora=self.lora)
        params, kv, lora = arrays
        if abstract:
            (params, kv), lora = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=getattr(x, "sharding", None)
                ),
                ((params, kv), lora),
            )
        statics = dict(
            num_logprobs=shape.num_logprobs, prompt_logprobs=shape.prompt_logprobs, **self.statics
        )
        return (params, kv, batch, sa, lora), statics

    def executable(self, shape, args: tuple):
        """The program a plain step of `shape` runs (`args`: its arguments), compiled now from
        them when it has not been. Compiled ahead of time even when the step needs it now: a
        jitted call compiles a program again for each kind of token input it meets (host
        tokens, or the device array a pending decode row's token is spliced into), a second
        compile of 3-7 s on XLA:CPU that no step log would flag. An executable takes either
        and never compiles again. On a mesh: the jitted step."""
        run = self.executables.get(shape)
        if run is not None:
            return run
        options = dict(
            num_logprobs=shape.num_logprobs, prompt_logprobs=shape.prompt_logprobs, **self.statics
        )
        if self.placement is not None:
            return functools.partial(packed.paged_step, **options)
        run, _ = aot.compile_or_load(packed.paged_step, "paged_step", args, options, self.directory)
        self.executables[shape] = run
        return run

    # ------------------------------------------------------------------------------------------
    # A row-shaped step's program: its own, a covering one, or a shorter step
    # ------------------------------------------------------------------------------------------
    def choose(self, step, shape: StepShape, alive: set, arrays) -> tuple[StepShape, bool, int]:
        """The program an unconstrained row-shaped step runs on: its own, or, with covering,
        background compiles or frozen programs, a compiled one covering it (the step possibly
        shortened by deferred prefill rows). `alive`: the ids of the running sequences;
        `arrays`: the engine's (params, kv, LoRA weights). Returns (shape, covered, prefill
        rows deferred)."""
        cfg = self.engine_cfg
        background, frozen = cfg.compile_in_background, not self.compile_new_shapes
        covered, deferred = False, 0
        if cfg.cover_new_shapes or background or frozen:
            if self.compiling:
                self.collect()
            cover = self._cover(shape, math.inf if frozen else cfg.cover_new_shapes)
            own = ("paged_step", shape) in self.note.keys
            if frozen and cover is None and not own:
                shape, cover, deferred = self._defer_prefills(step, shape)
            if cover is None and background and shape not in self._compile_failed:
                cover = self._cover(shape, math.inf)  # any padding, for a while
                if cover is not None:
                    self._compile_later(shape, arrays)
            covered = cover is not None
            shape = cover or shape
        if self.waited:  # deferred sequences that run now, or ended, leave it
            ran = {r.state.id for r in step.decode + step.prefill + step.verify}
            self.waited = {i for i in self.waited if i in alive and i not in ran}
        return shape, covered, deferred

    def _compile_later(self, shape: StepShape, arrays) -> None:
        """Starts compiling `shape`'s step program on the background thread."""
        if shape in self.compiling:
            return
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxgen-compile")
        log.info(
            "compiling %s in the background (%s); its steps run on a covering program until then",
            shape.describe(),
            self.note.expected(),
        )
        args, statics = self.step_program(shape, arrays, abstract=True)
        self.compiling[shape] = self._compiler.submit(_compile_logged, shape, args, statics)

    def collect(self, wait: bool = False) -> None:
        """Puts the programs the background thread has compiled into use (`wait`: all of them,
        waiting for those still compiling)."""
        for shape, future in list(self.compiling.items()):
            if not (wait or future.done()):
                continue
            del self.compiling[shape]
            try:
                self.executables[shape], info = future.result()
            except Exception:  # noqa: BLE001 - the step compiles inline instead (logged)
                self._compile_failed.add(shape)
                continue
            self.note.known(("paged_step", shape), info["seconds"])

    def freeze(self, frozen: bool, arrays) -> int:
        """See `LLMEngine.freeze_programs`; `arrays`: the engine's (params, kv, LoRA weights)."""
        if frozen and self.flat and self.placement is None:
            self.precompile(arrays, [], 0)
        self.compile_new_shapes = not frozen
        return len(self.note.keys)

    def shapes(self) -> list[dict]:
        """The compiled plain step programs, each as the step log records a step's `shape`."""
        return [
            shape_record(key[1])
            for key in self.note.keys
            if len(key) == 2 and key[0] == "paged_step"
        ]

    def _defer_prefills(self, step, shape: StepShape) -> tuple[StepShape, StepShape | None, int]:
        """Frozen programs, a step that none compiled covers: rather than compile it inline
        (seconds, with every running request held), its last prefill rows wait for the next
        step, one at a time, until what is left has a compiled program of its own or one that
        covers it. A deferred row's sequence keeps its pages and its place (the scheduler
        gives chunks under way their rows first), and is deferred once at most: its next row
        stays (`waited` holds it until a step runs one), as do a row whose n > 1 siblings
        sample from it and the first prefill row of a step without decode rows.
        Shortens `step.prefill` in place; returns (shape, cover or None, rows deferred), the
        step unchanged (0) when no shorter step runs on a compiled program."""
        floor = 0 if step.decode or step.verify else 1
        stays = {id(r.sample_of) for r in step.samples}
        keep = len(step.prefill)
        while keep > floor:
            row = step.prefill[keep - 1]
            if id(row) in stays or row.state.id in self.waited:
                break
            keep -= 1
            trial = dataclasses.replace(step, prefill=step.prefill[:keep])
            fits = self.packer.shape_of(trial)
            cover = self._cover(fits, math.inf)
            if cover is not None or ("paged_step", fits) in self.note.keys:
                self.waited.update(r.state.id for r in step.prefill[keep:])
                deferred = len(step.prefill) - keep
                del step.prefill[keep:]
                return fits, cover, deferred
        return shape, None, 0

    def _cover(self, shape: StepShape, factor: float) -> StepShape | None:
        """A compiled plain step program that covers `shape` (`StepShape.covers`, within
        `factor` x its work: `cover_new_shapes`), the least work first; None when `shape`'s
        own program has compiled (it runs as it is) or no compiled one covers it."""
        known = self.note.keys
        if not factor or ("paged_step", shape) in known:
            return None
        # A shape's cover is looked up once per set of compiled programs (it only grows), not
        # at every step that meets the shape.
        if self._cover_memo[0] != len(known):
            self._cover_memo = (len(known), {})
        memo = self._cover_memo[1]
        if (shape, factor) not in memo:
            page = self.packer.bm.page_size
            found = [
                key[1]
                for key in known
                if len(key) == 2 and key[0] == "paged_step" and key[1].covers(shape, factor, page)
            ]
            memo[shape, factor] = min(
                found, key=lambda s: (s.work(page), s.describe()), default=None
            )
        return memo[shape, factor]
