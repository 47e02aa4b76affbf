"""Offline batch jobs over JSONL files: `jaxgen batch IN OUT` and `LLM.generate_file`.

Input, one request per line, in OpenAI's batch format::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": 64, ...}}

(or ``"url": "/v1/completions"`` with a ``"prompt"`` body), validated field by field as the
server validates its bodies; or, as a shorthand, flat lines ``{"id": ..., "messages": [...]}``
and ``{"id": ..., "prompt": ...}`` with optional sampling fields (SamplingParams' names). A flat
``prompt`` goes through the model's chat template (as `jaxgen generate` does) unless the job is
``raw``; token-id prompts are never templated. Fields a line does not give take the job's
defaults. Output: one line per finished request in OpenAI's batch output shape (``id``,
``custom_id``, ``response.status_code``, ``response.body`` -- a ``chat.completion`` or
``text_completion`` -- and ``error``), plus token ids and per-request metrics.

Resumable: a finished request is appended and flushed at once; rerunning the same command
skips ids already in the output (a torn last line from a killed run is cut off first), and
per-request seeds derive from the job seed and the id, so a resumed job writes exactly what an
uninterrupted one would. Bad lines go to an errors file with their line number. With several
processes (`rank` of `world`), each handles the lines with index % world == rank and writes
``OUT.rank{r}``; `merge_outputs` joins them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import threading
import time
import uuid

import numpy as np

from jaxgen.engine.params import SamplingParams
from jaxgen.entrypoints import protocol
from jaxgen.entrypoints.tool_calls import ToolParser
from jaxgen.errors import JaxgenError

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class BatchJobError(JaxgenError):
    """The job cannot start (unreadable input, unwritable output)."""


def check_input(in_path: str) -> None:
    if not os.path.isfile(in_path) or not os.access(in_path, os.R_OK):
        raise BatchJobError(f"{in_path}: input file does not exist or is not readable")


def check_output(out_path: str) -> None:
    directory = os.path.dirname(os.path.abspath(out_path)) or "."
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise BatchJobError(f"{out_path}: the output directory is missing or not writable")
    if os.path.exists(out_path) and not os.access(out_path, os.W_OK):
        raise BatchJobError(f"{out_path}: the output file is not writable")


def check_paths(in_path: str, out_path: str) -> None:
    """Fails before any model loads if the input is unreadable or the output unwritable."""
    check_input(in_path)
    check_output(out_path)


def rank_path(out_path: str, rank: int, world: int) -> str:
    return out_path if world == 1 else f"{out_path}.rank{rank}"


def stable_seed(job_seed: int, request_id) -> int:
    digest = hashlib.sha256(f"{job_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def done_ids(out_path: str) -> set:
    """Ids already written; a torn last line (killed mid-write) is cut off first."""
    if not os.path.exists(out_path):
        return set()
    with open(out_path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            f.truncate(keep)
    ids = set()
    for line in data[:keep].splitlines():
        if line.strip():
            ids.add(json.loads(line)["custom_id"])
    return ids


@dataclasses.dataclass
class BatchLine:
    """One parsed input line."""

    custom_id: str | int
    prompt: object  # for LLM.generate: text, token ids or {"prompt_token_ids": ...}
    params: SamplingParams
    kind: str  # "chat.completion", "text_completion" (OpenAI lines) or "flat"
    templated: bool = False  # a flat "prompt" sent through the chat template
    tool_parser: ToolParser | None = None  # a chat line whose model may call its tools


URLS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}
# Streaming makes no sense in a file; everything else the server takes, a line may give.
BODY_FIELDS = {
    "chat.completion": protocol.CHAT_FIELDS - {"stream", "stream_options"},
    # echo and its score-only max_tokens 0 are the server's (an eval harness's) alone
    "text_completion": protocol.COMPLETION_FIELDS - {"stream", "stream_options", "echo"},
}


def _seeded(params: SamplingParams, job_seed, custom_id) -> SamplingParams:
    """Per-request seeds derive from the job seed and the id: a resumed job writes exactly
    what an uninterrupted one would."""
    if params.seed is None and job_seed is not None:
        return dataclasses.replace(params, seed=stable_seed(job_seed, custom_id))
    return params


def is_openai(record: dict) -> bool:
    """An OpenAI batch line (the rest are flat lines)."""
    return "body" in record or "url" in record


def record_id(number: int, record: dict):
    """The `custom_id` a line's output carries (a flat line without one: ``line-N``)."""
    if is_openai(record):
        return record.get("custom_id")
    return record.get("id", record.get("custom_id", f"line-{number}"))


def line_id(number: int, line: str):
    """`record_id` of a raw input line, or None when it is not a JSON object (it then fails
    in `parse_line` and goes to the errors output)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record_id(number, record) if isinstance(record, dict) else None


def _openai_line(llm, record: dict, defaults: SamplingParams, tool_parser: ToolParser) -> BatchLine:
    unknown = set(record) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    custom_id = record_id(0, record)
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("'custom_id' must be a non-empty string")
    if record.get("method", "POST") != "POST":
        raise ValueError(f"'method' must be \"POST\", got {record.get('method')!r}")
    kind = URLS.get(record.get("url"))
    if kind is None:
        raise ValueError(f"'url' must be one of {', '.join(URLS)}, got {record.get('url')!r}")
    try:
        body = protocol.check_fields(record.get("body"), BODY_FIELDS[kind])
        if kind == "chat.completion":
            chat = protocol.chat_request(body, tool_parser, defaults)
            prompt = chat.prompt(llm)
            return BatchLine(custom_id, prompt, chat.params, kind, tool_parser=chat.tool_parser)
        parsed = protocol.completion_request(body, defaults)
        prompts, params = parsed.prompts, parsed.params
    except protocol.APIError as e:
        raise ValueError(f"body: {e.message}") from None
    if len(prompts) != 1:
        raise ValueError("one prompt per line: give 'prompt' a string or token ids")
    return BatchLine(custom_id, prompts[0], params, kind)


def _flat_line(llm, number, record: dict, defaults: SamplingParams, raw: bool) -> BatchLine:
    custom_id = record_id(number, record)
    if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
        raise ValueError("'id' must be a string or an integer")
    templated = False
    if "messages" in record:
        prompt = llm.apply_chat_template(record["messages"])
    elif isinstance(record.get("prompt"), str):
        templated = not raw and llm.tokenizer.chat_template is not None
        prompt = (
            llm.apply_chat_template([{"role": "user", "content": record["prompt"]}])
            if templated
            else record["prompt"]
        )
    elif isinstance(record.get("prompt"), list):
        prompt = record["prompt"]  # token ids are sent as they are
    else:
        raise ValueError("missing 'prompt' (a string or token ids) or 'messages'")
    overrides = {k: v for k, v in record.items() if k in SAMPLING_FIELDS}
    unknown = set(record) - SAMPLING_FIELDS - {"id", "custom_id", "prompt", "messages"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    if overrides.get("logit_bias") is not None:  # JSON keys are strings
        overrides["logit_bias"] = protocol.logit_bias_by_id(overrides["logit_bias"])
    params = SamplingParams(**{**dataclasses.asdict(defaults), **overrides})
    return BatchLine(custom_id, prompt, params, "flat", templated)


def parse_line(
    llm,
    number: int,
    line: str,
    defaults: SamplingParams,
    job_seed,
    raw: bool = False,
    tool_parser: ToolParser | None = None,
) -> BatchLine:
    """One input line, or raises ValueError with the reason. `tool_parser`: the model's
    tool-call format (None: the one its chat template shows)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from e
    if not isinstance(record, dict):
        raise ValueError("each line must be a JSON object")
    if is_openai(record):
        parsed = _openai_line(llm, record, defaults, tool_parser or ToolParser(llm.tokenizer))
    else:
        parsed = _flat_line(llm, number, record, defaults, raw)
    parsed.params = _seeded(parsed.params, job_seed, parsed.custom_id)
    return parsed


def output_record(parsed: BatchLine, out, tokenizer=None, model: str = "default") -> dict:
    m = out.metrics
    if parsed.kind == "flat":
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "logprobs": None
                if c.logprobs is None
                else [{str(t): lp.logprob for t, lp in entry.items()} for entry in c.logprobs],
            }
            for c in out.outputs
        ]
        body = {"object": "text_completion", "choices": choices, "usage": protocol.usage([out])}
    else:
        if parsed.kind == "chat.completion":
            choices = protocol.chat_choices(
                tokenizer, out, parsed.params.logprobs or 0, parsed.tool_parser
            )
        else:
            choices = protocol.completion_choices(tokenizer, [out], parsed.params.n)
        for choice, c in zip(choices, out.outputs, strict=True):
            choice["token_ids"] = c.token_ids
        prefix = "chatcmpl" if parsed.kind == "chat.completion" else "cmpl"
        body = protocol.response_body(
            f"{prefix}-{uuid.uuid4().hex}", parsed.kind, int(time.time()), model, choices, [out]
        )
    return {
        # Unique across resumed runs (the engine's request counter restarts with each process).
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": parsed.custom_id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "metrics": {
            "queue_s": m.queue_time,
            "ttft_s": m.ttft,
            "tpot_s": m.time_per_output_token,
            "e2e_s": m.e2e_latency,
            "cached_prompt_tokens": m.num_cached_prompt_tokens,
        },
        "error": None,
    }


@dataclasses.dataclass
class Admitted:
    """Lines parsed, validated and queued in an engine (`admit_lines`)."""

    pending: list  # (BatchLine, Request) in line order
    errors: list  # {"line": number, "error": reason}
    templated: int = 0  # flat "prompt" lines sent through the chat template


def admit_lines(
    llm, numbered_lines, defaults: SamplingParams, seed, raw, tool_parser, skip=frozenset()
) -> Admitted:
    """Parses and validates each (number, line), builds its request and queues it in the
    engine (its one capacity check). Bad lines become errors; ids in `skip` are left out.
    The local job and every Ray replica admit their lines here."""
    admitted = Admitted([], [])
    for number, line in numbered_lines:
        try:
            parsed = parse_line(llm, number, line, defaults, seed, raw, tool_parser)
            if parsed.custom_id in skip:
                continue
            (request,) = llm.processor.make_requests([parsed.prompt], parsed.params)
            llm.engine.add_request(request)  # its one capacity check; nothing is queued
        except (ValueError, KeyError, TypeError) as e:
            admitted.errors.append({"line": number, "error": str(e)})
            continue
        admitted.templated += parsed.templated
        admitted.pending.append((parsed, request))
    return admitted


class _TicketLock:
    """A first-come, first-served lock: a thread releasing it and asking again queues behind
    the threads already waiting (a plain Lock lets the thread holding the GIL take it back at
    once, which would starve the other caller of an `EngineDriver`)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self):
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc):
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class EngineDriver:
    """Steps one engine for one or several callers (threads), each waiting for the requests it
    admitted: whichever caller holds the lock steps the engine once and marks every request
    that finished, so the engine batches all callers' requests together (a Ray replica keeps
    two blocks in flight: one block's tail overlaps the next block's start)."""

    def __init__(self, llm):
        self.llm = llm
        self.lock = _TicketLock()
        self.watched: dict = {}  # request id -> request, of every caller, until it finishes
        self.finished_ids: set[str] = set()

    def admit(self, numbered_lines, defaults, seed, raw, tool_parser, skip=frozenset()):
        with self.lock:  # watched at once: the other caller's next step may finish them
            admitted = admit_lines(self.llm, numbered_lines, defaults, seed, raw, tool_parser, skip)
            self.watched.update((r.request_id, r) for _, r in admitted.pending)
        return admitted

    def finished_records(self, pending, model_name: str):
        """Steps the engine until every request of `pending` is done, yielding (output
        record, RequestOutput) for each as it finishes."""
        by_request = {r.request_id: (parsed, r) for parsed, r in pending}
        with self.lock:
            self.watched.update((i, r) for i, (_, r) in by_request.items())
        while by_request:
            with self.lock:
                ready = [i for i in by_request if i in self.finished_ids]
                if not ready:
                    for seq, _ in self.llm.engine.step():
                        request = self.watched.get(seq.request_id)
                        if request is not None and request.finished:
                            del self.watched[seq.request_id]
                            self.finished_ids.add(seq.request_id)
                    ready = [i for i in by_request if i in self.finished_ids]
                self.finished_ids.difference_update(ready)
            for request_id in ready:
                parsed, request = by_request.pop(request_id)
                result = request.to_output()
                yield output_record(parsed, result, self.llm.tokenizer, model_name), result


def finished_records(llm, pending, model_name: str):
    """Steps the engine until every admitted request is done, yielding (output record,
    RequestOutput) for each as it finishes (one caller: `EngineDriver` with no contention)."""
    yield from EngineDriver(llm).finished_records(pending, model_name)


def result_fields(result) -> dict:
    """What `JobStats` counts of one RequestOutput (plain values: they cross processes)."""
    return {
        "tokens": result.metrics.num_generated_tokens,
        "empty": sum(not c.text for c in result.outputs),
        "reasons": [c.finish_reason for c in result.outputs],
        "ttft": result.metrics.ttft,
        "tpot": result.metrics.time_per_output_token,
    }


class JobStats:
    """Output tokens, empty outputs, finish reasons and TTFT/TPOT of a job's results."""

    def __init__(self):
        self.done, self.tokens, self.empty = 0, 0, 0
        self.reasons = collections.Counter()
        self.ttfts, self.tpots = [], []

    def add(self, tokens: int, empty: int, reasons: list, ttft=None, tpot=None) -> None:
        """One request's `result_fields`."""
        self.done += 1
        self.tokens += tokens
        self.empty += empty
        self.reasons.update(reasons)
        if ttft is not None:
            self.ttfts.append(ttft)
        if tpot is not None:
            self.tpots.append(tpot)

    def summary(self, seconds: float) -> dict:
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
        return {
            "empty_outputs": self.empty,
            "finish_reasons": dict(self.reasons),
            "output_tokens": self.tokens,
            "seconds": seconds,
            "tokens_per_s": self.tokens / seconds if seconds else 0.0,
            "ttft_p50_s": pct(self.ttfts, 50),
            "ttft_p99_s": pct(self.ttfts, 99),
            "tpot_p50_s": pct(self.tpots, 50),
            "tpot_p99_s": pct(self.tpots, 99),
        }


def write_errors(errors_path: str, errors: list) -> None:
    with open(errors_path, "w") as f:
        for e in errors:
            f.write(json.dumps(e) + "\n")


def progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="req", desc="batch", dynamic_ncols=True)


def run_batch(
    llm,
    in_path: str,
    out_path: str,
    defaults: SamplingParams | None = None,
    *,
    seed: int | None = 0,
    errors_path: str | None = None,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
    raw: bool = False,
    model_name: str = "default",
    tool_call_parser: str | None = None,
) -> dict:
    """Runs (or resumes) a batch job through the continuous-batching engine.

    Args:
      raw: flat ``prompt`` lines are sent as they are, not through the chat template.
      model_name: the ``model`` written into OpenAI-format response bodies.
      tool_call_parser: the format of the model's tool calls (`tool_calls.FORMATS`); None
        picks it from the chat template.
    Returns:
      a summary: requests done / skipped / failed, how flat prompts were formatted, empty
      outputs and finish reasons, tokens, throughput, TTFT/TPOT percentiles.
    """
    if llm.engine is None:
        raise BatchJobError("batch jobs need the paged engine (kv_cache='paged')")
    defaults = defaults or SamplingParams()
    tool_parser = ToolParser(llm.tokenizer, tool_call_parser)
    out_path = rank_path(out_path, rank, world)
    check_paths(in_path, out_path)
    errors_path = errors_path or out_path + ".errors.jsonl"
    finished = done_ids(out_path)
    with open(in_path, encoding="utf-8", errors="replace") as f:
        lines = (
            (index + 1, line)
            for index, line in enumerate(f)
            if index % world == rank and line.strip()
        )
        admitted = admit_lines(llm, lines, defaults, seed, raw, tool_parser, finished)
    write_errors(errors_path, admitted.errors)

    bar = progress_bar(len(admitted.pending) + len(finished), len(finished)) if progress else None
    t0 = time.perf_counter()
    stats = JobStats()
    with open(out_path, "a", encoding="utf-8") as out:
        for record, result in finished_records(llm, admitted.pending, model_name):
            out.write(json.dumps(record) + "\n")
            out.flush()  # a finished request is never lost to a later kill
            stats.add(**result_fields(result))
            if bar is not None:
                elapsed = time.perf_counter() - t0
                bar.set_postfix(tok_s=f"{stats.tokens / max(elapsed, 1e-9):.1f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0
    engine_stats = llm.engine.stats()
    return {
        "output": out_path,
        "errors_file": errors_path,
        "done": len(admitted.pending),
        "skipped_already_done": len(finished),
        "bad_lines": len(admitted.errors),
        # Flat "prompt" lines sent through the chat template (the rest as they are).
        "chat_templated_prompts": admitted.templated,
        **stats.summary(elapsed),
        "mbu": engine_stats.get("mbu"),
        "mfu": engine_stats.get("mfu"),
    }


def merge_outputs(out_path: str, world: int) -> int:
    """Joins OUT.rank0..OUT.rank{world-1} into OUT (ids in input order per rank); returns lines."""
    lines = 0
    with open(out_path, "w", encoding="utf-8") as out:
        for rank in range(world):
            part = rank_path(out_path, rank, world)
            done_ids(part)  # drop a torn last line
            with open(part, encoding="utf-8") as f:
                for line in f:
                    out.write(line)
                    lines += 1
    return lines
