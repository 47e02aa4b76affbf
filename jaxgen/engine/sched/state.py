"""The scheduler's records: a sequence's state (`SeqState`), one row of a step (`Row`: a chunk
of a sequence's tokens) and a scheduled step (`ScheduledStep`), which the packer turns into
device arrays. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxgen.cache.block_manager import PENDING
from jaxgen.engine.sched.sequence import WAITING, Sequence

if TYPE_CHECKING:
    from jaxgen.engine.request import Request


@dataclasses.dataclass(eq=False)
class SeqState:
    """Scheduler-side state of one sequence."""

    seq: Sequence
    request: Request
    status: str = WAITING
    num_computed: int = 0  # leading tokens whose K/V are written
    fork_from: SeqState | None = None  # n > 1 sibling waiting to fork from this primary
    pending: int = 0  # tokens sampled by dispatched steps, not yet handed back
    pending_row: int = -1  # the row of the last dispatched step that samples the newest one
    id: tuple = dataclasses.field(init=False)  # (request id, sample index): its pages' key

    def __post_init__(self):
        self.id = (self.seq.request_id, self.seq.index)

    @property
    def num_tokens(self) -> int:
        return self.seq.total_len + self.pending

    @property
    def tokens(self) -> list[int]:
        """Prompt, output and a `PENDING` placeholder per pending token."""
        return self.seq.prompt_ids + self.seq.output_ids + [PENDING] * self.pending

    def token_at(self, i: int) -> int:
        prompt, output = self.seq.prompt_ids, self.seq.output_ids
        if i < len(prompt):
            return prompt[i]
        return output[i - len(prompt)] if i - len(prompt) < len(output) else PENDING

    @property
    def num_generated(self) -> int:
        """Output tokens, the pending ones included."""
        return len(self.seq.output_ids) + self.pending

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are recorded once per request, from its first (unpreempted) prefill,
        which therefore computes every prompt position (no prefix-cache hits)."""
        return (
            self.request.params.prompt_logprobs is not None
            and self.seq.index == 0
            and not self.seq.output_ids
        )


@dataclasses.dataclass(slots=True)
class Row:
    """One row of a step: a chunk of a sequence's tokens [start, end)."""

    state: SeqState
    start: int
    end: int
    emits: bool  # the chunk ends the sequence's known tokens: its last logits give a token
    sample_of: Row | None = None  # a sibling's sampling row reads this row's logits
    draft: list[int] = dataclasses.field(default_factory=list)  # speculative tokens to verify


@dataclasses.dataclass
class ScheduledStep:
    decode: list[Row]
    prefill: list[Row]
    samples: list[Row]  # n > 1 siblings sampling from their primary row's last position
    copies: list[tuple[int, int]]  # copy-on-write page copies before the step
    verify: list[Row] = dataclasses.field(default_factory=list)  # decodes with drafts

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.verify)

    @property
    def num_tokens(self) -> int:
        return sum(r.end - r.start for r in self.decode + self.verify + self.prefill)
