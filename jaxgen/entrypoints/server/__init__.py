"""The OpenAI-compatible server (`jaxgen serve`): `app` (routes and handlers), `protocol` (the
wire format), `worker` (the engine thread)."""

from jaxgen.entrypoints.server.app import create_app, serve

__all__ = ["create_app", "serve"]
