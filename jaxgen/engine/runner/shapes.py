"""The static shapes of a step: one compiled `paged_step` program per value.

`StepShape` is the step shaped by its rows (decode rows, speculative verify rows, prefill rows
of one chunk length, each count and length padded to a bucket): pipelined meshes, MLA models,
speculative decoding and batch-invariant mode on the attention kernels step this way.
`FlatShape` is the ragged step: every scheduled token on one flat axis padded to a bucket of
`token_ladder`, the rows' kinds and lengths as arrays. `empty_step` / `empty_flat_step` give a
shape's host arrays holding padding, which `packer.StepPacker` fills.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxgen.cache.paged import FlatMetadata, RaggedMetadata
from jaxgen.engine.params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxgen.engine.runner import packed
from jaxgen.engine.sample.sampling import SamplingArrays
from jaxgen.engine.sample.structured import bitmask_width
from jaxgen.engine.sched.state import ScheduledStep
from jaxgen.pallas_kernels.flash_attention import reference_pairs
from jaxgen.pallas_kernels.page_blocks import BLOCK_PAGES, blocks_needed, empty_blocks

LOGPROB_BUCKETS = (0, 5, 20)  # top-n logprobs are computed for n padded to one of these


def logprob_bucket(n: int) -> int:
    return next(b for b in LOGPROB_BUCKETS if n <= b)


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def block_bucket(n: int, minimum: int = 8) -> int:
    """Page-block counts are padded to 8, 12, 16, 24, 32, 48, ... (at most a third wasted)."""
    p = pow2(n, minimum)
    return p * 3 // 4 if n <= p * 3 // 4 and p * 3 // 4 >= minimum else p


def decode_block_count(lens: list[int], rows: int, max_pages: int, page_size: int) -> int:
    """Page blocks for decode rows of these lengths (0: read block tables instead).

    Block tables make every one of the `rows` (padded) rows read `max_pages` pages; page blocks
    read only the blocks the rows use, padded to a bucket, at about 1.3x the cost per page on
    XLA:CPU (measured). They are used when they read at most 3/4 of the pages tables would."""
    blocks = block_bucket(blocks_needed(lens, page_size))
    return blocks if 4 * blocks * BLOCK_PAGES <= 3 * rows * max_pages else 0


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
    logit_bias: int = 0  # logit-bias pairs per row (0: no row has a logit_bias)

    @property
    def num_tokens(self) -> int:
        return (
            self.num_decode
            + self.verify_rows * self.verify_len
            + (self.prefill_rows * self.prefill_len)
        )

    def work(self, page_size: int) -> tuple[int, int]:
        """(tokens computed, KV token pairs attended) of a step at this shape, padding
        included: what a program costs to run (`covers`)."""
        pages = self.decode_blocks * BLOCK_PAGES if self.decode_blocks else self.max_pages
        if self.prefill_fresh:  # causal over its own tokens, in query blocks
            row = reference_pairs(self.prefill_len, self.prefill_len, True)
        else:  # the table's pages, then the chunk's own tokens (`paged_prefill`)
            row = reference_pairs(
                self.prefill_len, self.max_pages * page_size + self.prefill_len, False
            )
        pairs = (
            self.num_decode * pages * page_size
            + self.verify_rows * self.verify_len * self.max_pages * page_size
            + self.prefill_rows * row
        )
        return self.num_tokens, pairs

    def covers(self, other: StepShape, factor: float, page_size: int) -> bool:
        """Whether a step of shape `other` can run at this shape (`StepPacker.pack(...,
        shape=self)`: more rows, longer rows, wider tables, more page blocks, all padding) at
        most `factor` times its own work in tokens and in attended KV. The sampling options
        must match; prefill rows with cached context need a program that reads it; decode rows
        read page blocks where they would at their own shape, and rows that would read tables
        read them, or page blocks on a program with enough for their tables' width
        (`max_pages` pages each: a block-reading step does not say how wide its rows' tables
        would be, so it never runs on a table-reading program)."""
        same = ("verify_rows", "verify_len", "num_logprobs", "penalties", "prompt_logprobs",
                "logit_bias")  # fmt: skip
        larger = ("num_decode", "prefill_rows", "prefill_len", "max_pages", "num_rows",
                  "num_copies", "stop_width", "decode_blocks")  # fmt: skip
        if any(getattr(self, f) != getattr(other, f) for f in same):
            return False
        if any(getattr(self, f) < getattr(other, f) for f in larger):
            return False
        if self.prefill_fresh and not other.prefill_fresh:
            return False
        if other.num_decode and (self.decode_blocks == 0) != (other.decode_blocks == 0):
            widest = -(-other.max_pages // BLOCK_PAGES)  # blocks a table-reading row may need
            if not self.decode_blocks or self.decode_blocks < other.num_decode * widest:
                return False
        mine, theirs = self.work(page_size), other.work(page_size)
        return all(m <= factor * max(t, 1) for m, t in zip(mine, theirs, strict=True))

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


def empty_step(
    shape: StepShape, vocab_size: int, lora: bool = False
) -> tuple[packed.StepBatch, SamplingArrays]:
    """Host arrays of one packed step of `shape`, holding padding (the packer fills rows in);
    `lora`: with each token's adapter slot (all -1 here)."""
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
    batch = packed.StepBatch(
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
        lora_ids=np.full(n, -1, np.int32) if lora else None,
    )
    return batch, SamplingArrays.build([None] * r, np.zeros((r, 2), np.uint32), shape.logit_bias)


def token_spans(step: ScheduledStep, shape: StepShape) -> dict:
    """Where `StepPacker.pack` put each sequence's tokens of a step packed at `shape`:
    {seq id: (first packed index, first position, number of tokens)} for its decode, verify and
    prefill rows (a step's per-token outputs, e.g. hidden states, are read back with it)."""
    nd, tv, tp = shape.num_decode, shape.verify_len, shape.prefill_len
    spans = {r.state.id: (i, r.start, r.end - r.start) for i, r in enumerate(step.decode)}
    for v, r in enumerate(step.verify):
        spans[r.state.id] = (nd + v * tv, r.start, r.end - r.start)
    for p, r in enumerate(step.prefill):
        spans[r.state.id] = (nd + shape.verify_rows * tv + p * tp, r.start, r.end - r.start)
    return spans


# ----------------------------------------------------------------------------------------------
# The ragged step: one flat token axis
# ----------------------------------------------------------------------------------------------
STOP_WIDTH = 16  # stop ids per row a ragged step carries (rows under min_tokens block them)


def token_ladder(max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, ...]:
    """The token buckets of the ragged step: 1, 2, 4, ... up to the step's token budget (or
    `max_num_seqs`, the most decode rows one step holds), the last one the budget itself.
    Small buckets keep a decode step of few rows at its own cost: on XLA:CPU one decode token
    padded to 8 costs 1.6x, to 16 2.2x (measured on the default model)."""
    top = max(max_num_batched_tokens, max_num_seqs)
    ladder = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return (*ladder, top)


@dataclasses.dataclass(frozen=True)
class FlatShape:
    """The static shape of one ragged step (`cache.FlatMetadata`): T tokens on one axis, R rows
    that sample (each a sequence with 1..T of the tokens, or an n > 1 sibling sampling beside
    one), page tables W pages wide. One compiled program per token bucket and sampling variant:
    the rows' kinds (decode, prefill chunks fresh or after cached context) and lengths, their
    tables' widths and the page copies are arrays, not shapes."""

    num_tokens: int  # T, a `token_ladder` bucket
    num_rows: int  # R = min(T, max_num_seqs) (more only for n > 1 siblings of few tokens)
    max_pages: int  # W: pages of a max_model_len sequence
    max_seqs: int  # max_num_seqs: the width of `TokenInfo.padded`
    stop_width: int = STOP_WIDTH
    # Every ragged program returns the top MAX_LOGPROBS logprobs of each row (computed only in
    # a step where some row asks: `StepBatch.want_top`), takes MAX_LOGIT_BIAS bias pairs and
    # the penalties' [R, V] prompt mask and output counts (applied only where a row asks).
    num_logprobs: int = MAX_LOGPROBS
    penalties: bool = True
    prompt_logprobs: int = 0
    logit_bias: int = MAX_LOGIT_BIAS
    verify_rows: int = 0  # a ragged step verifies no drafts (speculative engines: `StepShape`)
    invariant: bool = False  # batch-invariant attention order (`FlatMetadata.invariant`)

    def describe(self) -> str:
        extra = [
            f"prompt logprobs {self.prompt_logprobs}" if self.prompt_logprobs else "",
            f"{self.stop_width} stop ids" if self.stop_width != STOP_WIDTH else "",
            "batch-invariant" if self.invariant else "",
        ]
        extra = ", ".join(e for e in extra if e)
        return f"ragged {self.num_tokens} tokens x {self.num_rows} rows" + (
            f" ({extra})" if extra else ""
        )


def empty_flat_step(
    shape: FlatShape, vocab_size: int, lora: bool = False
) -> tuple[packed.StepBatch, SamplingArrays]:
    """Host arrays of one ragged step of `shape`, holding padding (`StepPacker.pack_flat` fills
    the sequences in). Page copies run before the step (`packed.copy_pages`), not in it."""
    t, r = shape.num_tokens, shape.num_rows
    md = FlatMetadata(
        slot_mapping=np.full(t, -1, np.int32),
        cu_q_lens=np.zeros(r + 1, np.int32),
        seq_lens=np.zeros(r, np.int32),
        page_tables=np.zeros((r, shape.max_pages), np.int32),
        num_seqs=np.zeros(1, np.int32),
        invariant=shape.invariant,
    )
    batch = packed.StepBatch(
        tokens=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        md=md,
        copy_src=np.zeros(0, np.int32),
        copy_dst=np.zeros(0, np.int32),
        logit_index=np.zeros(r, np.int32),
        row_step=np.zeros(r, np.int32),
        block_stop=np.zeros(r, bool),
        stop_ids=np.full((r, shape.stop_width), 2**31 - 1, np.int32),
        prompt_mask=np.zeros((r, vocab_size), bool) if shape.penalties else None,
        output_counts=np.zeros((r, vocab_size), np.int32) if shape.penalties else None,
        next_tokens=np.zeros(t, np.int32) if shape.prompt_logprobs else None,
        lora_ids=np.full(t, -1, np.int32) if lora else None,
        splice_source=np.full(t, -1, np.int32),
        prev_tokens=np.zeros(max(shape.max_seqs, r), np.int32),
        want_top=np.asarray(False),
    )
    sa = SamplingArrays.build([None] * r, np.zeros((r, 2), np.uint32), shape.logit_bias)
    return batch, unconstrained(sa, vocab_size)


def unconstrained(sa: SamplingArrays, vocab_size: int) -> SamplingArrays:
    """A ragged step's sampling arrays with every token allowed: its program always takes a
    structured-output bitmask, which the engine fills when a row is constrained."""
    rows = sa.temperature.shape[0]
    return sa.replace(
        allowed=np.full((rows, bitmask_width(vocab_size)), -1, np.int32),
        constrained=np.asarray(False),
    )
