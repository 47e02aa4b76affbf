"""The model runner: a scheduled step packed into its program's arrays, dispatched, and its
results read back (vLLM's model runner beside the engine core). Device state flows through it
as arguments, cache in and new cache out: the weights, the KV page pool (donated to each
step) and the LoRA stack stay the engine's."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxgen.cache.paged import FlatMetadata
from jaxgen.engine.metrics import HostProfile
from jaxgen.engine.runner import packed
from jaxgen.engine.runner.packer import StepPacker
from jaxgen.engine.runner.programs import StepPrograms
from jaxgen.engine.runner.shapes import FlatShape, StepShape, token_spans
from jaxgen.engine.sample.structured import BitmaskFiller, bitmask_width
from jaxgen.engine.sched.state import ScheduledStep
from jaxgen.pallas_kernels import dispatch
from jaxgen.sharding.rules import to_host


@dataclasses.dataclass
class Flight:
    """A dispatched step whose results are still on the device."""

    step: ScheduledStep
    md: object  # the step's host RaggedMetadata (prompt logprob rows)
    info: object  # TokenInfo, rows ordered decode + prefill + samples
    prompt_info: object
    verified: object
    dispatched: float
    parts: list | None = None  # a pipelined step's microbatches
    rows: np.ndarray | None = None  # (microbatch, row) of each row of a pipelined step
    compiled: bool = False  # its program was compiled when it was dispatched
    covered: bool = False  # it ran on a larger program compiled before (`cover_new_shapes`)
    compiling: int = 0  # programs compiling in the background as it was dispatched
    deferred: int = 0  # prefill rows scheduled with it that wait for the next step (frozen)
    shape: StepShape | FlatShape | None = None  # the static shape it ran at (padded sizes)
    mark: tuple | None = None  # the engine's `HostClock` as it was dispatched (a step log listens)
    host: dict | None = None  # `HostClock.since` over the step's wall time, once landed


class Microbatches(int):
    """The microbatch count of a pipelined step's program key."""

    def describe(self) -> str:
        return f"in {int(self)} microbatches"


def step_path(cfg, config, pipeline) -> tuple[bool, bool]:
    """(flat, page_blocks): whether the engine runs the ragged step, and whether row-shaped
    decode rows read page blocks rather than block tables.

    The ragged step (`FlatShape`) is one program per token bucket (batch-invariant mode: two).
    Pipelined meshes, MLA models, speculative decoding and batch-invariant mode on the
    attention kernels (which have no invariant order) still run `StepShape` steps; so does
    asking for covering or background compiles (`cover_new_shapes`, `compile_in_background`),
    which dodge that step's shapes. On the XLA path row-shaped decode attention reads only the
    pages each row uses (page_blocks); the Pallas kernels read block tables and skip pages past
    each row's end themselves, and the microbatches of a pipelined step share one shape, so they
    read block tables too. MLA models keep one latent entry per token (`cache.PagedMLACache`),
    read through block tables; batch-invariant mode reads the whole table."""
    xla = dispatch.resolve(config.load.attn_impl) == "xla"
    mla, invariant = cfg.mla is not None, config.scheduler.batch_invariant
    comp = config.compile
    dodges = comp.cover_new_shapes or comp.compile_in_background
    flat = comp.ragged_step and not (
        mla or (invariant and not xla) or dodges or pipeline or config.speculative
    )
    page_blocks = xla and pipeline is None and not mla and not invariant
    return flat, page_blocks


class ModelRunner:
    """Packs steps (its `StepPacker`) and dispatches them on its `StepPrograms`.

    Args:
      cfg, config, engine_cfg: the model's config, the engine's options and step limits.
      bm: the engine's block manager (page tables); note: the `aot.ProgramLog`.
      placement: its mesh placement (None: one device; its pipeline, if any, runs the steps).
      drafter: the speculative drafter (an MTP drafter takes the step's hidden states).
      adapters: the LoRA `AdapterSlots` (None: no LoRA).
      executable_dir: the executable cache (`StepPrograms`; None: none).
    """

    def __init__(
        self,
        cfg,
        config,
        engine_cfg,
        bm,
        note,
        *,
        placement,
        drafter,
        adapters,
        executable_dir: str | None = None,
    ):
        self.cfg, self.note, self.placement = cfg, note, placement
        self.pipeline = None if placement is None else placement.pipeline
        self.flat, page_blocks = step_path(cfg, config, self.pipeline)
        self._zeros: dict[int, dict] = {}  # `_defaults`
        self.attn_impl, self.drafter = config.load.attn_impl, drafter
        self.profile = HostProfile()
        budget = config.scheduler.max_num_batched_tokens
        invariant = None
        if engine_cfg.batch_invariant:  # (prefill rows, chunk, table width) of its two shapes
            chunk = engine_cfg.invariant_chunk
            invariant = (budget // chunk, chunk, bm.pages_needed(engine_cfg.max_model_len))
        spec = config.speculative
        self.packer = StepPacker(
            cfg,
            engine_cfg,
            bm,
            max_num_batched_tokens=budget,
            page_blocks=page_blocks,
            num_speculative_tokens=0 if spec is None else spec.num_tokens,
            adapters=adapters,
            invariant=invariant,
        )
        statics = dict(
            cfg=cfg,
            attn_impl=self.attn_impl,
            return_hidden=drafter is not None and drafter.handoff,
        )
        self.programs = StepPrograms(
            engine_cfg,
            self.packer,
            note,
            flat=self.flat,
            statics=statics,
            lora=adapters is not None,
            placement=placement,
            directory=executable_dir,
        )
        self.bitmasks = BitmaskFiller(cfg.vocab_size)
        self.last_inputs = None  # (shape, StepBatch, SamplingArrays) of the last 1-device step
        self._landing_seconds = 0.0  # a step's landing of the one before it

    def launch(
        self,
        step: ScheduledStep,
        prev: Flight | None,
        arrays: tuple,
        land_prev: Callable[[], list],
        alive: set,
        proposals=(None, None),
    ) -> tuple[Flight, object, list | None]:
        """Packs and dispatches one step (the device runs it asynchronously).

        Args:
          prev: the step still in flight, whose sampled tokens this one's pending decode rows
            read.
          arrays: (params, kv, LoRA weights); the pool is donated.
          land_prev: marks `step` launched and lands `prev`, returning its events; called when
            the step needs `prev`'s tokens on the host first (structured outputs) or a program
            compiles first.
          alive: the ids of the running sequences; proposals: the draft model's (logq, rows).
        Returns:
          (the flight, the pool, `prev`'s events or None when `land_prev` was not called).
        """
        params, kv, lora = arrays
        t_pack = time.perf_counter()
        landed = None
        covered, deferred = False, 0
        if self.pipeline is not None:
            batch, sa, shape, parts, rows = self.packer.pack_microbatches(
                step, self.pipeline.microbatches
            )
            new = self.note("pipelined_paged_step", shape, Microbatches(len(parts)))
            t0 = time.perf_counter()
            info, prompt_info, _, kv = packed.pipelined_paged_step(
                params,
                kv,
                batch,
                sa,
                cfg=self.cfg,
                attn_impl=self.attn_impl,
                pipeline=self.pipeline,
                num_logprobs=shape.num_logprobs,
                prompt_logprobs=shape.prompt_logprobs,
            )
            flight = Flight(step, batch.md, info, prompt_info, None, t0, parts, rows)
        else:
            rows = step.decode + step.prefill + step.samples + step.verify
            masked = any(r.state.seq.grammar is not None for r in rows)
            if self.flat:  # every ragged program compiled at start-up: nothing to choose
                shape = self.packer.flat_shape_of(step)
                batch, sa = self.packer.pack_flat(step, shape)
                defaults = self._defaults(shape.num_rows)
                if batch.prompt_mask is None:  # no row penalized: zeros kept on the device
                    batch = batch.replace(**defaults["penalties"])
                sa = sa.replace(**defaults["unconstrained"])  # a constrained step fills its own
                if step.copies:
                    kv = self.programs.copy_pages(kv, step.copies)
            else:
                shape = self.packer.shape_of(step)
                if not masked:
                    shape, covered, deferred = self.programs.choose(step, shape, alive, arrays)
                batch, sa, shape = self.packer.pack(step, *proposals, shape=shape)
            self.last_inputs = (shape, batch, sa)
            batch = self._splice(step, batch, prev)
            hidden = None  # the MTP drafter's hand-over (none from a constrained step)
            if masked and not self.flat:
                new = self.note("paged_step", shape, "with a token bitmask")
                t0 = time.perf_counter()
                info, prompt_info, verified, kv, landed = self._run_masked(
                    step, batch, sa, shape, (params, kv, lora), land_prev
                )
            else:
                new = self.note("paged_step", shape)
                t0 = time.perf_counter()
                if masked:  # a ragged step's program takes the bitmask: filled before dispatch
                    landed = self._land_timed(land_prev)
                    sa = self._constrain(step, sa, shape)
                elif new and prev is not None:
                    # The compile (or load) holds the host for 0.1-5 s here: the step in
                    # flight lands first, so its tokens are not held back behind it (and the
                    # step log charges the compile to this step, which needs it).
                    landed = self._land_timed(land_prev)
                args = (params, kv, batch, sa, lora)
                run = self.programs.executable(shape, args)
                info, prompt_info, verified, kv, *hidden = run(*args)
                hidden = hidden[0] if hidden else None
            if self.drafter is not None and self.drafter.handoff:
                self.drafter.hand_over(hidden, token_spans(step, shape))
            flight = Flight(step, batch.md, info, prompt_info, verified, t0)
        flight.compiled, flight.shape = bool(new), shape
        flight.covered, flight.deferred = covered, deferred
        flight.compiling = len(self.programs.compiling)
        t1 = time.perf_counter()
        self.profile.add("pack", t0 - t_pack)
        # A step that landed `prev` in between: the landing counted its wait and update.
        self.profile.add("dispatch", t1 - t0 - self._landing_seconds)
        self._landing_seconds = 0.0
        if new:
            self.note.compiled(t1 - t0)
        return flight, kv, landed

    def _defaults(self, rows: int) -> dict:
        """A ragged step's arrays where no row asks for penalties or a constraint: zero penalty
        arrays and an all-allowed bitmask, put on the device once per row count (a step does
        not copy [R, V] arrays to it for nothing)."""
        found = self._zeros.get(rows)
        if found is None:
            vocab = self.cfg.vocab_size
            penalties = dict(
                prompt_mask=np.zeros((rows, vocab), bool),
                output_counts=np.zeros((rows, vocab), np.int32),
            )
            found = dict(
                penalties=penalties,
                unconstrained=dict(
                    allowed=np.full((rows, bitmask_width(vocab)), -1, np.int32),
                    constrained=np.asarray(False),
                ),
            )
            if self.placement is None:
                found = jax.device_put(found)
            self._zeros[rows] = found
        return found

    def _land_timed(self, land_prev) -> list:
        t0 = time.perf_counter()
        landed = land_prev()
        self._landing_seconds = time.perf_counter() - t0
        return landed

    def _run_masked(self, step, batch, sa, shape: StepShape, arrays, land_prev):
        """A row-shaped step under structured outputs. Its masks need every row's newest token
        on the host, so the forward pass is dispatched first; while the device runs it, the
        host lands the step in flight (its tokens advance the grammars) and fills the step's
        token bitmask (llguidance); sampling is dispatched last, with the mask. Returns
        (info, prompt_info, verified, kv, the landed step's events)."""
        params, kv, lora = arrays
        logits, kv = packed.paged_logits(
            params,
            kv,
            batch,
            lora,
            cfg=self.cfg,
            prompt_logprobs=shape.prompt_logprobs,
            attn_impl=self.attn_impl,
        )
        landed = self._land_timed(land_prev)
        sa = sa.replace(allowed=self.bitmasks.fill(_grammar_rows(step), shape.num_rows))
        if any(r.state.seq.grammar is not None for r in step.verify):
            # Position j of a verify row: the grammar advanced by the row's first j drafts.
            kp1 = shape.verify_len
            drafted = [
                (v * kp1, r.state.seq.output_ids, r.state.seq.grammar, r.draft)
                for v, r in enumerate(step.verify)
                if r.state.seq.grammar is not None
            ]
            vmask = self.bitmasks.fill(drafted, shape.verify_rows * kp1)
            batch = batch.replace(verify_allowed=vmask.reshape(shape.verify_rows, kp1, -1))
        outputs = packed.packed_outputs(
            logits,
            batch,
            sa,
            num_logprobs=shape.num_logprobs,
            prompt_logprobs=shape.prompt_logprobs,
        )
        return (*outputs, kv, landed)

    def _constrain(self, step: ScheduledStep, sa, shape: FlatShape):
        """A ragged step under structured outputs, the step before it landed (its tokens
        advanced the grammars; this step still reads them on the device): the step's token
        bitmask, for its program."""
        allowed = self.bitmasks.fill(_grammar_rows(step), shape.num_rows)
        return sa.replace(allowed=allowed, constrained=np.asarray(True))

    @staticmethod
    def _splice(step: ScheduledStep, batch, prev: Flight | None):
        """Decode rows whose input token is still pending read it from `prev`'s device output."""
        pending = [(i, r.state.pending_row) for i, r in enumerate(step.decode) if r.state.pending]
        if not pending:
            return batch
        if prev is None:
            raise AssertionError("a pending token without a step in flight")  # a bug
        index, rows = zip(*pending, strict=True)
        if batch.splice_source is not None:  # a ragged step splices inside its program
            if prev.info.padded is None:
                raise AssertionError("a ragged step after a step without padded tokens")  # a bug
            batch.splice_source[list(index)] = rows
            return batch.replace(prev_tokens=prev.info.padded)
        source = np.full(batch.tokens.shape, -1, np.int32)
        source[list(index)] = rows
        return batch.replace(tokens=packed.splice_tokens(batch.tokens, source, prev.info.tokens))

    @staticmethod
    def read(flight: Flight) -> tuple:
        """A dispatched step's results on the host (waiting for the device): (TokenInfo of its
        sampled rows, verification or None, prompt logprobs' TokenInfo or None)."""
        host = to_host(flight.info)
        if flight.rows is not None:
            rows = flight.rows
            host = jax.tree.map(lambda a: a[rows[:, 0], rows[:, 1]], host)
        verified = None if flight.verified is None else to_host(flight.verified)
        prompt = None if flight.prompt_info is None else to_host(flight.prompt_info)
        return host, verified, prompt


def _grammar_rows(step: ScheduledStep) -> list[tuple]:
    """`BitmaskFiller.fill`'s rows for a step's constrained sampled rows (a row whose sequence
    the step before finished is dropped, and left unconstrained)."""
    rows = step.decode + step.prefill + step.samples
    return [
        (i, r.state.seq.output_ids, r.state.seq.grammar)
        for i, r in enumerate(rows)
        if r.state.seq.grammar is not None and not r.state.seq.finished
    ]


def record_prompt_logprobs(step: ScheduledStep, info, md) -> None:
    """Appends each prefill chunk's prompt logprobs (`info`: the step's per-token TokenInfo on
    the host) to its request, for requests that ask for them."""
    from jaxgen.engine.outputs import Logprob

    for p, row in enumerate(step.prefill):
        if not row.state.needs_prompt_logprobs:
            continue
        request = row.state.request
        k = request.params.prompt_logprobs
        entries = request.prompt_logprobs or [None]
        if isinstance(md, FlatMetadata):
            base = int(md.cu_q_lens[len(step.decode) + p])
        else:
            base = md.num_decode + md.verify_rows * md.verify_len + p * md.prefill_len
        prompt_len = len(row.state.seq.prompt_ids)
        for i in range(row.start, min(row.end, prompt_len - 1)):
            j = base + i - row.start
            entry = {
                int(t): Logprob(float(lp), r + 1)
                for r, (t, lp) in enumerate(
                    zip(info.top_ids[j, :k], info.top_logprobs[j, :k], strict=True)
                )
            }
            entry[int(info.tokens[j])] = Logprob(float(info.logprobs[j]), int(info.ranks[j]))
            entries.append(entry)
        request.prompt_logprobs = entries
