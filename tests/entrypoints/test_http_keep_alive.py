"""jaxgen's HTTP servers keep idle connections open longer than clients pool them, so a pooled
connection is never reused at the moment the server closes it (a disaggregation benchmark lost
streamed requests to httpx.ReadError at ~0.15 req/s, where clients sat idle ~5 s between
requests: httpx's pool and uvicorn's default both keep 5 s)."""

import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxgen.bench.serve_load import ServerThread, free_port
from jaxgen.entrypoints.http import KEEP_ALIVE_S


def test_an_idle_connection_outlives_the_clients_pool():
    async def port(request):
        return JSONResponse({"client_port": request.client.port})

    app = Starlette(routes=[Route("/v1/port", port)])
    with (
        ServerThread(app, free_port()) as url,
        httpx.Client(limits=httpx.Limits(keepalive_expiry=KEEP_ALIVE_S - 5)) as client,
    ):
        first = client.get(f"{url}/port").json()["client_port"]
        time.sleep(6.5)  # longer than uvicorn's default keep-alive (5 s)
        second = client.get(f"{url}/port").json()["client_port"]
    assert second == first  # the same connection: the server had not closed it


def test_servers_take_the_shared_keep_alive(monkeypatch):
    from jaxgen.entrypoints.disagg import router
    from jaxgen.entrypoints.server import app

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(app, "create_app", lambda llm, **kw: "app")
    app.serve(None)
    router.serve_router(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    assert [c["timeout_keep_alive"] for c in calls] == [KEEP_ALIVE_S] * 2
    assert KEEP_ALIVE_S > httpx.Limits().keepalive_expiry
