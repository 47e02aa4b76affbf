"""The engine thread of the server: it alone touches the engine. HTTP handlers hand it
validated requests and read their deltas and outputs from per-request asyncio queues; it keeps
the Prometheus metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import threading
import time

from jaxgen.engine import roofline
from jaxgen.engine.metrics import CompileCounter
from jaxgen.engine.request import Request
from jaxgen.engine.sched.router import pending_tokens
from jaxgen.errors import JaxgenError

log = logging.getLogger("jaxgen.server")


class Histogram:
    def __init__(self, buckets):
        self.buckets = list(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for b, c in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{name}_bucket{{le="{b}"}} {c}')
        lines += [
            f'{name}_bucket{{le="+Inf"}} {self.total}',
            f"{name}_sum {self.sum}",
            f"{name}_count {self.total}",
        ]
        return lines


@dataclasses.dataclass
class Metrics:
    requests: dict = dataclasses.field(default_factory=lambda: {"ok": 0, "error": 0, "aborted": 0})
    ttft: Histogram = dataclasses.field(
        default_factory=lambda: Histogram([0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30])
    )
    tpot: Histogram = dataclasses.field(
        default_factory=lambda: Histogram([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1])
    )
    engine: dict = dataclasses.field(default_factory=dict)
    role: str | None = None  # `serve --role` (disaggregated serving): a label on every series
    compiles: CompileCounter | None = None  # XLA compiles since the server started serving

    def render(self) -> str:
        lines = [
            "# HELP jaxgen_requests_total Requests finished, by outcome.",
            "# TYPE jaxgen_requests_total counter",
        ]
        lines += [f'jaxgen_requests_total{{status="{k}"}} {v}' for k, v in self.requests.items()]
        lines += self.ttft.render("jaxgen_time_to_first_token_seconds", "Time to first token.")
        lines += self.tpot.render(
            "jaxgen_time_per_output_token_seconds", "Mean time per output token after the first."
        )
        gauges = {
            "running": ("jaxgen_num_requests_running", "Sequences running."),
            "waiting": ("jaxgen_num_requests_waiting", "Sequences waiting."),
            "programs": ("jaxgen_step_programs", "Step programs compiled or loaded so far."),
            "pages_used": ("jaxgen_kv_pages_used", "KV-cache pages in use."),
            "pages_free": ("jaxgen_kv_pages_free", "KV-cache pages free or evictable."),
            "pages_cached": ("jaxgen_kv_pages_cached", "KV-cache pages holding a cached prefix."),
            "prefix_hit_rate": ("jaxgen_prefix_cache_hit_rate", "Prompt tokens served from cache."),
            "tokens_per_s": ("jaxgen_tokens_per_second", "Generated tokens per busy second."),
            "mbu": ("jaxgen_mbu", "Last step's bandwidth / the machine's read bandwidth."),
            "mfu": ("jaxgen_mfu", "Last step's FLOP rate / the machine's peak."),
        }
        counters = {  # only ever grow: Prometheus counters (the _total suffix says so)
            "preemptions": ("jaxgen_preemptions_total", "Sequences preempted."),
            "tokens_generated": ("jaxgen_generation_tokens_total", "Tokens generated."),
        }
        for kind, series in (("gauge", gauges), ("counter", counters)):
            for key, (name, help_) in series.items():
                if key in self.engine:
                    lines += [
                        f"# HELP {name} {help_}",
                        f"# TYPE {name} {kind}",
                        f"{name} {float(self.engine[key])}",
                    ]
        if self.compiles is not None:
            lines += [
                "# HELP jaxgen_xla_compiles_total XLA programs compiled since serving began.",
                "# TYPE jaxgen_xla_compiles_total counter",
                f"jaxgen_xla_compiles_total {float(self.compiles.compiles)}",
                "# HELP jaxgen_xla_compile_seconds_total Seconds of those compiles.",
                "# TYPE jaxgen_xla_compile_seconds_total counter",
                f"jaxgen_xla_compile_seconds_total {self.compiles.seconds}",
            ]
        lines += _render_kv_tiers(self.engine.get("kv_tiers"))
        if self.role is not None:
            lines = [_with_label(line, "role", self.role) for line in lines]
        return "\n".join(lines) + "\n"


def _with_label(line: str, key: str, value: str) -> str:
    """A Prometheus sample line with one more label (comments unchanged)."""
    if not line or line.startswith("#"):
        return line
    series, sample = line.rsplit(" ", 1)
    label = f'{key}="{value}"'
    if series.endswith("}"):
        return f"{series[:-1]},{label}}} {sample}"
    return f"{series}{{{label}}} {sample}"


def _render_kv_tiers(stats: dict | None) -> list[str]:
    """The KV cache tiers' counters (LLM(kv_host_cache_bytes=..., kv_disk_cache_dir=...)),
    labelled by tier."""
    if not stats:
        return []
    tiers = sorted({k.split("_", 1)[0] for k in stats if k.endswith("_hits")})
    series = [
        ("hits", "jaxgen_kv_tier_hits_total", "KV blocks found in a tier.", "counter"),
        ("misses", "jaxgen_kv_tier_misses_total", "KV blocks looked up and not found.", "counter"),
        (
            "bad",
            "jaxgen_kv_tier_bad_blocks_total",
            "Blocks rejected (checksum, size, model).",
            "counter",
        ),
        ("bytes_in", "jaxgen_kv_tier_bytes_written_total", "Bytes written into a tier.", "counter"),
        ("bytes_out", "jaxgen_kv_tier_bytes_read_total", "Bytes read from a tier.", "counter"),
        ("evictions", "jaxgen_kv_tier_evictions_total", "Blocks evicted from a tier.", "counter"),
        ("rejected", "jaxgen_kv_tier_rejected_total", "Writes a tier had no room for.", "counter"),
        ("bytes_stored", "jaxgen_kv_tier_bytes", "Bytes a tier holds now.", "gauge"),
    ]
    lines = []
    for field, name, help_, kind in series:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        lines += [
            f'{name}{{tier="{t}"}} {float(stats[f"{t}_{field}"])}'
            for t in tiers
            if f"{t}_{field}" in stats  # a shared store has no bytes_stored of its own
        ]
    for key, help_ in (
        ("offloaded_blocks", "Pages written down from the device pool."),
        ("loaded_blocks", "Pages loaded into the device pool from a tier."),
        ("lookup_seconds", "Seconds the engine waited on the tiers (admission lookups)."),
        ("prefetches", "Prefixes read from the tiers on the prefetch thread."),
        ("prefetch_seconds", "Seconds of prefetch reads, overlapping the engine's steps."),
        ("io_seconds", "Seconds spent moving pages between the device pool and the host."),
        ("transfer_pulls", "Prompts whose pages were read from another engine (kv_transfer)."),
        ("transfer_pulled_bytes", "Bytes of pages read from other engines (kv_transfer)."),
        ("transfer_pull_seconds", "Seconds of those reads (bytes / seconds: transfer rate)."),
    ):
        if key not in stats:
            continue
        name = f"jaxgen_kv_{key}_total"
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {float(stats[key])}"]
    return lines


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request


class EngineWorker:
    """Owns the engine; the only thread that changes it (`OpenAIServer.kv_lookup` only reads
    the block manager's prefix dicts, and `pending_tokens` this thread publishes)."""

    def __init__(self, llm, max_waiting: int = 256, role: str | None = None,
                 step_log: str | None = None):  # fmt: skip
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = Metrics(role=role)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._validate_lock = threading.Lock()
        self._stop = threading.Event()
        self._limits = roofline.machine_limits(quick=True)
        self.metrics.engine = llm.engine.stats(self._limits)  # /metrics before any request
        # Compiles are counted from here on (the engine compiled its programs ahead of time, and
        # the roofline's measurement compiled its own).
        self.metrics.compiles = CompileCounter().install()
        # Prefill tokens queued or under way plus one per decode, as of the last step: the load
        # a cache-aware router weighs against cached prefixes (`OpenAIServer.kv_lookup`).
        self.pending_tokens = 0
        self._step_log = None
        if step_log is not None:  # one JSON line per landed step, from the engine thread
            self._step_log = open(step_log, "a", buffering=1)  # noqa: SIM115 (closed in close)
            llm.engine.on_step = self._log_step
        self._thread = threading.Thread(target=self._loop, name="jaxgen-engine", daemon=True)
        self._thread.start()

    def make_requests(self, prompts, params, lora_request=None):
        """Host-side validation and tokenisation (no device work); raises JaxgenError."""
        with self._validate_lock:
            return self.llm.processor.make_requests(prompts, params, lora_request=lora_request)

    def load_lora(self, name: str, path: str) -> None:
        """`LLM.load_lora`, between validations (the engine thread reads no names: requests
        carry their adapters)."""
        with self._validate_lock:
            self.llm.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        with self._validate_lock:
            self.llm.unload_lora(name)

    def freeze_programs(self, frozen: bool) -> concurrent.futures.Future:
        """`Engine.freeze_programs` on the engine thread, between steps (in order with the
        requests submitted around it); the future gives the number of programs compiled and
        the step programs' shapes (`Engine.program_shapes`)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("freeze", frozen, None, done))
        return done

    def call(self, fn) -> concurrent.futures.Future:
        """`fn(llm)` on the engine thread, between steps (in order with the requests submitted
        around it): pause, resume, sleep, wake_up, update_weights (`server.control`). The
        future gives its result or raises its exception."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, None, done))
        return done

    def pending(self) -> int:
        return len(self._streams) + self._commands.qsize()

    def submit(self, requests, stream_loop, out_queue) -> None:
        self._commands.put(("add", requests, stream_loop, out_queue))

    def abort(self, request_ids) -> None:
        self._commands.put(("abort", list(request_ids), None, None))

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("stop", None, None, None))
        self._thread.join(timeout=10)
        self.metrics.compiles.close()
        if self._step_log is not None:
            self.llm.engine.on_step = None
            self._step_log.close()

    def _log_step(self, record: dict) -> None:
        self._step_log.write(json.dumps({"time": time.time(), "pid": os.getpid(), **record}) + "\n")

    def _push(self, stream: _Stream, item) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _handle(self, command) -> None:
        kind, payload, loop, out = command
        engine = self.llm.engine
        if kind == "add":
            try:
                engine.add_requests(payload)
            except JaxgenError as e:
                loop.call_soon_threadsafe(out.put_nowait, ("error", e))
                return
            for r in payload:
                self._streams[r.request_id] = _Stream(loop, out, r)
        elif kind == "freeze":
            out.set_result((engine.freeze_programs(payload), engine.program_shapes()))
        elif kind == "call":
            try:
                out.set_result(payload(self.llm))
            except Exception as e:  # handed to the caller, which answers it
                out.set_exception(e)
            self._finish_streams()  # e.g. requests a pause aborted
            self.metrics.engine = engine.stats(self._limits)
        elif kind == "abort":
            for request_id in payload:
                stream = self._streams.pop(request_id, None)
                if stream is not None and engine.abort(request_id):
                    self.metrics.requests["aborted"] += 1
            self.metrics.engine = engine.stats(self._limits)  # pages were freed
        self.pending_tokens = pending_tokens(engine)

    def _loop(self) -> None:
        engine = self.llm.engine
        while not self._stop.is_set():
            try:
                block = not engine.has_work
                command = self._commands.get(block=block, timeout=0.5 if block else None)
                if command[0] == "stop":
                    return
                self._handle(command)
                while True:  # drain everything else queued, without blocking
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not engine.has_work:
                continue
            try:
                events = engine.step()
            except Exception as e:  # a bug or device failure: fail the running requests, go on
                log.exception("engine step failed")
                for request_id, stream in list(self._streams.items()):
                    self._push(stream, ("error", e))
                    engine.abort(request_id)
                    self._streams.pop(request_id)
                continue
            for seq, delta in events:
                stream = self._streams.get(seq.request_id)
                if stream is not None:  # finish_reason, tokens now: the handler reads them later
                    item = ("delta", seq, delta, seq.finish_reason, len(seq.output_ids))
                    self._push(stream, item)
            self._finish_streams()
            self.metrics.engine = engine.stats(self._limits)
            self.pending_tokens = pending_tokens(engine)

    def _finish_streams(self) -> None:
        for request_id, stream in list(self._streams.items()):
            if stream.request.finished:
                self._streams.pop(request_id)
                out = stream.request.to_output()
                self._record(out)
                self._push(stream, ("done", out))

    def _record(self, out) -> None:
        self.metrics.requests["ok"] += 1
        m = out.metrics
        if m.ttft is not None:
            self.metrics.ttft.observe(m.ttft)
        if m.time_per_output_token is not None:
            self.metrics.tpot.observe(m.time_per_output_token)
