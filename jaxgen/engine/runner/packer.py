"""The one step packer: a `ScheduledStep` (rows of decode, speculative verification and
prefill chunks) into the host arrays of one `paged_step`, every size padded to a bucket so the
number of compiled programs stays bounded. Its layout is the one `cache.paged` attends over
and `runner.packed.paged_step` reads; this is the only place that writes it.

Packed tokens: [decode rows | verify rows x (k+1) | prefill rows x chunk]. Logit rows:
[decode | prefill | n>1 samples | padding] then [verify rows x (k+1)]. With LoRA, each packed
token also carries its request's adapter slot (-1: base model, padding).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxgen.engine.runner.shapes import (
    STOP_WIDTH,
    FlatShape,
    StepShape,
    decode_block_count,
    empty_flat_step,
    empty_step,
    logprob_bucket,
    pow2,
    token_ladder,
)
from jaxgen.engine.sample.sampling import SamplingArrays, logit_bias_width, uses_penalties
from jaxgen.engine.sched.state import ScheduledStep
from jaxgen.pallas_kernels.page_blocks import fill_blocks


class StepPacker:
    """Packs the steps of one engine (its model config, bucket lists and block manager).

    Args:
      page_blocks: list decode rows' pages as page blocks where they read fewer pages than
        padded block tables (the XLA attention path).
      num_speculative_tokens: k of speculative decoding (verify rows hold k + 1 tokens).
      adapters: the engine's `engine.lora.AdapterSlots` (None: no LoRA).
      invariant: (prefill rows, chunk length, page-table width) of batch-invariant mode's two
        step shapes (None: shapes follow each step's rows).
      max_num_batched_tokens: the scheduler's token budget (the top of the ragged step's
        `token_ladder`).
    """

    def __init__(
        self,
        cfg,
        engine_cfg,
        bm,
        *,
        page_blocks: bool,
        num_speculative_tokens: int = 0,
        adapters=None,
        invariant: tuple[int, int, int] | None = None,
        max_num_batched_tokens: int = 512,
    ):
        self.cfg, self.engine_cfg, self.bm = cfg, engine_cfg, bm
        self.page_blocks = page_blocks
        self.num_speculative_tokens = num_speculative_tokens
        self.adapters = adapters
        self.invariant = invariant
        self.max_num_batched_tokens = max_num_batched_tokens
        # The ragged step's token buckets and page-table width (`flat_shape`).
        self.ladder = token_ladder(max_num_batched_tokens, engine_cfg.max_num_seqs)
        self.max_pages = bm.pages_needed(engine_cfg.max_model_len)

    def _invariant_shape(self, shape: StepShape, num_rows: int) -> StepShape:
        """Batch-invariant mode: a decode step at its one shape (max_num_seqs rows), a prefill
        step at its one shape (fixed rows x chunk, context always read from the pages), both
        with full-width page tables. A row's matmuls and attention then reduce in the same
        order whatever shares its step (only the per-row sampling options still pick among
        programs, and they do not mix rows)."""
        rows, chunk, max_pages = self.invariant
        fixed = dict(max_pages=max_pages, decode_blocks=0, prefill_fresh=False, verify_rows=0)
        if shape.prefill_rows:
            return dataclasses.replace(
                shape,
                num_decode=0,
                prefill_rows=rows,
                prefill_len=chunk,
                num_rows=pow2(max(rows, num_rows)),
                **fixed,
            )
        nd = self.engine_cfg.max_num_seqs
        return dataclasses.replace(shape, num_decode=nd, num_rows=nd, **fixed)

    def bucket_shape(self, bucket, num_stop_ids: int, max_num_batched_tokens: int) -> StepShape:
        """The step shape a declared `engine.runner.aot.Bucket` runs as (fresh requests, greedy or
        sampled, no logprobs or penalties), with `num_stop_ids` stop tokens per sequence."""
        ecfg, page = self.engine_cfg, self.bm.page_size
        if bucket.kind == "prefill":
            if bucket.size > max_num_batched_tokens:
                raise ValueError(
                    f"compile bucket {bucket}: prompts are prefilled in chunks of at most "
                    f"max_num_batched_tokens={max_num_batched_tokens} tokens"
                )
            tokens = ecfg.token_bucket(bucket.size)
            rows, nd, bp, tp = 1, 0, 1, tokens
        else:
            ecfg.token_bucket(bucket.context)  # CapacityError beyond max_model_len
            rows = nd = ecfg.batch_bucket(bucket.size)
            bp = tp = 0
        blocks = 0
        max_pages = pow2(-(-bucket.context // page), 8)
        if nd and self.page_blocks:
            blocks = decode_block_count([bucket.context] * bucket.size, nd, max_pages, page)
            max_pages = 8 if blocks else max_pages  # with blocks, no row reads a block table
        shape = StepShape(
            num_decode=nd,
            verify_rows=0,
            verify_len=0,
            prefill_rows=bp,
            prefill_len=tp,
            max_pages=max_pages,
            num_rows=ecfg.batch_bucket(rows),
            prefill_fresh=True,
            num_copies=1,
            stop_width=pow2(num_stop_ids, 4),
            decode_blocks=blocks,
        )
        return shape if self.invariant is None else self._invariant_shape(shape, rows)

    def shape_of(self, step: ScheduledStep) -> StepShape:
        """The bucketed static shape of one step."""
        ecfg = self.engine_cfg
        nd = ecfg.batch_bucket(len(step.decode)) if step.decode else 0
        bv = pow2(len(step.verify)) if step.verify else 0
        tv = self.num_speculative_tokens + 1 if step.verify else 0
        if step.prefill:
            bp = pow2(len(step.prefill))
            tp = ecfg.token_bucket(max(r.end - r.start for r in step.prefill))
        else:
            bp = tp = 0
        rows = step.decode + step.prefill + step.samples
        num_rows = ecfg.batch_bucket(max(len(rows), 1))

        def width(tabled):  # page-table width for these rows
            return pow2(max([len(self.bm.tables[r.state.id]) for r in tabled] + [1]), 8)

        max_pages = width(rows + step.verify)
        blocks = 0
        if step.decode and self.page_blocks:
            lens = [r.end for r in step.decode]
            blocks = decode_block_count(lens, nd, max_pages, self.bm.page_size)
            if blocks:  # the decode rows' tables are not sent: size the others' alone
                max_pages = width(step.prefill + step.samples + step.verify)
        seqs = [r.state.seq for r in rows]
        all_seqs = seqs + [r.state.seq for r in step.verify]
        shape = StepShape(
            num_decode=nd,
            verify_rows=bv,
            verify_len=tv,
            prefill_rows=bp,
            prefill_len=tp,
            max_pages=max_pages,
            num_rows=num_rows,
            prefill_fresh=all(r.start == 0 for r in step.prefill),
            num_copies=pow2(len(step.copies)),
            stop_width=pow2(max([len(s.stop_ids) for s in all_seqs] + [0]), 4),
            num_logprobs=logprob_bucket(max([s.params.logprobs or 0 for s in seqs] + [0])),
            penalties=any(uses_penalties(s.params) for s in seqs),
            prompt_logprobs=prompt_logprobs_of(step),
            decode_blocks=blocks,
            logit_bias=logit_bias_width([s.params for s in seqs]),
        )
        return shape if self.invariant is None else self._invariant_shape(shape, len(rows))

    def pack_microbatches(self, step: ScheduledStep, microbatches: int):
        """One step cut into microbatches of disjoint sequences for a pipelined step: decode
        rows and prefill rows dealt round-robin (n > 1 siblings stay with the row they sample
        from), each packed at one shared shape and stacked on a leading axis.

        Returns (StepBatch, SamplingArrays, StepShape, the parts as ScheduledSteps, rows):
        `rows` = (microbatch, row) of each of the step's rows in `decode + prefill + samples`
        order. Page copies all ride in the first part (they run before the layers)."""
        if step.verify:
            raise ValueError("speculative verify rows do not run in a pipelined step")
        m = max(1, min(microbatches, max(len(step.decode), len(step.prefill))))
        parts = [ScheduledStep([], [], [], []) for _ in range(m)]
        part_of = {}
        for i, row in enumerate(step.decode):
            parts[i % m].decode.append(row)
            part_of[id(row)] = i % m
        for i, row in enumerate(step.prefill):
            parts[i % m].prefill.append(row)
            part_of[id(row)] = i % m
        for row in step.samples:
            parts[part_of[id(row.sample_of)]].samples.append(row)
            part_of[id(row)] = part_of[id(row.sample_of)]
        parts[0].copies = list(step.copies)
        shapes = [self.shape_of(p) for p in parts]
        shape = dataclasses.replace(
            shapes[0],
            **{
                f: max(getattr(s, f) for s in shapes)
                for f in (
                    "num_decode",
                    "prefill_rows",
                    "prefill_len",
                    "max_pages",
                    "num_rows",
                    "num_copies",
                    "stop_width",
                    "num_logprobs",
                    "prompt_logprobs",
                    "logit_bias",
                )
            },
            prefill_fresh=all(s.prefill_fresh for s in shapes),
            penalties=any(s.penalties for s in shapes),
        )
        if shape.decode_blocks:
            raise ValueError(
                "a pipelined step reads block tables (construct with page_blocks=False)"
            )
        packed = [self.pack(p, shape=shape) for p in parts]
        batch, sa = jax.tree.map(lambda *a: np.stack(a), *[(b, s) for b, s, _ in packed])
        if step.copies:  # one scatter does every part's copies: their padding repeats one too
            batch.copy_src[1:], batch.copy_dst[1:] = step.copies[-1]
        index = {}
        for j, p in enumerate(parts):
            for r, row in enumerate(p.decode + p.prefill + p.samples):
                index[id(row)] = (j, r)
        rows = np.asarray([index[id(r)] for r in step.decode + step.prefill + step.samples])
        return batch, sa, shape, parts, rows.reshape(-1, 2)

    def _pack_decode(self, rows, batch, blocks: int) -> None:
        """Decode rows (one token each: the last one of their sequence) in one pass per array."""
        md, ps, d = batch.md, self.bm.page_size, len(rows)
        states = [r.state for r in rows]
        starts = [r.start for r in rows]
        tables = [self.bm.tables[s.id] for s in states]
        pos = np.asarray(starts, np.int32)
        batch.tokens[:d] = [s.token_at(p) for s, p in zip(states, starts, strict=True)]
        batch.positions[:d] = pos
        if batch.lora_ids is not None:
            batch.lora_ids[:d] = [self.adapters.slot(s.request.lora) for s in states]
        pages = np.asarray([t[p // ps] for t, p in zip(tables, starts, strict=True)], np.int32)
        md.slot_mapping[:d] = pages * ps + pos % ps
        md.decode_seq_lens[:d] = pos + 1
        batch.logit_index[:d] = np.arange(d)
        if blocks:
            fill_blocks(md.decode_blocks, tables, pos + 1, ps)
        else:
            for i, t in enumerate(tables):
                md.decode_tables[i, : len(t)] = t

    def pack(self, step: ScheduledStep, logq=None, logq_rows=None, shape: StepShape | None = None):
        """(StepBatch, SamplingArrays, StepShape) of one step; `logq` / `logq_rows`: the draft
        model's proposal distributions and each sequence's row in them. `shape` (default: the
        step's own) may be any shape at least as large in every field."""
        cfg = self.cfg
        if shape is None:
            shape = self.shape_of(step)
        nd, bv, tv, tp = shape.num_decode, shape.verify_rows, shape.verify_len, shape.prefill_len
        num_rows, max_pages, blocks = shape.num_rows, shape.max_pages, shape.decode_blocks
        rows = step.decode + step.prefill + step.samples
        seqs = [r.state.seq for r in rows]
        wanted = shape.prompt_logprobs > 0
        n = shape.num_tokens
        batch, _ = empty_step(shape, cfg.vocab_size, lora=self.adapters is not None)
        md = batch.md
        tokens, positions, slots = batch.tokens, batch.positions, md.slot_mapping
        lora_ids = batch.lora_ids

        def put(base, row, table=True):
            s = row.state
            length = row.end - row.start
            tokens[base : base + length] = (s.tokens + row.draft)[row.start : row.end]
            positions[base : base + length] = np.arange(row.start, row.end)
            slots[base : base + length] = self.bm.slots(s.id, row.start, row.end)
            if lora_ids is not None:
                lora_ids[base : base + length] = self.adapters.slot(s.request.lora)
            if not table:
                return None, length
            table = np.zeros(max_pages, np.int32)
            table[: len(self.bm.tables[s.id])] = self.bm.tables[s.id]
            return table, length

        logit_index = batch.logit_index
        if step.decode:
            self._pack_decode(step.decode, batch, blocks)
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
            # The padding repeats the last copy: a scatter's order among repeated targets is
            # unspecified (XLA:CPU lets a 0 -> 0 padding copy undo a real copy into page 0).
            src, dst = zip(*step.copies, strict=True)
            batch.copy_src[:], batch.copy_dst[:] = src[-1], dst[-1]
            batch.copy_src[: len(src)], batch.copy_dst[: len(dst)] = src, dst
        width = shape.stop_width
        generated = [r.state.num_generated for r in rows]
        row_step, block_stop, stop_ids, keys = row_arrays(seqs, num_rows, width, generated)
        batch = batch.replace(row_step=row_step, block_stop=block_stop, stop_ids=stop_ids)
        if shape.penalties:
            for r, s in enumerate(seqs):
                batch.prompt_mask[r, s.prompt_ids] = True
                np.add.at(batch.output_counts[r], np.asarray(s.output_ids, np.int64), 1)
        if bv:
            if logq is not None:  # the draft model's q rows, in verify-row order
                index = [logq_rows[r.state.id] for r in step.verify]
                index += [index[0]] * (bv - len(index))
                batch = batch.replace(verify_logq=logq[np.asarray(index)])
            vseqs = [r.state.seq for r in step.verify]
            drafts = np.zeros((bv, tv - 1), np.int32)
            num_drafts = np.zeros(bv, np.int32)
            for v, row in enumerate(step.verify):
                drafts[v, : len(row.draft)] = row.draft
                num_drafts[v] = len(row.draft)
            vstep, _, _, vkeys = row_arrays(vseqs, bv, width)
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
        return batch, SamplingArrays.build(params, keys, shape.logit_bias), shape

    # -- the ragged step -------------------------------------------------------------------
    def flat_shape(self, num_tokens: int, num_rows: int = 0) -> FlatShape:
        """The plain ragged program (top logprobs, logit bias and penalties at their maxima, no
        prompt logprobs) of the smallest ladder bucket that holds `num_tokens` tokens and
        `num_rows` sampled rows."""
        ladder, max_seqs = self.ladder, self.engine_cfg.max_num_seqs
        for t in ladder:
            if t >= num_tokens and min(t, max_seqs) >= num_rows:
                break
        else:  # past the budget (a bug in the scheduler, or rows > max_num_seqs): still run
            t = pow2(max(num_tokens, num_rows))
        return FlatShape(t, max(min(t, max_seqs), num_rows), self.max_pages, max_seqs)

    def flat_shape_of(self, step: ScheduledStep) -> FlatShape:
        """The ragged program one step runs on: its token bucket, and the sampling variant its
        rows ask for (prompt logprobs, more stop ids under min_tokens than `STOP_WIDTH`). Top
        logprobs, logit bias and penalties are no variant: every ragged program carries them
        at their maxima."""
        rows = step.decode + step.prefill + step.samples
        blocking = [
            len(r.state.seq.stop_ids)
            for r in rows
            if r.state.num_generated < r.state.seq.params.min_tokens
        ]
        if self.invariant is None:
            shape = self.flat_shape(step.num_tokens, len(rows))
        else:
            shape = self._invariant_flat(bool(step.prefill), len(rows))
        return dataclasses.replace(
            shape,
            stop_width=max(STOP_WIDTH, pow2(max(blocking, default=0))),
            prompt_logprobs=prompt_logprobs_of(step),
        )

    def _invariant_flat(self, prefill: bool, num_rows: int = 0) -> FlatShape:
        """Batch-invariant mode's two ragged programs: every decode step at max_num_seqs
        tokens and rows, every prefill step at (prefill rows x chunk) tokens and prefill rows
        (more only for n > 1 siblings), the attention in its invariant order. The rows' count
        bounds the attention's query tiles: a prefill step's trips cost its rows, not its
        token bucket."""
        max_seqs = self.engine_cfg.max_num_seqs
        prefill_rows, chunk, _ = self.invariant
        tokens, rows = (prefill_rows * chunk, prefill_rows) if prefill else (max_seqs, max_seqs)
        rows = rows if num_rows <= rows else pow2(num_rows)
        return dataclasses.replace(self.flat_shape(tokens), num_rows=rows, invariant=True)

    def flat_ladder(self) -> list[FlatShape]:
        """The ragged step's plain programs: one per token bucket, or batch-invariant mode's
        two (`_invariant_flat`)."""
        if self.invariant is None:
            return list(dict.fromkeys(self.flat_shape(t) for t in self.ladder))
        return [self._invariant_flat(False), self._invariant_flat(True)]

    def pack_flat(self, step: ScheduledStep, shape: FlatShape):
        """(StepBatch, SamplingArrays) of one ragged step: each decode row, then each prefill
        chunk, as one sequence of the flat token axis (`cache.FlatMetadata`); sampled rows in
        `decode + prefill + samples` order."""
        if step.verify:
            raise ValueError("a ragged step verifies no drafts: pack it with `pack`")
        batch, _ = empty_flat_step(shape, self.cfg.vocab_size, lora=self.adapters is not None)
        md, ps = batch.md, self.bm.page_size
        seq_rows = step.decode + step.prefill
        lens = np.asarray([r.end - r.start for r in seq_rows], np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        n, total = len(seq_rows), int(cu[-1])
        md.cu_q_lens[: n + 1] = cu
        md.cu_q_lens[n + 1 :] = total
        md.num_seqs[0] = n
        for i, row in enumerate(seq_rows):
            s, lo, hi = row.state, int(cu[i]), int(cu[i + 1])
            table = self.bm.tables[s.id]
            md.page_tables[i, : len(table)] = table
            md.seq_lens[i] = row.end
            if hi - lo == 1:
                batch.tokens[lo] = s.token_at(row.start)
                md.slot_mapping[lo] = table[row.start // ps] * ps + row.start % ps
            else:
                batch.tokens[lo:hi] = s.tokens[row.start : row.end]
                md.slot_mapping[lo:hi] = self.bm.slots(s.id, row.start, row.end)
            batch.positions[lo:hi] = np.arange(row.start, row.end)
            if batch.lora_ids is not None:
                batch.lora_ids[lo:hi] = self.adapters.slot(s.request.lora)
        batch.logit_index[:n] = cu[1 : n + 1] - 1
        row_of = {id(r): i for i, r in enumerate(seq_rows)}
        for j, row in enumerate(step.samples):
            batch.logit_index[n + j] = batch.logit_index[row_of[id(row.sample_of)]]
        rows = seq_rows + step.samples
        seqs = [r.state.seq for r in rows]
        generated = [r.state.num_generated for r in rows]
        row_step, block_stop, stop_ids, keys = row_arrays(
            seqs, shape.num_rows, shape.stop_width, generated
        )
        stop_ids[~block_stop] = 2**31 - 1  # only rows under min_tokens block their stop ids
        batch = batch.replace(
            row_step=row_step,
            block_stop=block_stop,
            stop_ids=stop_ids,
            want_top=np.asarray(any(s.params.logprobs for s in seqs)),
        )
        if any(uses_penalties(s.params) for s in seqs):
            for r, s in enumerate(seqs):
                batch.prompt_mask[r, s.prompt_ids] = True
                np.add.at(batch.output_counts[r], np.asarray(s.output_ids, np.int64), 1)
        else:  # zeros: the model runner passes arrays it keeps on the device
            batch = batch.replace(prompt_mask=None, output_counts=None)
        if shape.prompt_logprobs:
            for p, row in enumerate(step.prefill):
                toks, base = row.state.tokens, int(cu[len(step.decode) + p])
                stop = min(row.end, len(toks) - 1)
                batch.next_tokens[base : base + stop - row.start] = toks[row.start + 1 : stop + 1]
        params = [s.params for s in seqs] + [None] * (shape.num_rows - len(seqs))
        # No bitmask: the model runner passes an all-allowed one it keeps on the device.
        return batch, SamplingArrays.build(params, keys, shape.logit_bias)


def row_arrays(seqs, num_rows, width, generated=None):
    """Per-row generation index, min_tokens blocking, stop ids and PRNG keys. `generated`:
    each row's output tokens so far, pending ones included (default: its `output_ids`)."""
    row_step = np.zeros(num_rows, np.int32)
    block_stop = np.zeros(num_rows, bool)
    stop_ids = np.full((num_rows, width), 2**31 - 1, np.int32)
    keys = np.zeros((num_rows, 2), np.uint32)
    n = len(seqs)
    if not n:
        return row_step, block_stop, stop_ids, keys
    if generated is None:
        generated = [len(s.output_ids) for s in seqs]
    row_step[:n] = generated
    block_stop[:n] = row_step[:n] < np.asarray([s.params.min_tokens for s in seqs])
    keys[:n] = [s.key for s in seqs]
    rows_of: dict[frozenset, list[int]] = {}  # rows sharing a stop set are written at once
    for r, s in enumerate(seqs):
        if s.stop_ids:
            rows_of.setdefault(s.stop_ids, []).append(r)
    for ids, rows in rows_of.items():
        stop_ids[rows, : len(ids)] = sorted(ids)
    return row_step, block_stop, stop_ids, keys


def prompt_logprobs_of(step: ScheduledStep) -> int:
    """The top-n prompt logprobs a step computes (bucketed; 1 even for prompt_logprobs=0: the
    token's own), 0 where no prefill row records its request's."""
    wanted = [
        r.state.request.params.prompt_logprobs
        for r in step.prefill
        if r.state.needs_prompt_logprobs
    ]
    return max(logprob_bucket(max(wanted)), 1) if wanted else 0
