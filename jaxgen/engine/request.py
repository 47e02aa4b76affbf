"""The request the scheduler sees: a prompt, its validated parameters and its sequences.

Built by `engine.processor.Processor` (which validates it once); the scheduler and the engine
core read and update these fields and never probe for others.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxgen.engine.outputs import Logprob, RequestMetrics, RequestOutput
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.sched.beam import BeamController
from jaxgen.engine.sched.sequence import Sequence

if TYPE_CHECKING:
    from jaxgen.engine.lora import LoadedLoRA


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt and its samples (n, or best_of)."""

    request_id: str
    prompt: str | None  # the text, when the prompt was given as text
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: dataclasses.InitVar[float]  # time.perf_counter() when it came in
    # Per prompt position (prompt_logprobs requests): None for the first token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    beam: BeamController | None = None  # beam-search requests (LLM.beam_search)
    lora: LoadedLoRA | None = None  # the LoRA adapter it runs with (None: the base model)
    spec_accepted: int = 0  # speculative decoding: drafted tokens accepted so far
    spec_drafted: int = 0  # ... and proposed so far
    metrics: RequestMetrics = dataclasses.field(init=False)

    def __post_init__(self, arrival_time: float):
        self.metrics = RequestMetrics(
            arrival_time=arrival_time, num_prompt_tokens=len(self.prompt_ids)
        )

    @property
    def cache_salt(self) -> tuple | None:
        """What keeps its cached prefix pages apart from other adapters' (same tokens, other
        K/V): the adapter's load, or None for the base model."""
        return None if self.lora is None else ("lora", self.lora.uid)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        seqs = self.seqs
        if self.params.best_of and self.params.best_of > self.params.n:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: self.params.n]
        m = self.metrics
        m.num_generated_tokens = sum(len(s.output_ids) for s in self.seqs)
        times = sorted(t for s in self.seqs for t in s.token_times)
        if times:
            m.first_token_time = m.first_token_time or times[0]
            m.last_token_time = times[-1]
            m.token_times = [t for t in self.seqs[0].token_times]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            prompt_logprobs=self.prompt_logprobs,
            outputs=[s.to_output() for s in seqs],
            finished=self.finished,
            metrics=m,
        )
