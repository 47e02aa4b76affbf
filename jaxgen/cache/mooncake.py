"""The Mooncake Store tier (Qin et al., "Mooncake: A KVCache-centric Disaggregated
Architecture for LLM Serving", FAST 2025): KV blocks in a distributed pool of host memory that
every engine pointed at the same `mooncake_master` shares, across hosts and restarts.

Needs the `mooncake` extra (`mooncake-transfer-engine-non-cuda` on CPU machines; it loads
`libibverbs` even for TCP), imported only when a tier is made. Blocks travel as
`tiers.encode_block` bytes, checked on the way back like the disk tier's files.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import socket
import time

from jaxgen.cache.tiers import Block, TierStats, block_bytes, decode_block, encode_block

INSTALL_HINT = (
    "install jaxgen's `mooncake` extra (pip install 'jaxgen[mooncake]', which brings "
    "mooncake-transfer-engine-non-cuda; GPU machines: mooncake-transfer-engine) and Debian's "
    "libibverbs1"
)


class MooncakeUnavailable(ValueError):
    """Mooncake's Python package or programs are missing, or did not start (a ValueError, as
    jaxgen's typed errors are: the command line shows the message; the engine re-raises it as
    a JaxgenError)."""


log = logging.getLogger(__name__)


class MooncakeTier:
    """Blocks in a Mooncake Store (`mooncake_master` plus the memory segments its clients
    mount): shared by every engine pointed at the same master, on any host, and kept after an
    engine exits as long as the segment holding them lives (a `mooncake_client` storage
    process, or another engine).

    `config`: Mooncake's own client configuration (the JSON file vLLM's and SGLang's Mooncake
    connectors read; `mooncake_config(...)` checks it): `master_server_address`,
    `metadata_server`, `local_hostname`, and optionally `global_segment_size` (bytes this
    engine lends the store; 0 with a separate storage process), `local_buffer_size`,
    `protocol` ("tcp", "rdma", ...), `device_name`.

    Values are `encode_block`'s bytes under `jaxgen/<fingerprint>/<key>`; a value that fails
    its check is removed and is a miss with a warning. The store answers on a worker thread: a
    call that errors (master down) or takes longer than `timeout_s` (master stalled) marks the
    tier down for `retry_after_s`, during which every lookup is a miss and every write is
    skipped at once (the engine recomputes; one warning per outage). Memory is bounded by the
    store's segments (the master evicts); a write the store has no room for is skipped.
    """

    name = "mooncake"
    slow = True  # network reads: prefetched on a background thread
    bytes = None  # the store is shared: this engine does not know how much it holds

    def __init__(
        self,
        config: dict,
        fingerprint: str,
        *,
        timeout_s: float = 5.0,
        retry_after_s: float = 30.0,
        client=None,
    ):
        self.config = mooncake_config(config)
        self.fingerprint = fingerprint
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.stats = TierStats()
        self.failures = 0  # calls that errored or timed out
        self._down_until = 0.0
        self._pending = None  # a call still running on the worker after its timeout
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mooncake")
        if client is None:
            # Mooncake's C++ logs go to stderr; keep its errors only.
            os.environ.setdefault("GLOG_minloglevel", "2")
            c = self.config
            # The client's setup retries an absent master for ~90 s holding the GIL: check the
            # master's port first, so a wrong address fails now.
            _check_reachable(c["master_server_address"], "master_server_address")
            try:
                from mooncake.store import MooncakeDistributedStore  # the `mooncake` extra
            except ImportError as e:
                self._worker.shutdown(wait=False)
                raise MooncakeUnavailable(f"the Mooncake tier needs {INSTALL_HINT} ({e})") from e
            client = MooncakeDistributedStore()
            code = self._call(
                client.setup,
                c["local_hostname"],
                c["metadata_server"],
                c["global_segment_size"],
                c["local_buffer_size"],
                c["protocol"],
                c["device_name"],
                c["master_server_address"],
            )
            if code != 0:
                self._worker.shutdown(wait=False)
                raise ConnectionError(
                    f"Mooncake store setup failed (code {code}) for master "
                    f"{c['master_server_address']} and metadata server {c['metadata_server']}: "
                    "is mooncake_master running there (with its metadata server)?"
                )
        self._client = client

    def _key(self, key: int) -> str:
        return f"jaxgen/{self.fingerprint}/{key & 0xFFFFFFFFFFFFFFFF:016x}"

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _call(self, fn, *args):
        """`fn(*args)` on the worker thread; raises ConnectionError after `timeout_s`."""
        if self._pending is not None and not self._pending.done():
            raise ConnectionError("an earlier call is still waiting for the store")
        future = self._worker.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._pending = future
            raise ConnectionError(f"no answer within {self.timeout_s:g} s") from None

    def _fail(self, what: str, why) -> None:
        self.failures += 1
        if not self.down:
            log.warning(
                "KV Mooncake tier: %s failed (%s): the store at %s is treated as down for %g s "
                "(lookups miss, the engine recomputes)",
                what,
                why,
                self.config["master_server_address"],
                self.retry_after_s,
            )
        self._down_until = time.monotonic() + self.retry_after_s

    def _exists(self, key: int) -> bool:
        if self.down:
            return False
        try:
            code = self._call(self._client.is_exist, self._key(key))
        except ConnectionError as e:
            self._fail("a lookup", e)
            return False
        if code < 0:
            self._fail("a lookup", f"code {code}")
            return False
        return code == 1

    def __contains__(self, key: int) -> bool:
        return self._exists(key)

    def get(self, key: int) -> Block | None:
        if self.down:
            self.stats.misses += 1
            return None
        try:
            data = self._call(self._client.get, self._key(key))
        except ConnectionError as e:
            self._fail("a read", e)
            data = b""
        if not data:  # absent, evicted by the master since the lookup, or the store failed
            self.stats.misses += 1
            return None
        try:
            block = decode_block(bytes(data), self.fingerprint, key)
        except ValueError as e:
            log.warning("KV Mooncake tier: bad block %s (%s): recomputing it", self._key(key), e)
            self.stats.bad += 1
            self.stats.misses += 1
            try:
                self._call(self._client.remove, self._key(key), True)  # force: past the read lease
            except ConnectionError as err:
                self._fail("removing a bad block", err)
            return None
        self.stats.hits += 1
        self.stats.bytes_out += block_bytes(block)
        return block

    def put(self, key: int, block: Block) -> None:
        if self.down:
            return
        data = encode_block(self.fingerprint, key, block)
        try:
            code = self._call(self._client.put, self._key(key), data)
        except ConnectionError as e:
            self._fail("a write", e)
            return
        if code != 0:
            if code <= -900:  # RPC_FAIL, RPC_TIMEOUT, ...: the master is not answering
                self._fail("a write", f"code {code}")
            else:  # no room in the segments (or the key is being written): not stored
                self.stats.rejected += 1
            return
        self.stats.puts += 1
        self.stats.bytes_in += len(data)

    def close(self) -> None:
        """Unmounts this engine's segment (in the background: a dead master makes the client
        retry for seconds) and stops the worker."""
        client, self._client = self._client, None
        if client is not None:
            self._worker.submit(client.close)
        self._worker.shutdown(wait=False)


def _check_reachable(address: str, what: str, timeout_s: float = 3.0) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(
            f"Mooncake {what} {address!r} does not answer ({e}): is mooncake_master running "
            "there (with its metadata server)?"
        ) from None


def mooncake_config(config) -> dict:
    """Mooncake's client configuration, from a dict or the path of its JSON file, checked and
    with defaults filled in; ValueError naming what to change."""
    config = _load_config(config, "kv_mooncake")
    out = {
        "global_segment_size": 512 << 20,
        "local_buffer_size": 64 << 20,
        "protocol": "tcp",
        "device_name": "",
        **config,
    }
    missing = [k for k in ("master_server_address", "metadata_server", "local_hostname")
               if not isinstance(out.get(k), str) or not out[k]]  # fmt: skip
    if missing:
        raise ValueError(
            f"the Mooncake config needs {', '.join(missing)} (e.g. master_server_address="
            "'127.0.0.1:50051', metadata_server='http://127.0.0.1:8080/metadata', "
            "local_hostname='127.0.0.1')"
        )
    for k in ("global_segment_size", "local_buffer_size"):
        out[k] = _size(out[k], k)
    known = {"master_server_address", "metadata_server", "local_hostname", "global_segment_size",
             "local_buffer_size", "protocol", "device_name"}  # fmt: skip
    unknown = sorted(set(out) - known)
    if unknown:
        raise ValueError(f"unknown Mooncake config keys {unknown}: the known ones are "
                         f"{sorted(known)}")  # fmt: skip
    return out


def _load_config(config, option: str) -> dict:
    """A Mooncake config dict, or the one in the JSON file at that path."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the Mooncake config {config!r}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(
            f"{option} must be a dict or the path of Mooncake's JSON config, got {config!r}"
        )
    return config


def _size(value, name: str) -> int:
    """Bytes from an int or a string such as "512MB" / "4 GB" (Mooncake's config style)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("b").removesuffix("i")
        scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(text[-1:], 1)
        number = text[:-1] if scale > 1 else text
        try:
            return int(float(number) * scale)
        except ValueError:
            pass
    raise ValueError(f"Mooncake config {name} must be bytes (an int >= 0 or e.g. '512MB'), "
                     f"got {value!r}")  # fmt: skip
