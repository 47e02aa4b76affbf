"""Requests, scheduling, sampling and the user-facing API.

from engine import LLM, SamplingParams
"""

from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
