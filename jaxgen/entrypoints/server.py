"""OpenAI-compatible HTTP server: `jaxgen serve`.

One background thread owns the continuous-batching engine and runs its loop; HTTP handlers
validate a request (the same validation as `SamplingParams` / `LLM.generate`), hand it to the
thread and await its outputs on a per-request queue. A client that disconnects has its request
aborted and its pages freed. Routes: POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import queue
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxgen.engine import roofline
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.request import Request
from jaxgen.errors import CapacityError, InvalidPrompt, JaxgenError

log = logging.getLogger("jaxgen.server")

# Fields each route understands; anything else is rejected (strict), so typos do not silently
# change behaviour. Fields OpenAI defines that we accept but do not act on are listed too.
_SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "user",
    "stream_options",
    # vLLM's extra sampling fields
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"model", "prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "model",
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
}


class APIError(Exception):
    """An error answered in OpenAI's JSON error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type_, code

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------
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
            "pages_used": ("jaxgen_kv_pages_used", "KV-cache pages in use."),
            "pages_free": ("jaxgen_kv_pages_free", "KV-cache pages free or evictable."),
            "pages_cached": ("jaxgen_kv_pages_cached", "KV-cache pages holding a cached prefix."),
            "prefix_hit_rate": ("jaxgen_prefix_cache_hit_rate", "Prompt tokens served from cache."),
            "preemptions": ("jaxgen_preemptions_total", "Sequences preempted."),
            "tokens_generated": ("jaxgen_generation_tokens_total", "Tokens generated."),
            "tokens_per_s": ("jaxgen_tokens_per_second", "Generated tokens per busy second."),
            "mbu": ("jaxgen_mbu", "Last step's bandwidth / the machine's read bandwidth."),
            "mfu": ("jaxgen_mfu", "Last step's FLOP rate / the machine's peak."),
        }
        for key, (name, help_) in gauges.items():
            if key in self.engine:
                lines += [
                    f"# HELP {name} {help_}",
                    f"# TYPE {name} gauge",
                    f"{name} {float(self.engine[key])}",
                ]
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# The engine thread
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request


class EngineWorker:
    """Owns the engine; the only thread that touches it."""

    def __init__(self, llm, max_waiting: int = 256):
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = Metrics()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._validate_lock = threading.Lock()
        self._stop = threading.Event()
        self._limits = roofline.machine_limits(quick=True)
        self._thread = threading.Thread(target=self._loop, name="jaxgen-engine", daemon=True)
        self._thread.start()

    def make_requests(self, prompts, params):
        """Host-side validation and tokenisation (no device work); raises JaxgenError."""
        with self._validate_lock:
            return self.llm.processor.make_requests(prompts, params)

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
        elif kind == "abort":
            for request_id in payload:
                stream = self._streams.pop(request_id, None)
                if stream is not None and engine.abort(request_id):
                    self.metrics.requests["aborted"] += 1
            self.metrics.engine = engine.stats(self._limits)  # pages were freed

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
                if stream is not None:
                    self._push(stream, ("delta", seq, delta))
            for request_id, stream in list(self._streams.items()):
                if stream.request.finished:
                    self._streams.pop(request_id)
                    out = stream.request.to_output()
                    self._record(out)
                    self._push(stream, ("done", out))
            self.metrics.engine = engine.stats(self._limits)

    def _record(self, out) -> None:
        self.metrics.requests["ok"] += 1
        m = out.metrics
        if m.ttft is not None:
            self.metrics.ttft.observe(m.ttft)
        if m.time_per_output_token is not None:
            self.metrics.tpot.observe(m.time_per_output_token)


# ------------------------------------------------------------------------------------------------
# Request parsing (OpenAI -> SamplingParams)
# ------------------------------------------------------------------------------------------------
def _check_type(body, name, types, required=False):
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"'{name}' is required", name)
        return None
    value = body[name]
    if isinstance(value, bool) and bool not in types:
        raise APIError(400, f"'{name}' must be {' or '.join(t.__name__ for t in types)}", name)
    if not isinstance(value, types):
        raise APIError(
            400,
            f"'{name}' must be {' or '.join(t.__name__ for t in types)}, "
            f"got {type(value).__name__}",
            name,
        )
    return value


def sampling_params(body: dict, chat: bool) -> SamplingParams:
    num = (int, float)
    max_tokens = _check_type(
        body,
        "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
        (int,),
    )
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    if chat:
        want = _check_type(body, "logprobs", (bool,))
        logprobs = (_check_type(body, "top_logprobs", (int,)) or 0) if want else None
        if not want and body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = _check_type(body, "logprobs", (int,))
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in stop_ids)
    ):
        raise APIError(400, "'stop_token_ids' must be a list of ints", "stop_token_ids")
    kwargs = dict(
        n=_check_type(body, "n", (int,)),
        best_of=_check_type(body, "best_of", (int,)),
        temperature=_check_type(body, "temperature", num),
        top_p=_check_type(body, "top_p", num),
        top_k=_check_type(body, "top_k", (int,)),
        min_p=_check_type(body, "min_p", num),
        presence_penalty=_check_type(body, "presence_penalty", num),
        frequency_penalty=_check_type(body, "frequency_penalty", num),
        repetition_penalty=_check_type(body, "repetition_penalty", num),
        max_tokens=max_tokens if max_tokens is not None else (None if chat else 16),
        min_tokens=_check_type(body, "min_tokens", (int,)),
        seed=_check_type(body, "seed", (int,)),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_check_type(body, "ignore_eos", (bool,)),
        skip_special_tokens=_check_type(body, "skip_special_tokens", (bool,)),
        include_stop_str_in_output=_check_type(body, "include_stop_str_in_output", (bool,)),
        logprobs=logprobs,
    )
    return kwargs


def error_from(e: JaxgenError) -> APIError:
    """Our typed input errors as OpenAI errors (400; prompts over the context say so)."""
    code = None
    if isinstance(e, InvalidPrompt) and "max_model_len" in str(e):
        code = "context_length_exceeded"
    elif isinstance(e, CapacityError):
        code = "capacity_exceeded"
    return APIError(400, str(e), code=code)


async def _json_body(request: HTTPRequest, allowed: set[str]) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if body.get("echo") or body.get("suffix"):
        raise APIError(400, "'echo' and 'suffix' are not supported", "echo")
    return body


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------
def _closing(worker):
    """Starlette lifespan: stops the engine thread when the server shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            worker.close()

    return lifespan


def create_app(
    llm, *, model_name: str = "default", api_key: str | None = None, max_waiting: int = 256
) -> Starlette:
    if llm.engine is None:
        raise ValueError("the server needs the paged engine: LLM(kv_cache='paged')")
    worker = EngineWorker(llm, max_waiting=max_waiting)

    def check_auth(request: HTTPRequest) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(
                401,
                "invalid or missing API key",
                type_="authentication_error",
                code="invalid_api_key",
            )

    def check_model(body) -> None:
        name = _check_type(body, "model", (str,))
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model '{name}' does not exist; this server serves '{model_name}'",
                "model",
                code="model_not_found",
            )

    def admit(requests) -> None:
        if worker.pending() + len(requests) > worker.max_waiting:
            raise APIError(
                503,
                f"server busy: more than {worker.max_waiting} requests queued; retry later",
                type_="server_error",
                code="overloaded",
            )

    async def run(request: HTTPRequest, requests, stream: bool, render_chunk):
        """Submits `requests` and returns their final outputs, or an SSE response of the
        chunks `render_chunk(seq, delta)` makes (None: nothing to send)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        worker.submit(requests, loop, out)
        ids = [r.request_id for r in requests]
        remaining = set(ids)
        finals = {}

        async def next_item():
            while True:
                try:
                    return await asyncio.wait_for(out.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError from None

        async def events():
            try:
                while remaining:
                    item = await next_item()
                    if item[0] == "error":
                        raise item[1]
                    if item[0] == "delta":
                        chunk = render_chunk(item[1], item[2])
                        if chunk is not None:
                            yield chunk
                    else:
                        finals[item[1].request_id] = item[1]
                        remaining.discard(item[1].request_id)
            finally:
                if remaining:  # client went away (or an error): free the pages now
                    worker.abort(remaining)

        if stream:

            async def sse():
                try:
                    async for chunk in events():
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                except JaxgenError as e:
                    yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        async for _ in events():
            pass
        return [finals[i] for i in ids]

    def usage(outs) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def completion_logprobs(tokenizer, c):
        if c.logprobs is None:
            return None
        tokens = [tokenizer.decode([t]) for t in c.token_ids]
        return {
            "tokens": tokens,
            "token_logprobs": [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)],
            "top_logprobs": [
                {tokenizer.decode([k]): v.logprob for k, v in e.items()} for e in c.logprobs
            ],
            "text_offset": [],
        }

    async def completions(request: HTTPRequest) -> Response:
        try:
            check_auth(request)
            body = await _json_body(request, COMPLETION_FIELDS)
            check_model(body)
            prompt = body.get("prompt")
            if prompt is None:
                raise APIError(400, "'prompt' is required", "prompt")
            if isinstance(prompt, str) or (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
            ):
                prompts = [prompt]
            elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
                prompts = prompt
            else:
                raise APIError(
                    400, "'prompt' must be a string, a token list, or a list of them", "prompt"
                )
            params = SamplingParams(
                **{k: v for k, v in sampling_params(body, chat=False).items() if v is not None}
            )
            requests = worker.make_requests(prompts, params)
            admit(requests)
        except APIError as e:
            worker.metrics.requests["error"] += 1
            return e.response()
        except JaxgenError as e:
            worker.metrics.requests["error"] += 1
            return error_from(e).response()
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        n = params.n
        index_of = {r.request_id: i for i, r in enumerate(requests)}

        def chunk(seq, delta):
            if not delta and not seq.finished:
                return None
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": index_of[seq.request_id] * n + seq.index,
                        "text": delta,
                        "logprobs": None,
                        "finish_reason": seq.finish_reason if seq.finished else None,
                    }
                ],
            }

        try:
            result = await run(request, requests, stream, chunk)
        except JaxgenError as e:
            return error_from(e).response()
        if stream:
            return result
        choices = []
        for i, out in enumerate(result):
            for c in out.outputs:
                choices.append(
                    {
                        "index": i * n + c.index,
                        "text": c.text,
                        "logprobs": completion_logprobs(llm.tokenizer, c),
                        "finish_reason": c.finish_reason,
                    }
                )
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": usage(result),
            }
        )

    async def chat_completions(request: HTTPRequest) -> Response:
        try:
            check_auth(request)
            body = await _json_body(request, CHAT_FIELDS)
            check_model(body)
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise APIError(
                    400,
                    "'messages' must be a non-empty list of {role, content} "
                    "objects with string content",
                    "messages",
                )
            kwargs = sampling_params(body, chat=True)
            if kwargs["max_tokens"] is None:
                kwargs["max_tokens"] = 256
            params = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
            c_params = params
            prompt = llm.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages]
            )
            requests = worker.make_requests([prompt], params)
            admit(requests)
        except APIError as e:
            worker.metrics.requests["error"] += 1
            return e.response()
        except JaxgenError as e:
            worker.metrics.requests["error"] += 1
            return error_from(e).response()
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        started = set()

        def chunk(seq, delta):
            choice = {"index": seq.index, "delta": {}, "logprobs": None, "finish_reason": None}
            if seq.index not in started:
                started.add(seq.index)
                choice["delta"]["role"] = "assistant"
            if delta:
                choice["delta"]["content"] = delta
            if seq.finished:
                choice["finish_reason"] = seq.finish_reason
            if not choice["delta"] and not seq.finished:
                return None
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [choice],
            }

        try:
            result = await run(request, requests, stream, chunk)
        except JaxgenError as e:
            return error_from(e).response()
        if stream:
            return result
        out = result[0]
        choices = []
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                tok = llm.tokenizer
                logprobs = {
                    "content": [
                        {
                            "token": tok.decode([t]),
                            "logprob": e[t].logprob,
                            "top_logprobs": [
                                {"token": tok.decode([k]), "logprob": v.logprob}
                                for k, v in sorted(e.items(), key=lambda kv: kv[1].rank)
                                if v.rank <= (c_params.logprobs or 0)
                            ],
                        }
                        for t, e in zip(c.token_ids, c.logprobs, strict=True)
                    ]
                }
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": usage(result),
            }
        )

    async def models(request: HTTPRequest) -> Response:
        try:
            check_auth(request)
        except APIError as e:
            return e.response()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "jaxgen",
                        "max_model_len": llm.engine_cfg.max_model_len,
                    }
                ],
            }
        )

    async def health(request: HTTPRequest) -> Response:
        return PlainTextResponse("ok")

    async def metrics(request: HTTPRequest) -> Response:
        return PlainTextResponse(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=_closing(worker),
    )
    app.state.worker = worker
    return app


def serve(llm, *, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    import uvicorn

    uvicorn.run(create_app(llm, **kwargs), host=host, port=port, log_level="info")
