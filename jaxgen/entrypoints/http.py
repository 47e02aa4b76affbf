"""Settings shared by jaxgen's HTTP servers (`jaxgen serve`, the disaggregation router)."""

from __future__ import annotations

import json

from jaxgen.entrypoints.protocol import APIError, check_fields

# Seconds uvicorn keeps an idle keep-alive connection open. Clients keep idle connections in a
# pool (httpx: 5 s, uvicorn's own default here); at equal times a client can send a request on
# a connection at the moment the server closes it, and that request is lost (httpx.ReadError
# on a streamed completion). A server that waits longer than its clients' pools avoids it.
KEEP_ALIVE_S = 75


async def json_body(request, allowed: set[str]) -> dict:
    """A request's JSON object body with only the fields in `allowed` (`check_fields`); a 400
    `APIError` for anything else."""
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    return check_fields(body, allowed)
