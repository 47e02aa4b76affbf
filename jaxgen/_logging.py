"""The `jaxgen` logger: INFO lines ("compiling ...", "ahead of time ...", conversion) on
standard error, as vLLM prints its own, so a long compile is never silent.

Set JAXGEN_CONFIGURE_LOGGING=0 to leave logging alone (the lines then go wherever the
application's logging sends `jaxgen.*` records), or JAXGEN_LOGGING_LEVEL=WARNING to quieten it.
Nothing is configured if the `jaxgen` logger already has a handler.
"""

from __future__ import annotations

import logging
import os


def configure() -> None:
    if os.environ.get("JAXGEN_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("jaxgen")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("jaxgen: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("JAXGEN_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False
