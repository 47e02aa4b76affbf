"""The server's controls for a training loop in another process (`LLM.update_weights`,
`pause`, `sleep` over HTTP; the names of vLLM's and SGLang's routes):

    POST /update_weights {"path": orbax checkpoint or safetensors directory}
                                          -> {"weights_version", "load_s", "update_s"}
    GET  /weights_version                 -> {"weights_version"}
    POST /pause {"mode": "finish" | "abort" | "keep"}  -> {"paused", "aborted": [ids]}
    POST /resume                          -> {"paused": null}
    POST /sleep {"level": 1 | 2}          -> {"level", "device_bytes_before", "device_bytes_after"}
    POST /wake_up                         -> {"device_bytes_before", "device_bytes_after"}
    GET  /is_sleeping                     -> {"is_sleeping", "level"}

Every change runs on the engine thread between steps (`EngineWorker.call`); requests that
arrive while the engine is paused or asleep queue until it resumes or wakes (a pause in
"abort" mode refuses them). Bad input answers 400 with the typed error's message.
"""

from __future__ import annotations

import asyncio
import time

import jax.numpy as jnp
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxgen.entrypoints.protocol import APIError, check_type
from jaxgen.errors import JaxgenError, ModelLoadError


class ControlRoutes:
    """The handlers over an `OpenAIServer` (its API key check and engine worker) and the
    app's `json_body`."""

    def __init__(self, server, json_body):
        self.server = server
        self.worker = server.worker
        self.json_body = json_body  # app's body parser (app imports this module, not back)

    def routes(self) -> list[Route]:
        return [
            Route("/update_weights", self.update_weights, methods=["POST"]),
            Route("/weights_version", self.weights_version, methods=["GET"]),
            Route("/pause", self.pause, methods=["POST"]),
            Route("/resume", self.resume, methods=["POST"]),
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping, methods=["GET"]),
        ]

    async def _body(self, request: HTTPRequest, allowed: set[str]) -> dict:
        self.server.check_auth(request)
        return await self.json_body(request, allowed) if await request.body() else {}

    async def _run(self, fn):
        """`fn(llm)` on the engine thread; a typed error answers 400."""
        return await asyncio.wrap_future(self.worker.call(fn))

    async def update_weights(self, request: HTTPRequest) -> Response:
        try:
            body = await self._body(request, {"path"})
            path = check_type(body, "path", (str,))
            if not path:
                raise APIError(
                    400, "'path' must name an orbax checkpoint or a safetensors directory", "path"
                )
            llm = self.server.llm
            t0 = time.perf_counter()
            # Read on a thread of its own: the engine keeps serving meanwhile.
            _, params = await asyncio.to_thread(_load, path, llm.dtype)
            t1 = time.perf_counter()
            version = await self._run(lambda llm: llm.update_weights(params))
        except APIError as e:
            return e.response()
        except (JaxgenError, ModelLoadError) as e:
            return APIError(400, str(e), "path").response()
        return JSONResponse(
            {
                "weights_version": version,
                "load_s": t1 - t0,
                "update_s": time.perf_counter() - t1,
            }
        )

    async def weights_version(self, request: HTTPRequest) -> Response:
        try:
            self.server.check_auth(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"weights_version": await self._run(lambda llm: llm.weights_version)})

    async def pause(self, request: HTTPRequest) -> Response:
        try:
            body = await self._body(request, {"mode"})
            mode = check_type(body, "mode", (str,)) or "finish"
            aborted = await self._run(lambda llm: llm.pause(mode))
        except APIError as e:
            return e.response()
        except JaxgenError as e:
            return APIError(400, str(e), "mode").response()
        return JSONResponse({"paused": mode, "aborted": aborted})

    async def resume(self, request: HTTPRequest) -> Response:
        try:
            await self._body(request, set())
        except APIError as e:
            return e.response()
        await self._run(lambda llm: llm.resume())
        return JSONResponse({"paused": None})

    async def sleep(self, request: HTTPRequest) -> Response:
        try:
            body = await self._body(request, {"level"})
            level = check_type(body, "level", (int,))
            level = 1 if level is None else level
            report = await self._run(lambda llm: llm.sleep(level))
        except APIError as e:
            return e.response()
        except JaxgenError as e:
            return APIError(400, str(e), "level").response()
        return JSONResponse(report)

    async def wake_up(self, request: HTTPRequest) -> Response:
        try:
            await self._body(request, set())
            report = await self._run(lambda llm: llm.wake_up())
        except APIError as e:
            return e.response()
        except JaxgenError as e:
            return APIError(400, str(e)).response()
        return JSONResponse(report)

    async def is_sleeping(self, request: HTTPRequest) -> Response:
        try:
            self.server.check_auth(request)
        except APIError as e:
            return e.response()
        level = await self._run(lambda llm: llm.sleep_level)
        return JSONResponse({"is_sleeping": level > 0, "level": level})


def _load(path: str, dtype):
    from jaxgen.model import load_model

    return load_model(path, dtype=jnp.dtype(dtype).name, show_progress=False)
