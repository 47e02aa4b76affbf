"""LLMEngine: the continuous-batching loop. The host scheduler composes a step, this module
packs it into device arrays (shapes padded to buckets), runs one jitted `paged_step`, and hands
the sampled tokens back. `LLM` and the server drive it through `add_request` / `step`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.block_manager import BlockManager
from jaxgen.cache.paged import PagedKVCache, RaggedMetadata
from jaxgen.engine import roofline
from jaxgen.engine.config import EngineConfig
from jaxgen.engine.runner import aot, steps
from jaxgen.engine.sample.sampling import SamplingArrays
from jaxgen.engine.sched.scheduler import ScheduledStep, Scheduler
from jaxgen.engine.spec_decode.speculative import (
    ModelDrafter,
    SpecStats,
    SpeculativeConfig,
    ngram_batch,
)
from jaxgen.errors import CapacityError
from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.page_blocks import BLOCK_PAGES, blocks_needed, empty_blocks, fill_blocks
from jaxgen.sharding.rules import to_host

log = logging.getLogger("jaxgen.engine")

LOGPROB_BUCKETS = (0, 5, 20)  # top-n logprobs are computed for n padded to one of these


def logprob_bucket(n: int) -> int:
    return next(b for b in LOGPROB_BUCKETS if n <= b)


DEFAULT_CPU_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.85


def default_kv_budget(weight_bytes: int) -> int:
    """KV pool bytes when none is given: 1 GiB on the CPU; on a GPU, 85% of its memory
    minus the weights (the rest is left for activations and XLA's workspace)."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform == "gpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] * GPU_MEMORY_FRACTION) - weight_bytes
    return DEFAULT_CPU_KV_BYTES


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def _block_bucket(n: int, minimum: int = 8) -> int:
    """Page-block counts are padded to 8, 12, 16, 24, 32, 48, ... (at most a third wasted)."""
    p = _pow2(n, minimum)
    return p * 3 // 4 if n <= p * 3 // 4 and p * 3 // 4 >= minimum else p


def _decode_blocks(lens: list[int], rows: int, max_pages: int, page_size: int) -> int:
    """Page blocks for decode rows of these lengths (0: read block tables instead).

    Block tables make every one of the `rows` (padded) rows read `max_pages` pages; page blocks
    read only the blocks the rows use, padded to a bucket, at about 1.3x the cost per page on
    XLA:CPU (measured). They are used when they read at most 3/4 of the pages tables would."""
    blocks = _block_bucket(blocks_needed(lens, page_size))
    return blocks if 4 * blocks * BLOCK_PAGES <= 3 * rows * max_pages else 0


def _uses_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shape of one packed step: one compiled `paged_step` program per value."""

    num_decode: int  # Bd decode rows
    verify_rows: int  # Bv speculative-verification rows
    verify_len: int  # k + 1 tokens per verify row
    prefill_rows: int  # Bp
    prefill_len: int  # T tokens per prefill row
    max_pages: int  # page-table width
    num_rows: int  # rows sampled (decode | prefill | n > 1 siblings | padding)
    prefill_fresh: bool  # no prefill row has cached context
    num_copies: int  # copy-on-write page copies (padded)
    stop_width: int  # stop ids per row (padded)
    num_logprobs: int = 0
    penalties: bool = False
    prompt_logprobs: int = 0
    decode_blocks: int = 0  # page blocks listing the decode rows' KV (XLA path); 0: tables

    @property
    def num_tokens(self) -> int:
        return (
            self.num_decode
            + self.verify_rows * self.verify_len
            + (self.prefill_rows * self.prefill_len)
        )

    def describe(self) -> str:
        parts = []
        if self.num_decode:
            parts.append(f"decode {self.num_decode}")
        if self.verify_rows:
            parts.append(f"verify {self.verify_rows}x{self.verify_len}")
        if self.prefill_rows:
            parts.append(f"prefill {self.prefill_rows}x{self.prefill_len}")
        kv = f"{self.max_pages} pages"
        if self.decode_blocks:
            kv += f", {self.decode_blocks} decode page blocks"
        return " + ".join(parts) + f" ({kv})"


def empty_step(shape: StepShape, vocab_size: int) -> tuple[steps.StepBatch, SamplingArrays]:
    """Host arrays of one packed step of `shape`, holding padding (the packer fills rows in)."""
    n, r = shape.num_tokens, shape.num_rows
    md = RaggedMetadata(
        slot_mapping=np.full(n, -1, np.int32),
        decode_tables=np.zeros(
            (shape.num_decode, 0 if shape.decode_blocks else shape.max_pages), np.int32
        ),
        decode_seq_lens=np.zeros(shape.num_decode, np.int32),
        prefill_tables=np.zeros((shape.prefill_rows, shape.max_pages), np.int32),
        prefill_context=np.zeros(shape.prefill_rows, np.int32),
        prefill_num_new=np.zeros(shape.prefill_rows, np.int32),
        verify_tables=(
            np.zeros((shape.verify_rows, shape.max_pages), np.int32) if shape.verify_rows else None
        ),
        verify_context=np.zeros(shape.verify_rows, np.int32) if shape.verify_rows else None,
        decode_blocks=(
            empty_blocks(shape.decode_blocks, shape.num_decode) if shape.decode_blocks else None
        ),
        num_decode=shape.num_decode,
        verify_rows=shape.verify_rows,
        verify_len=shape.verify_len,
        prefill_rows=shape.prefill_rows,
        prefill_len=shape.prefill_len,
        prefill_fresh=shape.prefill_fresh,
    )
    batch = steps.StepBatch(
        tokens=np.zeros(n, np.int32),
        positions=np.zeros(n, np.int32),
        md=md,
        copy_src=np.zeros(shape.num_copies, np.int32),
        copy_dst=np.zeros(shape.num_copies, np.int32),
        logit_index=np.zeros(r + shape.verify_rows * shape.verify_len, np.int32),
        row_step=np.zeros(r, np.int32),
        block_stop=np.zeros(r, bool),
        stop_ids=np.full((r, shape.stop_width), 2**31 - 1, np.int32),
        prompt_mask=np.zeros((r, vocab_size), bool) if shape.penalties else None,
        output_counts=np.zeros((r, vocab_size), np.int32) if shape.penalties else None,
    )
    return batch, SamplingArrays.build([None] * r, np.zeros((r, 2), np.uint32))


class LLMEngine:
    """Paged KV cache + block manager + scheduler + the jitted packed step.

    Args:
      kv_cache_bytes: memory budget for the page pool; pages = budget / bytes_per_page (see
        `PagedKVCache.bytes_per_page`). `num_pages` overrides it.
      kv_quant: None, "int8" or "fp8" pages.
    """

    def __init__(
        self,
        cfg,
        params,
        engine_cfg: EngineConfig,
        *,
        dtype,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_quant: str | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 512,
        attn_impl: str | None = None,
        note_program=None,
        placement=None,
        speculative=None,
    ):
        self.cfg, self.params, self.engine_cfg = cfg, params, engine_cfg
        self.dtype = jnp.dtype(dtype)
        self.attn_impl = attn_impl
        # On the XLA path decode attention reads only the pages each row uses (page_blocks);
        # the Pallas kernels read block tables and skip pages past each row's end themselves.
        self.page_blocks = dispatch.resolve(attn_impl) == "xla"
        if num_pages is None:
            budget = kv_cache_bytes or default_kv_budget(roofline.param_bytes(params))
            num_pages = PagedKVCache.pages_for_budget(cfg, budget, page_size, self.dtype, kv_quant)
        if num_pages < 1:
            raise CapacityError(f"the KV cache budget holds no page of {page_size} tokens")
        self.placement = placement
        self.spec = None if speculative is None else SpeculativeConfig.from_dict(speculative)
        self.spec_stats = SpecStats()
        self.drafter = None
        if self.spec is not None and self.spec.method != "ngram":
            self.drafter = ModelDrafter.create(
                self.spec,
                cfg,
                params,
                engine_cfg,
                dtype=dtype,
                page_size=page_size,
                num_pages=num_pages,
                placement=placement,
            )
        self._logq = None
        self.kv = PagedKVCache.init(cfg, num_pages, page_size, self.dtype, kv_quant)
        if placement is not None:
            self.kv = placement.cache(self.kv)
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.bm,
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            token_bucket=engine_cfg.token_bucket,
        )
        self.max_pages_per_seq = self.bm.pages_needed(engine_cfg.max_model_len)
        self._note_program = note_program or (lambda *key: None)
        self.executables: dict[StepShape, object] = {}  # ahead-of-time compiled steps
        self.weight_bytes = roofline.param_bytes(params)
        self.peak_pages_used = 0
        self.num_steps = 0
        self.tokens_generated = 0
        self.busy_time = 0.0
        self.last_step: dict = {}

    # ------------------------------------------------------------------------------------------
    def bucket_shape(self, bucket, num_stop_ids: int) -> StepShape:
        """The step shape a declared `engine.runner.aot.Bucket` runs as (fresh requests, greedy or
        sampled, no logprobs or penalties), with `num_stop_ids` stop tokens per sequence."""
        ecfg, page = self.engine_cfg, self.bm.page_size
        if bucket.kind == "prefill":
            if bucket.size > self.scheduler.max_num_batched_tokens:
                raise ValueError(
                    f"compile bucket {bucket}: prompts are prefilled in chunks of at most "
                    f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens} tokens"
                )
            tokens = ecfg.token_bucket(bucket.size)
            rows, nd, bp, tp = 1, 0, 1, tokens
        else:
            ecfg.token_bucket(bucket.context)  # CapacityError beyond max_model_len
            rows = nd = ecfg.batch_bucket(bucket.size)
            bp = tp = 0
        blocks = 0
        max_pages = _pow2(-(-bucket.context // page), 8)
        if nd and self.page_blocks:
            blocks = _decode_blocks([bucket.context] * bucket.size, nd, max_pages, page)
            max_pages = 8 if blocks else max_pages  # with blocks, no row reads a block table
        return StepShape(
            num_decode=nd,
            verify_rows=0,
            verify_len=0,
            prefill_rows=bp,
            prefill_len=tp,
            max_pages=max_pages,
            num_rows=ecfg.batch_bucket(rows),
            prefill_fresh=True,
            num_copies=1,
            stop_width=_pow2(num_stop_ids, 4),
            decode_blocks=blocks,
        )

    def precompile(self, buckets, num_stop_ids: int, directory: str | None = None) -> list[dict]:
        """Compiles the step of each declared bucket now (or loads it from `directory`, where
        it is also saved). Returns [{"program", "seconds", "source"}], one per program."""
        if self.placement is not None:
            raise ValueError(
                "ahead-of-time compile buckets run on one device; on a mesh the steps "
                "compile on first use (pass compile_buckets=[])"
            )
        shapes = {self.bucket_shape(b, num_stop_ids): b for b in buckets}
        report = []
        for shape in shapes:
            if shape in self.executables:
                continue
            batch, sa = empty_step(shape, self.cfg.vocab_size)
            statics = dict(
                cfg=self.cfg,
                num_logprobs=shape.num_logprobs,
                prompt_logprobs=shape.prompt_logprobs,
                attn_impl=self.attn_impl,
            )
            self.executables[shape], info = aot.compile_or_load(
                steps.paged_step,
                "paged_step",
                (self.params, self.kv, batch, sa),
                statics,
                directory,
            )
            report.append({"program": shape.describe(), **info})
            log.info(
                "ahead of time: %s %s in %.2f s", shape.describe(), info["source"], info["seconds"]
            )
        return report

    def check_request(self, request) -> None:
        """Raises CapacityError if the request can never be served by this engine."""
        n = request.params.num_samples
        if n > self.engine_cfg.max_num_seqs:
            raise CapacityError(
                f"n/best_of={n} exceeds max_num_seqs={self.engine_cfg.max_num_seqs}"
            )
        self.scheduler.check_fits(len(request.prompt_ids), request.params.max_tokens)

    def add_request(self, request) -> None:
        """Queues a request; raises CapacityError (queueing nothing) if it can never fit."""
        self.add_requests([request])

    def add_requests(self, requests) -> None:
        """Queues requests, each checked once; if one can never fit, none is queued."""
        for r in requests:
            self.check_request(r)
        for r in requests:
            self.scheduler.add(r)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def reset_prefix_cache(self) -> int:
        return self.bm.reset_prefix_cache()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list:
        """Runs one scheduling iteration; returns [(Sequence, text delta)] for emitted tokens."""
        drafts = self._propose() if self.spec is not None else None
        step = self.scheduler.schedule(drafts)
        self.peak_pages_used = max(self.peak_pages_used, self.bm.num_used_pages)
        if step.empty:
            if self.scheduler.has_work and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with free pages")  # a bug
            return []
        t0 = time.perf_counter()
        batch, sa, shape = self._pack(step)
        self._note_program("paged_step", shape)
        with self.placement.context() if self.placement else contextlib.nullcontext():
            run = self.executables.get(shape) or functools.partial(
                steps.paged_step,
                cfg=self.cfg,
                num_logprobs=shape.num_logprobs,
                prompt_logprobs=shape.prompt_logprobs,
                attn_impl=self.attn_impl,
            )
            info, prompt_info, verified, self.kv = run(self.params, self.kv, batch, sa)
        host = to_host(info)
        if prompt_info is not None:
            self._record_prompt_logprobs(step, to_host(prompt_info), batch.md)
        elapsed = time.perf_counter() - t0
        self._account(step, elapsed)

        def row_info(r):
            seq = (step.decode + step.prefill + step.samples)[r].state.seq
            n = seq.params.logprobs or 0
            top = list(
                zip(host.top_ids[r, :n].tolist(), host.top_logprobs[r, :n].tolist(), strict=True)
            )
            return float(host.logprobs[r]), int(host.ranks[r]), top

        verified = None if verified is None else to_host(verified)
        events = list(self.scheduler.update(step, host.tokens, row_info, verified))
        if step.verify:
            self._after_verify(step, verified)
        self.tokens_generated += len(events)
        return events

    # ------------------------------------------------------------------------------------------
    # Speculative decoding
    # ------------------------------------------------------------------------------------------
    def _propose(self) -> dict:
        """Drafts for every decoding sequence (n-gram on the host, or the draft model)."""
        # Rows whose plain sampling does more than the verifier reproduces (penalties,
        # min_tokens blocking, logprob ranks) decode without drafts.
        states = [
            s
            for s in self.scheduler.decoding()
            if not _uses_penalties(s.seq.params)
            and s.seq.params.logprobs is None
            and len(s.seq.output_ids) >= s.seq.params.min_tokens
        ]
        self._logq = None
        if not states:
            return {}
        k = self.spec.num_tokens
        if self.drafter is None:
            return ngram_batch(states, k, self.spec)
        sa = SamplingArrays.build(
            [s.seq.params for s in states], np.stack([s.seq.key for s in states])
        )
        drafts, self._logq, self._logq_rows = self.drafter.propose(states, k, sa)
        return drafts

    def _after_verify(self, step, verified) -> None:
        for v, row in enumerate(step.verify):
            self.spec_stats.drafted += len(row.draft)
            self.spec_stats.accepted += int(verified[0][v])
            self.spec_stats.steps += 1
        if self.drafter is not None:
            running = {s.id: s for s in self.scheduler.running}
            for sid in list(self.drafter.bm.tables):
                if sid not in running:
                    self.drafter.release(sid)
                else:
                    self.drafter.rollback(sid, len(running[sid].tokens) - 1)

    # ------------------------------------------------------------------------------------------
    def _pack(self, step: ScheduledStep):
        """Host arrays for one step, padded to buckets (bounded number of programs).

        Packed tokens: [decode rows | verify rows x (k+1) | prefill rows x chunk]. Logit rows:
        [decode | prefill | n>1 samples | padding] then [verify rows x (k+1)]."""
        cfg, ecfg = self.cfg, self.engine_cfg
        nd = ecfg.batch_bucket(len(step.decode)) if step.decode else 0
        bv = _pow2(len(step.verify)) if step.verify else 0
        tv = self.spec.num_tokens + 1 if step.verify else 0
        if step.prefill:
            bp = _pow2(len(step.prefill))
            tp = ecfg.token_bucket(max(r.end - r.start for r in step.prefill))
        else:
            bp = tp = 0
        rows = step.decode + step.prefill + step.samples
        num_rows = ecfg.batch_bucket(max(len(rows), 1))

        def width(tabled):  # page-table width for these rows
            return _pow2(max([len(self.bm.tables[r.state.id]) for r in tabled] + [1]), 8)

        max_pages = width(rows + step.verify)
        blocks = 0
        if step.decode and self.page_blocks:
            lens = [r.end for r in step.decode]
            blocks = _decode_blocks(lens, nd, max_pages, self.bm.page_size)
            if blocks:  # the decode rows' tables are not sent: size the others' alone
                max_pages = width(step.prefill + step.samples + step.verify)
        seqs = [r.state.seq for r in rows]
        all_seqs = seqs + [r.state.seq for r in step.verify]
        wanted = [
            r.state.request.params.prompt_logprobs
            for r in step.prefill
            if self._wants_prompt_logprobs(r)
        ]
        prompt_logprobs = logprob_bucket(max(wanted)) if wanted else 0
        if wanted:
            prompt_logprobs = max(prompt_logprobs, 1)  # 1 even for prompt_logprobs=0 (the token)
        shape = StepShape(
            num_decode=nd,
            verify_rows=bv,
            verify_len=tv,
            prefill_rows=bp,
            prefill_len=tp,
            max_pages=max_pages,
            num_rows=num_rows,
            prefill_fresh=all(r.start == 0 for r in step.prefill),
            num_copies=_pow2(len(step.copies)),
            stop_width=_pow2(max(len(s.stop_ids) for s in all_seqs), 4),
            num_logprobs=logprob_bucket(max([s.params.logprobs or 0 for s in seqs] + [0])),
            penalties=any(_uses_penalties(s.params) for s in seqs),
            prompt_logprobs=prompt_logprobs,
            decode_blocks=blocks,
        )
        n = shape.num_tokens
        batch, _ = empty_step(shape, cfg.vocab_size)
        md = batch.md
        tokens, positions, slots = batch.tokens, batch.positions, md.slot_mapping

        def put(base, row, table=True):
            s = row.state
            length = row.end - row.start
            tokens[base : base + length] = (s.tokens + row.draft)[row.start : row.end]
            positions[base : base + length] = np.arange(row.start, row.end)
            slots[base : base + length] = self.bm.slots(s.id, row.start, row.end)
            if not table:
                return None, length
            table = np.zeros(max_pages, np.int32)
            table[: len(self.bm.tables[s.id])] = self.bm.tables[s.id]
            return table, length

        dec_tables, dec_lens, logit_index = md.decode_tables, md.decode_seq_lens, batch.logit_index
        for i, row in enumerate(step.decode):
            table, _ = put(i, row, table=not blocks)
            if table is not None:
                dec_tables[i] = table
            dec_lens[i] = row.end
            logit_index[i] = i
        if blocks:
            fill_blocks(
                md.decode_blocks,
                [self.bm.tables[r.state.id] for r in step.decode],
                [r.end for r in step.decode],
                self.bm.page_size,
            )
        ver_tables, ver_ctx = md.verify_tables, md.verify_context
        for v, row in enumerate(step.verify):
            base = nd + v * tv
            ver_tables[v], _ = put(base, row)
            ver_ctx[v] = row.start
            logit_index[num_rows + v * tv : num_rows + (v + 1) * tv] = base + np.arange(tv)
        pre_tables, pre_ctx, pre_new = md.prefill_tables, md.prefill_context, md.prefill_num_new
        for p, row in enumerate(step.prefill):
            base = nd + bv * tv + p * tp
            pre_tables[p], length = put(base, row)
            pre_ctx[p], pre_new[p] = row.start, length
            logit_index[len(step.decode) + p] = base + length - 1
        row_of = {id(r): i for i, r in enumerate(step.decode + step.prefill)}
        for j, row in enumerate(step.samples):
            logit_index[len(step.decode) + len(step.prefill) + j] = logit_index[
                row_of[id(row.sample_of)]
            ]
        if step.copies:
            batch.copy_src[: len(step.copies)] = [c[0] for c in step.copies]
            batch.copy_dst[: len(step.copies)] = [c[1] for c in step.copies]
        width = shape.stop_width
        row_step, block_stop, stop_ids, keys = self._row_arrays(seqs, num_rows, width)
        batch = batch.replace(row_step=row_step, block_stop=block_stop, stop_ids=stop_ids)
        if shape.penalties:
            for r, s in enumerate(seqs):
                batch.prompt_mask[r, s.prompt_ids] = True
                np.add.at(batch.output_counts[r], np.asarray(s.output_ids, np.int64), 1)
        if bv:
            if self._logq is not None:  # the draft model's q rows, in verify-row order
                index = [self._logq_rows[r.state.id] for r in step.verify]
                index += [index[0]] * (bv - len(index))
                batch = batch.replace(verify_logq=self._logq[np.asarray(index)])
            vseqs = [r.state.seq for r in step.verify]
            drafts = np.zeros((bv, tv - 1), np.int32)
            num_drafts = np.zeros(bv, np.int32)
            for v, row in enumerate(step.verify):
                drafts[v, : len(row.draft)] = row.draft
                num_drafts[v] = len(row.draft)
            vstep, _, _, vkeys = self._row_arrays(vseqs, bv, width)
            batch = batch.replace(
                verify_drafts=drafts,
                verify_num_drafts=num_drafts,
                verify_step=vstep,
                verify_sa=SamplingArrays.build(
                    [s.params for s in vseqs] + [None] * (bv - len(vseqs)), vkeys
                ),
            )
        if wanted:
            next_tokens = np.zeros(n, np.int32)
            for p, row in enumerate(step.prefill):
                toks = row.state.tokens
                base = nd + bv * tv + p * tp
                stop = min(row.end, len(toks) - 1)
                next_tokens[base : base + stop - row.start] = toks[row.start + 1 : stop + 1]
            batch = batch.replace(next_tokens=next_tokens)
        params = [s.params for s in seqs] + [None] * (num_rows - len(seqs))
        return batch, SamplingArrays.build(params, keys), shape

    @staticmethod
    def _row_arrays(seqs, num_rows, width):
        """Per-row generation index, min_tokens blocking, stop ids and PRNG keys."""
        row_step = np.zeros(num_rows, np.int32)
        block_stop = np.zeros(num_rows, bool)
        stop_ids = np.full((num_rows, width), 2**31 - 1, np.int32)
        keys = np.zeros((num_rows, 2), np.uint32)
        for r, s in enumerate(seqs):
            row_step[r] = len(s.output_ids)
            block_stop[r] = len(s.output_ids) < s.params.min_tokens
            stop_ids[r, : len(s.stop_ids)] = sorted(s.stop_ids)
            keys[r] = s.key
        return row_step, block_stop, stop_ids, keys

    @staticmethod
    def _wants_prompt_logprobs(row) -> bool:
        """Prompt logprobs are recorded once per request, from its first (unpreempted) prefill."""
        s = row.state
        return (
            s.request.params.prompt_logprobs is not None
            and s.seq.index == 0
            and not s.seq.output_ids
        )

    def _record_prompt_logprobs(self, step, info, md) -> None:
        from jaxgen.engine.outputs import Logprob

        for p, row in enumerate(step.prefill):
            if not self._wants_prompt_logprobs(row):
                continue
            request = row.state.request
            k = request.params.prompt_logprobs
            entries = request.prompt_logprobs or [None]
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

    # ------------------------------------------------------------------------------------------
    def _account(self, step: ScheduledStep, elapsed: float) -> None:
        """Per-step roofline numerators (bytes, FLOPs) for the live MBU / MFU in `stats()`."""
        self.num_steps += 1
        self.busy_time += elapsed
        rows = step.decode + step.verify + step.prefill
        context = sum(r.end for r in rows)
        pairs = sum((r.end - r.start) * (r.start + r.end + 1) // 2 for r in rows)
        cost = roofline.step_cost(
            self.cfg,
            self.weight_bytes,
            new_tokens=step.num_tokens,
            context_tokens=context,
            kv_itemsize=self.kv.k.dtype.itemsize,
            attended_pairs=pairs,
        )
        self.last_step = {
            "seconds": elapsed,
            "tokens": step.num_tokens,
            "decode_rows": len(step.decode),
            "prefill_rows": len(step.prefill),
            **cost,
        }

    def stats(self, limits: dict | None = None) -> dict:
        """Engine-wide counters, plus the last step's achieved bandwidth and FLOP rate as
        fractions of the machine's roofline (`limits`: read_gbps and peak GFLOP/s)."""
        out = self.scheduler.stats()
        if self.spec is not None:
            out["speculative"] = {
                "method": self.spec.method,
                "num_tokens": self.spec.num_tokens,
                **self.spec_stats.to_dict(),
            }
        out.update(
            steps=self.num_steps,
            tokens_generated=self.tokens_generated,
            peak_pages_used=self.peak_pages_used,
            tokens_per_s=self.tokens_generated / self.busy_time if self.busy_time else 0.0,
            kv_cache_bytes=self.kv.nbytes,
        )
        last = self.last_step
        if last:
            gbps = last["bytes"] / last["seconds"] / 1e9
            gflops = last["flops"] / last["seconds"] / 1e9
            out.update(step_gbps=gbps, step_gflops=gflops)
            if limits:
                peak = limits["bf16_gflops"] if self.dtype == jnp.bfloat16 else limits["f32_gflops"]
                out.update(mbu=gbps / limits["read_gbps"], mfu=gflops / peak)
        return out


class EngineReplicas:
    """Data-parallel replicas: independent engines (each on its own sub-mesh) sharing the
    requests; the same interface as one LLMEngine."""

    def __init__(self, engines: list[LLMEngine]):
        self.engines = engines
        self.engine_cfg = engines[0].engine_cfg
        self._owner: dict[str, LLMEngine] = {}

    def check_request(self, request) -> None:
        self.engines[0].check_request(request)

    def add_request(self, request) -> None:
        self.add_requests([request])

    def add_requests(self, requests) -> None:
        for r in requests:  # the replicas share one configuration
            self.check_request(r)
        for r in requests:  # the least-loaded replica takes each
            engine = min(
                self.engines, key=lambda e: len(e.scheduler.running) + len(e.scheduler.waiting)
            )
            engine.scheduler.add(r)
            self._owner[r.request_id] = engine

    def abort(self, request_id: str) -> bool:
        engine = self._owner.pop(request_id, None)
        return engine.abort(request_id) if engine is not None else False

    def reset_prefix_cache(self) -> int:
        return sum(e.reset_prefix_cache() for e in self.engines)

    @property
    def has_work(self) -> bool:
        return any(e.has_work for e in self.engines)

    def step(self) -> list:
        events = []
        for engine in self.engines:
            if engine.has_work:
                events.extend(engine.step())
        return events

    def stats(self, limits: dict | None = None) -> dict:
        per = [e.stats(limits) for e in self.engines]
        skip = ("prefix_hit_rate", "mbu", "mfu", "step_gbps", "step_gflops")
        total = {
            k: sum(p[k] for p in per)
            for k, v in per[0].items()
            if isinstance(v, (int, float)) and k not in skip
        }
        total["replicas"] = per
        return total
