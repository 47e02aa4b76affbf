"""OpenAI-compatible HTTP server: `jaxgen serve`.

One background thread (`worker.EngineWorker`) owns the continuous-batching engine and runs its
loop; each HTTP handler validates a request (through the engine's processor, as
`LLM.generate` does), hands it to the thread and awaits its outputs on a per-request queue. A
client that disconnects has its request aborted and its pages freed. Routes: POST
/v1/completions, POST /v1/chat/completions, POST /v1/responses (all with `stream: true` as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus), and vLLM's
utility routes (`server.utility`). Chat completions take tools
(`entrypoints.tool_calls`); both routes take output constraints (`protocol.structured_outputs`).

With LoRA (`LLM(enable_lora=True)`, `jaxgen serve --enable-lora`), a request's `model` names the
base model or a loaded adapter; /v1/models lists both, and POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"} change the adapters at run
time (vLLM's routes and answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxgen.entrypoints.http import json_body
from jaxgen.entrypoints.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    APIError,
    chat_choices,
    chat_request,
    check_type,
    completion_choices,
    completion_request,
    error_from,
    kv_transfer_params,
    response_body,
    running_usage,
    scored_only,
    stream_usage,
    usage,
)
from jaxgen.entrypoints.responses import (
    RESPONSES_FIELDS,
    ResponseBuilder,
    chat_body,
    echo_fields,
)
from jaxgen.entrypoints.server import utility
from jaxgen.entrypoints.server.control import ControlRoutes
from jaxgen.entrypoints.server.worker import EngineWorker
from jaxgen.entrypoints.tool_calls import ToolParser
from jaxgen.errors import JaxgenError, ModelLoadError

log = logging.getLogger(__name__)


class OpenAIServer:
    """The routes' handlers over one engine worker."""

    def __init__(
        self,
        llm,
        worker: EngineWorker,
        model_name: str,
        api_key: str | None,
        tool_parser: ToolParser,
    ):
        self.llm, self.worker = llm, worker
        self.model_name, self.api_key = model_name, api_key
        self.tool_parser = tool_parser

    # ------------------------------------------------------------------------------------------
    # Checks every route shares
    # ------------------------------------------------------------------------------------------
    def check_auth(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(
                401,
                "invalid or missing API key",
                type_="authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, body) -> tuple[str, str | None]:
        """(the model name a response names, the LoRA adapter to run or None). 404 for a model
        this server does not serve, as OpenAI answers."""
        name = check_type(body, "model", (str,))
        if name is None or name == self.model_name:
            return self.model_name, None
        if name not in self.llm.list_loras():
            served = ", ".join(f"'{m}'" for m in [self.model_name, *self.llm.list_loras()])
            raise APIError(
                404,
                f"model '{name}' does not exist; this server serves {served}",
                "model",
                code="model_not_found",
            )
        return name, name

    def admit(self, requests) -> None:
        if self.worker.pending() + len(requests) > self.worker.max_waiting:
            raise APIError(
                503,
                f"server busy: more than {self.worker.max_waiting} requests queued; retry later",
                type_="server_error",
                code="overloaded",
            )

    def check_transfer(self, params: dict | None, requests) -> None:
        """A request's `kv_transfer_params` against this instance (`cache.transfer`)."""
        if params is None:
            return
        if "blocks" in params and getattr(self.llm.engine, "kv_transfer", None) is None:
            raise APIError(
                400,
                "this instance has no KV transfer engine for 'kv_transfer_params': start it with "
                "--kv-transfer CONFIG.json (LLM(kv_transfer=...))",
                "kv_transfer_params",
            )

    async def import_kv(self, params: dict | None) -> None:
        """Reads the pages a prefill instance's answer named (`kv_transfer_params` with
        blocks) into this engine's tiers before the request is submitted; a transfer that
        fails is logged and the prompt is recomputed (never decoded from unchecked bytes)."""
        if params is None or "blocks" not in params:
            return
        try:
            await asyncio.to_thread(self.llm.engine.kv_import, params)
        except Exception as e:  # the prefill instance gone, a transport error: recompute
            log.warning("KV transfer from %s failed (%r); recomputing the prompt",
                        params["session"], e)  # fmt: skip

    def rejected(self, e: Exception) -> Response:
        self.worker.metrics.requests["error"] += 1
        return (e if isinstance(e, APIError) else error_from(e)).response()

    async def run(
        self, request: HTTPRequest, requests, stream, render_chunk, usage_chunk=None, typed=False
    ):
        """Submits `requests` and returns their final outputs, or an SSE response of the
        chunks `render_chunk(seq, delta, finish_reason, num_tokens)` makes (None: nothing to
        send; the finish_reason and the count of tokens generated are the sequence's when the
        delta was made, finish_reason None before its last), ended by
        `usage_chunk(outputs)` when given (`stream_options.include_usage`). Either may make a
        list of chunks. `typed`: each chunk is a typed event (the Responses API's), sent with
        its `event:` name and no closing [DONE]."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        self.worker.submit(requests, loop, out)
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
                        chunk = render_chunk(*item[1:])
                        for c in chunk if isinstance(chunk, list) else [chunk]:
                            if c is not None:
                                yield c
                    else:
                        finals[item[1].request_id] = item[1]
                        remaining.discard(item[1].request_id)
            finally:
                if remaining:  # client went away (or an error): free the pages now
                    self.worker.abort(remaining)

        if stream:

            def line(chunk) -> str:
                name = f"event: {chunk['type']}\n" if typed else ""
                return f"{name}data: {json.dumps(chunk)}\n\n"

            async def sse():
                try:
                    async for chunk in events():
                        yield line(chunk)
                    if usage_chunk is not None:
                        last = usage_chunk([finals[i] for i in ids])
                        for chunk in last if isinstance(last, list) else [last]:
                            yield line(chunk)
                    if not typed:
                        yield "data: [DONE]\n\n"
                except JaxgenError as e:
                    error = {"message": str(e), "type": "invalid_request_error", "code": None}
                    if typed:  # the Responses API's error event
                        yield line({"type": "error", **error, "param": None})
                    else:
                        yield f"data: {json.dumps({'error': error})}\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        async for _ in events():
            pass
        return [finals[i] for i in ids]

    def usage_chunk(self, cid: str, kind: str, created: int, model: str, finals_of):
        """The last chunk of a stream asked for with `stream_options.include_usage`."""

        def chunk(outputs):
            return {
                "id": cid,
                "object": kind,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage(finals_of(outputs)),
            }

        return chunk

    async def answer(
        self, request, requests, body, with_usage, cid, created, model, kinds, chunk, choices_of,
        transfer=None, finals_of=None,
    ):  # fmt: skip
        """Runs the requests of /v1/completions or /v1/chat/completions: a stream of `chunk`s
        (ended by a usage chunk when asked), or the final body with `choices_of(outputs)`.
        `kinds`: the objects of the final body and of its chunks. `finals_of`: what the
        answer makes of the final outputs (its usage too) before anything reads them."""
        final_kind, chunk_kind = kinds
        stream = bool(body.get("stream"))
        last = None
        if with_usage:
            last = self.usage_chunk(cid, chunk_kind, created, model, finals_of or (lambda o: o))
        try:
            result = await self.run(request, requests, stream, chunk, last)
        except JaxgenError as e:
            return error_from(e).response()
        if stream:
            return result
        if finals_of is not None:
            result = finals_of(result)
        out = response_body(cid, final_kind, created, model, choices_of(result), result)
        if transfer is not None and "do_remote_decode" in transfer:
            # The prompt's pages went to the transfer tier before it finished (None: this
            # instance has no transfer engine; a decode instance then looks in its tiers).
            engine = self.llm.engine
            exported = None
            if getattr(engine, "kv_transfer", None) is not None:  # every prompt's pages
                parts = [engine.kv_export(r.prompt_ids, r.cache_salt) for r in requests]
                blocks = [b for part in parts for b in part["blocks"]]
                exported = {"session": parts[0]["session"], "blocks": blocks}
            out["kv_transfer_params"] = exported
        return JSONResponse(out)

    # ------------------------------------------------------------------------------------------
    # Routes
    # ------------------------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        try:
            self.check_auth(request)
            body = await json_body(request, COMPLETION_FIELDS)
            model, lora = self.check_model(body)
            parsed = completion_request(body)
            params = parsed.params
            usage_opts = stream_usage(body)
            transfer = kv_transfer_params(body)
            requests = self.worker.make_requests(parsed.prompts, params, lora)
            self.check_transfer(transfer, requests)
            self.admit(requests)
        except (APIError, JaxgenError) as e:
            return self.rejected(e)
        await self.import_kv(transfer)
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        n = params.n
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        echoes = {}  # request id -> its prompt's text, streamed before the first delta
        if parsed.echo:
            decode = self.llm.tokenizer.decode
            for r, prompt in zip(requests, parsed.prompts, strict=True):
                echoes[r.request_id] = prompt if isinstance(prompt, str) else decode(r.prompt_ids)
        started = set()

        def chunk(seq, delta, finish, num_tokens):
            index = index_of[seq.request_id] * n + seq.index
            if parsed.score_only:  # the one token the engine ran is not the answer's
                delta, num_tokens = "", 0
                finish = None if finish is None else "length"
            if index not in started and (delta or finish is not None):
                started.add(index)
                delta = echoes.get(seq.request_id, "") + delta
            if not delta and finish is None:
                return None
            out = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": index, "text": delta, "logprobs": None,
                             "finish_reason": finish}],
            }  # fmt: skip
            if usage_opts.continuous:
                out["usage"] = running_usage(len(seq.prompt_ids), num_tokens)
            return out

        return await self.answer(
            request,
            requests,
            body,
            usage_opts.include,
            cid,
            created,
            model,
            ("text_completion", "text_completion"),
            chunk,
            lambda result: completion_choices(self.llm.tokenizer, result, n, parsed.echo),
            transfer,
            scored_only if parsed.score_only else None,
        )

    async def chat_completions(self, request: HTTPRequest) -> Response:
        try:
            self.check_auth(request)
            body = await json_body(request, CHAT_FIELDS)
            model, lora = self.check_model(body)
            chat = chat_request(body, self.tool_parser)
            usage_opts = stream_usage(body)
            transfer = kv_transfer_params(body)
            requests = self.worker.make_requests([chat.prompt(self.llm)], chat.params, lora)
            self.check_transfer(transfer, requests)
            self.admit(requests)
        except (APIError, JaxgenError) as e:
            return self.rejected(e)
        await self.import_kv(transfer)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        started = set()
        tool_parser = chat.tool_parser
        tool_streams = {}  # choice index -> its ToolCallStream

        def chunk(seq, delta, finish, num_tokens):
            choice = {"index": seq.index, "delta": {}, "logprobs": None, "finish_reason": None}
            if seq.index not in started:
                started.add(seq.index)
                choice["delta"]["role"] = "assistant"
            if tool_parser is None:
                if delta:
                    choice["delta"]["content"] = delta
            else:
                if seq.index not in tool_streams:
                    tool_streams[seq.index] = tool_parser.stream()
                calls = tool_streams[seq.index]
                choice["delta"].update(calls.feed(delta, finish is not None))
                if finish is not None and calls.called:
                    finish = "tool_calls"
            choice["finish_reason"] = finish
            if not choice["delta"] and finish is None:
                return None
            out = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            if usage_opts.continuous:
                out["usage"] = running_usage(len(seq.prompt_ids), num_tokens)
            return out

        return await self.answer(
            request,
            requests,
            body,
            usage_opts.include,
            cid,
            created,
            model,
            ("chat.completion", "chat.completion.chunk"),
            chunk,
            lambda result: chat_choices(
                self.llm.tokenizer, result[0], chat.params.logprobs or 0, tool_parser
            ),
            transfer,
        )

    async def responses(self, request: HTTPRequest) -> Response:
        """POST /v1/responses: OpenAI's Responses API, stateless, over the chat route's parsing
        (`entrypoints.responses`)."""
        try:
            self.check_auth(request)
            body = await json_body(request, RESPONSES_FIELDS)
            chat_fields = chat_body(body)
            model, lora = self.check_model(chat_fields)
            chat = chat_request(chat_fields, self.tool_parser)
            requests = self.worker.make_requests([chat.prompt(self.llm)], chat.params, lora)
            self.admit(requests)
        except (APIError, JaxgenError) as e:
            return self.rejected(e)
        builder = ResponseBuilder(model, echo_fields(body), int(time.time()))
        calls = None if chat.tool_parser is None else chat.tool_parser.stream()

        def delta_of(text: str, finished: bool) -> dict:
            if calls is not None:
                return calls.feed(text, finished)
            return {"content": text} if text else {}

        def finish(outputs) -> list[dict]:
            (out,) = outputs
            cached = out.metrics.num_cached_prompt_tokens if out.metrics is not None else 0
            return builder.finish(out.outputs[0].finish_reason, usage(outputs), cached)

        if body.get("stream"):

            def chunk(seq, delta, finish_reason, num_tokens):
                return builder.feed(delta_of(delta, finish_reason is not None))

            try:
                return await self.run(request, requests, True, chunk, finish, typed=True)
            except JaxgenError as e:
                return error_from(e).response()
        try:
            outputs = await self.run(request, requests, False, lambda *delta: None)
        except JaxgenError as e:
            return error_from(e).response()
        builder.feed(delta_of(outputs[0].outputs[0].text, True))
        finish(outputs)
        return JSONResponse(builder.response())

    async def models(self, request: HTTPRequest) -> Response:
        try:
            self.check_auth(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": self.model_cards()})

    def model_cards(self) -> list[dict]:
        """The served model and its loaded LoRA adapters, as OpenAI describes a model."""
        base = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxgen",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.llm.engine_cfg.max_model_len,
        }
        loaded = [] if self.llm.loras is None else self.llm.loras.loaded
        adapters = [
            {**base, "id": a.name, "root": a.path, "parent": self.model_name} for a in loaded
        ]
        return [base, *adapters]

    async def load_lora_adapter(self, request: HTTPRequest) -> Response:
        try:
            self.check_auth(request)
            body = await json_body(request, {"lora_name", "lora_path"})
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
                raise APIError(400, "Both 'lora_name' and 'lora_path' must be given as strings.")
            self.worker.load_lora(name, path)
        except APIError as e:
            return e.response()
        except (JaxgenError, ModelLoadError) as e:
            return APIError(400, str(e), "lora_path").response()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: HTTPRequest) -> Response:
        try:
            self.check_auth(request)
            body = await json_body(request, {"lora_name", "lora_int_id"})
            name = check_type(body, "lora_name", (str,))
            if not name:
                raise APIError(400, "'lora_name' must be given", "lora_name")
            self.worker.unload_lora(name)
        except APIError as e:
            return e.response()
        except JaxgenError as e:
            return APIError(404, str(e), "lora_name", "NotFoundError").response()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def kv_lookup(self, request: HTTPRequest) -> Response:
        """POST /v1/completions/kv_lookup and /v1/chat/completions/kv_lookup (jaxgen's, for a
        cache-aware router: `entrypoints.disagg.router`): the body of a request the router is
        placing; the answer says how many leading tokens of each of its prompts this instance
        holds cached (device pool or its KV tiers; nothing is read or changed) and how much
        work is queued here: {"prompt_tokens": [...], "cached_tokens": [...],
        "pending_tokens": n}."""
        try:
            self.check_auth(request)
            chat = request.url.path.startswith("/v1/chat/")
            body = await json_body(request, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            _, lora = self.check_model(body)
            if chat:
                parsed = chat_request(body, self.tool_parser)
                prompts, params = [parsed.prompt(self.llm)], parsed.params
            else:
                parsed = completion_request(body)
                prompts, params = parsed.prompts, parsed.params
            requests = self.worker.make_requests(prompts, params, lora)
        except (APIError, JaxgenError) as e:
            return (e if isinstance(e, APIError) else error_from(e)).response()
        bm = self.llm.engine.bm  # read-only lookups of dicts the engine thread updates

        def cached():
            return [bm.cached_prefix_tokens(r.prompt_ids, r.cache_salt) for r in requests]

        return JSONResponse(
            {
                "prompt_tokens": [len(r.prompt_ids) for r in requests],
                "cached_tokens": await asyncio.to_thread(cached),  # a shared store answers slowly
                "pending_tokens": self.worker.pending_tokens,
            }
        )

    async def freeze_programs(self, request: HTTPRequest) -> Response:
        """POST /freeze_programs (jaxgen's; a deployment step like vLLM's /reset_prefix_cache):
        {"frozen": true} (the default) stops compiling step programs for new shapes, once a
        warm-up load has compiled them: a step then runs on the least-work compiled program
        that covers it (`Engine.freeze_programs`); {"frozen": false} resumes. Answers
        {"frozen": ..., "programs": n, "shapes": [the step programs' shapes, as the step log
        records a step's]}."""
        try:
            self.check_auth(request)
            body = await json_body(request, {"frozen"}) if await request.body() else {}
            frozen = check_type(body, "frozen", (bool,))
            frozen = True if frozen is None else frozen
        except APIError as e:
            return e.response()
        programs, shapes = await asyncio.wrap_future(self.worker.freeze_programs(frozen))
        return JSONResponse({"frozen": frozen, "programs": programs, "shapes": shapes})

    async def health(self, request: HTTPRequest) -> Response:
        return PlainTextResponse("ok")

    async def metrics(self, request: HTTPRequest) -> Response:
        return PlainTextResponse(
            self.worker.metrics.render(), media_type="text/plain; version=0.0.4"
        )


def create_app(
    llm,
    *,
    model_name: str = "default",
    api_key: str | None = None,
    max_waiting: int = 256,
    tool_call_parser: str | None = None,
    role: str | None = None,
    step_log: str | None = None,
) -> Starlette:
    """The app over a paged-engine `LLM`. `tool_call_parser`: the format of the model's tool
    calls (`tool_calls.FORMATS`); None picks it from the chat template. `role`: a disaggregated
    instance's role ("prefill", "decode"), a label on its /metrics series. `step_log`: a file
    that gets one JSON line per engine step (its seconds, rows, tokens, prefill chunks, decode
    context, whether it compiled; `metrics.step_record`), for fitting a latency model to the steps
    a served load makes (`jaxgen bench disagg`)."""
    if llm.engine is None:
        raise ValueError("the server needs the paged engine: LLM(kv_cache='paged')")
    tool_parser = ToolParser(llm.tokenizer, tool_call_parser)
    worker = EngineWorker(llm, max_waiting=max_waiting, role=role, step_log=step_log)
    server = OpenAIServer(llm, worker, model_name, api_key, tool_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app):  # stops the engine thread when the server shuts down
        try:
            yield
        finally:
            worker.close()

    app = Starlette(
        routes=[
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/completions/kv_lookup", server.kv_lookup, methods=["POST"]),
            Route("/v1/chat/completions/kv_lookup", server.kv_lookup, methods=["POST"]),
            Route("/v1/responses", server.responses, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            *utility.routes(server),
            Route("/v1/load_lora_adapter", server.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", server.unload_lora_adapter, methods=["POST"]),
            Route("/freeze_programs", server.freeze_programs, methods=["POST"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
            *ControlRoutes(server, json_body).routes(),  # weights, pause, sleep: `server.control`
        ],
        lifespan=lifespan,
    )
    app.state.worker = worker
    return app


def serve(llm, *, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    import uvicorn

    from jaxgen.entrypoints.http import KEEP_ALIVE_S

    uvicorn.run(
        create_app(llm, **kwargs),
        host=host,
        port=port,
        log_level="info",
        timeout_keep_alive=KEEP_ALIVE_S,
    )
