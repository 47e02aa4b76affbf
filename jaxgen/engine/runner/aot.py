"""Ahead-of-time compilation of declared step buckets, and compiled executables kept across starts.

An engine declares the step shapes it expects (`compile_buckets`): each is lowered and compiled at
start-up (`jit(...).lower(...).compile()`), so the first request of that shape runs at once.
With `executable_cache`, each compiled executable is also serialized into the jaxgen cache
(`jax.experimental.serialize_executable`); a later start loads it back and skips tracing,
lowering and compiling. The file name hashes everything the executable depends on (JAX and
XLA versions, device, CPU, model config, argument shapes, dtypes and tree structure, static
arguments), so a changed input never loads a stale program.

Bucket syntax: ``prefill:T`` (one prompt of up to T tokens), ``decode:B`` or ``decode:B@C``
(B sequences decoding, C tokens of context at most; default 128).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import statistics
import tempfile
import time
import weakref

import jax

# The compile-bucket language lives with the option that takes it (`CompileConfig`).
from jaxgen.engine.config import (  # noqa: F401  (re-exported: aot.parse_buckets, ...)
    DEFAULT_BUCKETS,
    DEFAULT_DECODE_CONTEXT,
    Bucket,
    parse_buckets,
    serving_buckets,
)

log = logging.getLogger("jaxgen.aot")


class ProgramLog:
    """The step programs an engine has run. A new one compiles on its first run: a line says so
    before it starts, with what it compiles and the time it is expected to take (the median of
    the compiles measured so far, ahead of time or on first use).

    Call it with a program's key (a name, then its static shape) before running the program; it
    returns True for a new key. Report a new program's first-run seconds with `compiled`."""

    def __init__(self):
        self.keys: set[tuple] = set()
        self.seconds: list[float] = []

    @staticmethod
    def describe(key: tuple) -> str:
        name, *rest = key
        parts = [r.describe() if hasattr(r, "describe") else str(r) for r in rest]
        return f"{name} {' '.join(parts)}".strip()

    def expected(self) -> str:
        if not self.seconds:
            return "no compile time measured yet"
        return f"about {statistics.median(self.seconds):.1f} s (median of {len(self.seconds)})"

    def __call__(self, *key) -> bool:
        if key in self.keys:
            return False
        self.keys.add(key)
        log.info("compiling %s: a new step shape, %s", self.describe(key), self.expected())
        return True

    def known(self, key: tuple, seconds: float | None = None) -> None:
        """A program compiled (or loaded) ahead of time: no line when it first runs."""
        self.keys.add(key)
        if seconds is not None:
            self.seconds.append(seconds)

    def compiled(self, seconds: float) -> None:
        self.seconds.append(seconds)


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name and feature flags (XLA:CPU code depends on both); read once."""
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags") and key not in found:
                    found[key] = line.split(":", 1)[1].strip()
                if len(found) == 2:
                    break
    except OSError:
        pass
    return " | ".join(found.values()) or platform.processor()


@functools.cache
def source_digest() -> str:
    """A hash of jaxgen's own source files: an executable traced from other code (an upgrade,
    an edit in a checkout) is never loaded, even where every shape is the same."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:16]


def executable_key(name: str, args, statics: dict) -> str:
    """A hash of everything a compiled executable of `name` depends on."""
    import jaxlib

    device = jax.devices()[0]
    # JAX 0.12 deprecates the class for a factory (pytest turns the warning into an error).
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    default = make(device) if make else jax.sharding.SingleDeviceSharding(device)
    leaves, treedef = jax.tree.flatten(args)
    described = {
        "name": name,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": device.platform,
        "platform_version": getattr(device.client, "platform_version", ""),
        "device_kind": device.device_kind,
        "num_devices": jax.device_count(),
        "cpu": _cpu_model(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "tree": str(treedef),
        # A host array runs where a committed one on the default device does: one program.
        "leaves": [
            (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None) or default))
            for x in leaves
        ],
        "statics": {k: repr(v) for k, v in sorted(statics.items())},
        "source": source_digest(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def _without_persistent_cache():
    """XLA:CPU cannot re-serialize an executable that JAX's persistent compilation cache loaded
    (the copy misses the program's fused functions: "Function ... not found" when it runs), so
    the programs saved here are compiled afresh."""
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    if enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
    try:
        yield
    finally:
        if enabled:
            jax.config.update("jax_enable_compilation_cache", True)
            compilation_cache.reset_cache()


def _devices(args) -> list:
    """The devices the arguments live on (the executable runs there), in id order."""
    found = {}
    for x in jax.tree.leaves(args):
        if isinstance(x, jax.Array):
            found.update({d.id: d for d in x.devices()})
    return [found[i] for i in sorted(found)] or jax.devices()[:1]


def compile_or_load(jitted, name: str, args, statics: dict, directory: str | None):
    """Compiles `jitted(*args, **statics)` ahead of time, or loads the executable an earlier
    start serialized into `directory`, or takes the one an engine of this process already has
    (same program, shapes and devices: an executable does not hold the weights it runs on).
    Returns (compiled, {"seconds", "source"}): source is "compiled", "loaded" or "memory"."""
    from jax.experimental import serialize_executable as se

    t0 = time.perf_counter()
    key = executable_key(name, args, statics)
    shared = _IN_PROCESS.get(key)
    if shared is not None:
        return shared, {"seconds": time.perf_counter() - t0, "source": "memory"}
    compiled, info = _compile_or_load(jitted, name, args, statics, directory, key, t0, se)
    _IN_PROCESS[key] = compiled
    return compiled, info


# Executables that engines of this process hold, by `executable_key`: an engine started while
# another of the same shapes lives (tests, benchmarks, replicas) compiles nothing. Weak: an
# executable goes with the last engine holding it (XLA:CPU maps each program's code into
# regions of its own, and a process has a limit on them: see tests/conftest.py).
_IN_PROCESS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _compile_or_load(jitted, name, args, statics, directory, key, t0, se):
    path = None
    if directory is not None:
        path = os.path.join(directory, key + ".jaxexe")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    payload, in_tree, out_tree = pickle.load(f)
                compiled = se.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=_devices(args)
                )
                return compiled, {"seconds": time.perf_counter() - t0, "source": "loaded"}
            except Exception as e:  # a damaged or foreign file: compile afresh and replace it
                log.warning("cannot load executable %s (%s); compiling", path, e)
    with _without_persistent_cache() if path is not None else contextlib.nullcontext():
        compiled = jitted.lower(*args, **statics).compile()
    info = {"seconds": time.perf_counter() - t0, "source": "compiled"}
    if path is not None:
        try:
            os.makedirs(directory, exist_ok=True)
            blob = pickle.dumps(se.serialize(compiled))
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: a concurrent start never reads half a file
        except Exception as e:  # serialization is an optimisation; the engine runs without it
            log.warning("cannot serialize executable %s: %s", name, e)
    return compiled, info
