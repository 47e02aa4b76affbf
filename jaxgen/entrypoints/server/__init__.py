"""The OpenAI-compatible server (`jaxgen serve`): `app` (routes and handlers), `worker` (the
engine thread); the wire format it shares with batch jobs is `entrypoints.protocol`."""

from jaxgen.entrypoints.server.app import create_app, serve

__all__ = ["create_app", "serve"]
