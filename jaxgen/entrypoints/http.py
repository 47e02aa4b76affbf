"""Settings shared by jaxgen's HTTP servers (`jaxgen serve`, the disaggregation router)."""

from __future__ import annotations

# Seconds uvicorn keeps an idle keep-alive connection open. Clients keep idle connections in a
# pool (httpx: 5 s, uvicorn's own default here); at equal times a client can send a request on
# a connection at the moment the server closes it, and that request is lost (httpx.ReadError
# on a streamed completion). A server that waits longer than its clients' pools avoids it.
KEEP_ALIVE_S = 75
