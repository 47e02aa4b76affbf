"""vLLM-style result objects returned by `LLM.generate`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) and the latencies derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def time_per_output_token(self) -> float | None:
        """Mean decode latency after the first token (TPOT)."""
        if self.num_generated_tokens < 2 or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def tokens_per_second(self) -> float | None:
        if self.num_generated_tokens == 0 or self.finished_time is None:
            return None
        start = self.first_scheduled_time or self.arrival_time
        return self.num_generated_tokens / max(self.finished_time - start, 1e-9)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
