"""The front end of a multi-instance deployment: `jaxgen serve --role router`.

An OpenAI-compatible server with no model, in one of two layouts:

- **Disaggregated** (DistServe; vLLM's and SGLang's prefill/decode proxies): `--prefill URL...
  --decode URL...`. Each /v1/completions or /v1/chat/completions request goes first to a
  prefill instance as the same request with `max_tokens=1` and `kv_transfer_params:
  {"do_remote_decode": true}` (`jaxgen serve --role prefill`: its engine writes the prompt's
  KV pages down its tiers before it answers), then to a decode instance (`--role decode`: its
  engine loads the prompt's pages into its own pool and decodes), whose answer or token stream
  the client gets. The pages move one of two ways: with `--kv-transfer` the prefill answer's
  `kv_transfer_params` say where its transfer engine holds them and the router hands those to
  the decode instance, which reads them straight out of the prefill instance's registered
  memory (`cache.transfer`); with `--kv-mooncake` they go through a shared Mooncake Store.
  Either way each block is checked like every tier block (checksum, model/config fingerprint,
  chain hash, size); a page that fails the check is recomputed by the decode instance, never
  used.
- **Colocated instances**: `--instance URL...`, each running whole requests.

Placement is cache-aware, as Mooncake's conductor places requests: where a role has more than
one live instance, the router asks each (`POST .../kv_lookup`, the request's own body) how many
leading prompt tokens it holds cached (device pool or its KV tiers) and how many tokens of work
it has queued, and picks the best `cached - load_weight * pending`
(`engine.sched.router.prefix_scores`, the in-process router's rule); ties and instances that do
not answer the lookup go by fewest requests in flight. Faults: an instance that refuses the
connection or answers 5xx is marked down for `retry_after_s` and the request is retried on
another instance of the role (a decode retry finds the same pages in the store); with none left
the client gets a 503 naming the role. An instance that dies mid-stream ends the stream with an
error event. A client that disconnects closes the connection to its instance, which aborts the
request and frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxgen.engine.sched.router import prefix_scores
from jaxgen.errors import JaxgenError


class RouterError(JaxgenError):
    """A router given no instances, or a malformed instance URL."""


@dataclasses.dataclass
class Instance:
    url: str  # http://host:port (no /v1)
    role: str  # "prefill", "decode", or "both" (a colocated instance)
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    down_until: float = 0.0

    @property
    def down(self) -> bool:
        return time.monotonic() < self.down_until


# On a disaggregated answer: the seconds the prompt's prefill hop took, from the router's
# first try at a prefill instance to its answer (queue, prefill, writing the KV pages; retries).
PREFILL_HEADER = "x-jaxgen-prefill-seconds"


class NoInstance(Exception):
    """Every instance of a role is down or failed this request."""


class DisaggRouter:
    def __init__(self, prefill: list[str], decode: list[str], *, instances: list[str] = (),
                 retry_after_s: float = 5.0, timeout_s: float = 600.0, load_weight: float = 1.0,
                 prefix_aware: bool = True, lookup_timeout_s: float = 2.0):  # fmt: skip
        if instances and (prefill or decode):
            raise RouterError(
                "give the router either --instance URLs (colocated instances) or --prefill and "
                "--decode URLs (disaggregated), not both"
            )
        if not instances and (not prefill or not decode):
            raise RouterError(
                "the router needs at least one --prefill and one --decode URL (disaggregated) "
                "or --instance URLs (colocated)"
            )
        if load_weight < 0:
            raise RouterError(f"load_weight must be >= 0, got {load_weight}")
        self.instances = (
            [Instance(_base(u), "prefill") for u in prefill]
            + [Instance(_base(u), "decode") for u in decode]
            + [Instance(_base(u), "both") for u in instances]
        )
        self.disaggregated = not instances
        self.retry_after_s = retry_after_s
        self.timeout_s = timeout_s
        self.load_weight = load_weight
        self.prefix_aware = prefix_aware
        self.lookup_timeout_s = lookup_timeout_s
        self.client = None  # httpx.AsyncClient, made in the app's event loop
        self.counts = {"requests": 0, "errors": 0, "retries": 0, "lookups": 0,
                       "prefix_routed": 0, "cached_tokens": 0, "transfers": 0}  # fmt: skip
        self.prefill_seconds = 0.0  # prefill round trips (compute + writing the KV pages)
        self.prefill_done = 0

    def live(self, role: str, tried: set[str]) -> list[Instance]:
        return [i for i in self.instances if i.role == role and not i.down and i.url not in tried]

    def pick(self, role: str, tried: set[str], scores: dict | None = None) -> Instance:
        """The live instance of `role` with the best prefix score (`scores`: url -> score, from
        `lookup`), then the fewest requests in flight."""
        live = self.live(role, tried)
        if not live:
            raise NoInstance(role)
        scores = scores or {}
        return min(
            live,
            key=lambda i: (i.url not in scores, -scores.get(i.url, 0.0), i.in_flight, i.requests),
        )

    def claim(self, role: str, tried: set[str], scores: dict | None = None) -> Instance:
        """`pick`, counted as tried and in flight."""
        inst = self.pick(role, tried, scores)
        tried.add(inst.url)
        inst.in_flight += 1
        inst.requests += 1
        return inst

    async def lookup(self, role: str, path: str, body: dict, headers: dict) -> dict:
        """{url: (cached tokens, score)} of the live instances of `role` that answered the
        request's kv_lookup in time; empty with fewer than two of them (nothing to choose). An
        instance that refuses the connection is marked down; one that is slow is only left
        out of the ranking."""
        import httpx

        live = self.live(role, set())
        if not self.prefix_aware or len(live) < 2:
            return {}
        self.counts["lookups"] += 1

        async def ask(inst):
            try:
                r = await self.client.post(
                    inst.url + path + "/kv_lookup",
                    json=body,
                    headers=headers,
                    timeout=self.lookup_timeout_s,
                )
            except httpx.ConnectError:
                self.fail(inst)
                return None
            except httpx.HTTPError:
                return None
            if r.status_code != 200:
                return None
            answer = r.json()
            return sum(answer["cached_tokens"]), answer["pending_tokens"]

        answers = await asyncio.gather(*(ask(i) for i in live))
        got = [(i.url, a) for i, a in zip(live, answers, strict=True) if a is not None]
        scores = prefix_scores([a[0] for _, a in got], [a[1] for _, a in got], self.load_weight)
        return {url: (a[0], score) for (url, a), score in zip(got, scores, strict=True)}

    async def choose(self, role, path, body, headers, tried: set[str]) -> Instance:
        """`claim` after a lookup (cache-aware placement)."""
        found = await self.lookup(role, path, body, headers)
        inst = self.claim(role, tried, {url: score for url, (_, score) in found.items()})
        cached = found.get(inst.url, (0, 0.0))[0]
        if cached:
            self.counts["prefix_routed"] += 1
            self.counts["cached_tokens"] += cached
        return inst

    def fail(self, inst: Instance) -> None:
        inst.failures += 1
        inst.down_until = time.monotonic() + self.retry_after_s
        self.counts["retries"] += 1

    def headers(self, request: HTTPRequest) -> dict:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def prefill(
        self, path: str, body: dict, headers: dict
    ) -> tuple[Response | None, dict, float]:
        """Runs the prompt on a prefill instance: (None, what the decode request carries: the
        instance's `kv_transfer_params`, where its transfer engine holds the prompt's pages,
        if it has one, the seconds from the router's first try to the answer), or (the response
        to give the client, {}, those seconds) when the instance rejected the request itself
        (4xx)."""
        import httpx

        pre = {
            k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")
        }
        pre.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
        tried: set[str] = set()
        start = time.perf_counter()
        while True:
            if tried:  # a retry: the lookup's ranking is stale, go by load
                inst = self.claim("prefill", tried)
            else:
                inst = await self.choose("prefill", path, pre, headers, tried)
            t0 = time.perf_counter()
            try:
                r = await self.client.post(inst.url + path, json=pre, headers=headers)
            except httpx.HTTPError:
                self.fail(inst)
                continue
            finally:
                inst.in_flight -= 1
            if r.status_code >= 500:
                self.fail(inst)
                continue
            hop = time.perf_counter() - start
            if r.status_code != 200:
                return Response(r.content, r.status_code, media_type="application/json"), {}, hop
            self.prefill_seconds += time.perf_counter() - t0
            self.prefill_done += 1
            transfer = r.json().get("kv_transfer_params")
            if transfer:
                self.counts["transfers"] += 1
                return None, {"kv_transfer_params": transfer}, hop
            return None, {}, hop

    async def forward(self, request: HTTPRequest) -> Response:
        """/v1/completions and /v1/chat/completions."""
        import httpx

        self.counts["requests"] += 1
        path = request.url.path
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            body.pop("kv_transfer_params", None)  # between this router and its instances only
        except ValueError as e:
            self.counts["errors"] += 1
            return _error(400, f"request body is not a JSON object: {e}")
        headers = self.headers(request)
        role = "decode" if self.disaggregated else "both"
        timing = {}
        try:
            if self.disaggregated:
                rejected, transfer, hop = await self.prefill(path, body, headers)
                if rejected is not None:
                    self.counts["errors"] += 1
                    return rejected
                body = {**body, **transfer}
                timing[PREFILL_HEADER] = f"{hop:.6f}"
            tried: set[str] = set()
            while True:
                if tried:
                    inst = self.claim(role, tried)
                else:
                    inst = await self.choose(role, path, body, headers, tried)
                req = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
                try:
                    upstream = await self.client.send(req, stream=True)
                except httpx.HTTPError:
                    inst.in_flight -= 1
                    self.fail(inst)
                    continue
                if upstream.status_code >= 500:
                    await upstream.aclose()
                    inst.in_flight -= 1
                    self.fail(inst)
                    continue
                return self.relay(upstream, inst, timing)
        except NoInstance as e:
            self.counts["errors"] += 1
            return _error(503, f"no {_named(e.args[0])} answered; retry later", "server_error")

    def relay(self, upstream, inst: Instance, headers: dict) -> Response:
        """The decode instance's answer, streamed through as it comes, with `headers` added."""
        import httpx

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the instance died mid-answer
                self.counts["errors"] += 1
                self.fail(inst)
                msg = {"error": {"message": f"{_named(inst.role)} failed mid-stream: {e!r}"}}
                yield f"data: {json.dumps(msg)}\n\n".encode()
            finally:
                inst.in_flight -= 1
                await upstream.aclose()  # a client gone: the decode instance aborts the request

        media = upstream.headers.get("content-type", "application/json")
        return StreamingResponse(
            body(), status_code=upstream.status_code, media_type=media, headers=headers
        )

    async def models(self, request: HTTPRequest) -> Response:
        import httpx

        tried: set[str] = set()
        role = "decode" if self.disaggregated else "both"
        while True:
            try:
                inst = self.pick(role, tried)
            except NoInstance:
                return _error(503, f"no {_named(role)} answered; retry later", "server_error")
            tried.add(inst.url)
            try:
                r = await self.client.get(inst.url + "/v1/models", headers=self.headers(request))
            except httpx.HTTPError:
                self.fail(inst)
                continue
            return Response(r.content, r.status_code, media_type="application/json")

    async def health(self, request: HTTPRequest) -> Response:
        roles = ("prefill", "decode") if self.disaggregated else ("both",)
        missing = [r for r in roles if not any(i.role == r and not i.down for i in self.instances)]
        if not missing:
            return PlainTextResponse("ok")
        return PlainTextResponse(
            "no live " + ", ".join(_named(r) for r in missing), status_code=503
        )

    async def metrics(self, request: HTTPRequest) -> Response:
        lines = []
        for key, value in self.counts.items():
            name = f"jaxgen_router_{key}_total"
            lines += [f"# TYPE {name} counter", f"{name} {float(value)}"]
        lines += ["# TYPE jaxgen_router_prefill_seconds summary",
                  f"jaxgen_router_prefill_seconds_sum {self.prefill_seconds}",
                  f"jaxgen_router_prefill_seconds_count {float(self.prefill_done)}"]  # fmt: skip
        for field, kind in (("in_flight", "gauge"), ("requests", "counter"),
                            ("failures", "counter")):  # fmt: skip
            name = f"jaxgen_router_instance_{field}" + ("_total" if kind == "counter" else "")
            lines.append(f"# TYPE {name} {kind}")
            lines += [f'{name}{{role="{i.role}",url="{i.url}"}} {float(getattr(i, field))}'
                      for i in self.instances]  # fmt: skip
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _named(role: str) -> str:
    return "instance" if role == "both" else f"{role} instance"


def _base(url: str) -> str:
    url = url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise RouterError(f"instance URL {url!r} must start with http:// or https://")
    return url


def _error(status: int, message: str, type_: str = "invalid_request_error") -> Response:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status)


def create_router_app(prefill: list[str], decode: list[str], **kwargs) -> Starlette:
    """The router's app: `prefill` and `decode` URLs (disaggregated), or both empty and
    `instances=[...]` (colocated); the other keywords are `DisaggRouter`'s."""
    import httpx

    router = DisaggRouter(prefill, decode, **kwargs)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        router.client = httpx.AsyncClient(timeout=router.timeout_s, limits=limits)
        try:
            yield
        finally:
            await router.client.aclose()

    app = Starlette(
        routes=[
            Route("/v1/completions", router.forward, methods=["POST"]),
            Route("/v1/chat/completions", router.forward, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/health", router.health, methods=["GET"]),
            Route("/metrics", router.metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = router
    return app


def serve_router(prefill: list[str], decode: list[str], *, host: str = "127.0.0.1",
                 port: int = 8000, **kwargs) -> None:  # fmt: skip
    import uvicorn

    from jaxgen.entrypoints.http import KEEP_ALIVE_S

    app = create_router_app(prefill, decode, **kwargs)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_keep_alive=KEEP_ALIVE_S)


async def _wait_healthy(urls: list[str], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url in urls:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(_base(url) + "/health")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not healthy after {timeout_s:g} s")
                await asyncio.sleep(0.2)


def wait_healthy(urls: list[str], timeout_s: float = 600.0) -> None:
    """Blocks until every server answers /health with 200."""
    asyncio.run(_wait_healthy(urls, timeout_s))
