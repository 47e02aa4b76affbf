"""KV pages moved between engines by Mooncake's transfer engine (Mooncake's `TransferEngine`;
DistServe's KV transfer): a prefill instance keeps its finished prompts' pages in host memory
registered with the transfer engine, and a decode instance reads them straight out of that
memory (one-sided reads over TCP here, RDMA or NVLink where the hardware has them) into its own
registered memory, then loads them into fresh pages of its pool. No store sits in between.

The flow of one request (`entrypoints.disagg.router` drives it):

1. The prefill instance runs the prompt with `kv_write_through`: its full pages are written into
   its `TransferTier` (a bounded ring of block slots in registered memory) before it answers,
   and the answer carries `kv_transfer_params`: the tier's transfer-engine session and, per
   page of the prompt, (chain hash, address, bytes) — `TransferTier.locate`.
2. The decode instance reads those slots (`TransferTier.pull`) and checks each block like every
   tier block (`tiers.decode_block`: its own model/config fingerprint, the chain hash, sizes, a
   checksum). A block that fails — another model or page size, a slot overwritten meanwhile by
   a newer prompt, a transfer cut short — ends the chain there: the rest is recomputed, never
   decoded from wrong bytes.
3. The good blocks go into the decode instance's tiers, where admission finds them as a cached
   prefix and scatters them into the pages its block manager allocates for the request.

Memory stays bounded on both sides: each tier is a fixed buffer of slots, reused least
recently written first; the device pages are the engines' own and freed as every request's
are. Needs the `mooncake` extra (imported when a tier is made).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict

import numpy as np

from jaxgen.cache.mooncake import (
    INSTALL_HINT,
    MooncakeUnavailable,
    _check_reachable,
    _load_config,
)
from jaxgen.cache.tiers import Block, TierStats, decode_block, encode_block

log = logging.getLogger(__name__)

_KEY_DIGITS = 20  # the longest 64-bit chain hash as text: "-9223372036854775808"


def transfer_config(config) -> dict:
    """The transfer engine's part of a Mooncake configuration (a dict or the path of its JSON
    file; a store's keys may be present and are not used): `metadata_server`,
    `local_hostname`, `protocol` ("tcp", "rdma", ...), `device_name`. ValueError naming what
    to change."""
    config = _load_config(config, "kv_transfer")
    out = {"protocol": "tcp", "device_name": "", **config}
    missing = [k for k in ("metadata_server", "local_hostname")
               if not isinstance(out.get(k), str) or not out[k]]  # fmt: skip
    if missing:
        raise ValueError(
            f"the transfer engine's config needs {', '.join(missing)} (e.g. metadata_server="
            "'http://127.0.0.1:8080/metadata', local_hostname='127.0.0.1')"
        )
    return {k: out[k] for k in ("metadata_server", "local_hostname", "protocol", "device_name")}


class TransferTier:
    """Blocks in a ring of fixed-size slots of host memory registered with a Mooncake transfer
    engine: readable by other engines without this one's help (`locate` says where), and a
    host tier of this engine (`get`). `capacity_bytes` bounds the ring; a slot holds the first
    block's encoded size with room for the longest key (every full page of one model encodes to
    that size but for its key's digits)."""

    name = "transfer"
    slow = False  # this process's memory

    def __init__(self, config, fingerprint: str, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"kv_transfer_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.config = transfer_config(config)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.pulls = self.pulled_bytes = 0
        self.pull_seconds = 0.0
        self._lock = threading.Lock()
        # key -> (slot, encoded bytes), least recently written or read first
        self._slots: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._free: list[int] = []
        self.slot_bytes = self._shape = None
        self._buffer = np.zeros(capacity_bytes, np.uint8)
        self._recv = None  # registered scratch for reads from other engines
        self._recv_lock = threading.Lock()
        self._engine, self.session = _start_engine(self.config)
        self._register(self._buffer)

    @property
    def bytes(self) -> int:
        return len(self._slots) * (self.slot_bytes or 0)

    def _register(self, buffer: np.ndarray) -> None:
        code = self._engine.register_memory(buffer.ctypes.data, buffer.nbytes)
        if code != 0:
            raise ConnectionError(f"the transfer engine refused to register {buffer.nbytes} bytes")

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def _view(self, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self._buffer[start : start + self.slot_bytes]

    def put(self, key: int, block: Block) -> None:
        with self._lock:
            if key in self._slots:  # held already: no need to encode it again
                self._slots.move_to_end(key)
                return
        data = encode_block(self.fingerprint, key, block)
        with self._lock:
            if self.slot_bytes is None:
                size = len(data) - len(str(key)) + _KEY_DIGITS
                if size > self.capacity_bytes:
                    self.stats.rejected += 1
                    return
                self.slot_bytes, self._shape = size, [(a.dtype, a.shape) for a in block]
                self._free = list(range(self.capacity_bytes // self.slot_bytes))[::-1]
            if [(a.dtype, a.shape) for a in block] != self._shape:  # not a full page of this
                self.stats.rejected += 1  # model: not kept
                return
            if key in self._slots:  # written by another thread meanwhile
                return
            if not self._free:
                _, (slot, _) = self._slots.popitem(last=False)
                self._free.append(slot)
                self.stats.evictions += 1
            slot = self._free.pop()
            self._view(slot)[: len(data)] = np.frombuffer(data, np.uint8)
            self._slots[key] = (slot, len(data))
            self.stats.puts += 1
            self.stats.bytes_in += len(data)

    def get(self, key: int) -> Block | None:
        with self._lock:
            where = self._slots.get(key)
            if where is None:
                self.stats.misses += 1
                return None
            self._slots.move_to_end(key)
            slot, size = where
            data = self._view(slot)[:size].tobytes()
        try:
            block = decode_block(data, self.fingerprint, key)
        except ValueError as e:  # cannot happen unless the memory was written from outside
            self.stats.bad += 1
            log.warning("KV transfer tier: block %x unreadable (%s); recomputing", key, e)
            return None
        self.stats.hits += 1
        self.stats.bytes_out += len(data)
        return block

    def locate(self, keys: list[int]) -> list[list[int]]:
        """[[key, address, bytes], ...] of the leading `keys` (a prefix chain) this tier holds,
        up to the first it does not: what another engine's `pull` reads."""
        out = []
        base = self._buffer.ctypes.data
        with self._lock:
            for key in keys:
                where = self._slots.get(key)
                if where is None:
                    break
                slot, size = where
                out.append([key, base + slot * self.slot_bytes, size])
        return out

    def pull(self, session: str, blocks: list) -> dict[int, Block]:
        """Reads `blocks` ([[key, address, bytes], ...], another engine's `locate`) from that
        engine's registered memory and returns the leading ones that pass `decode_block` under
        this tier's fingerprint: {key: block}. A failed read or a bad block ends the chain
        (the caller recomputes the rest)."""
        if not blocks:
            return {}
        sizes = [int(b[2]) for b in blocks]
        total = sum(sizes)
        if total > self.capacity_bytes:  # more than this engine lends the transfer engine
            log.warning("KV transfer: %d bytes of blocks from %s exceed kv_transfer_bytes=%d; "
                        "recomputing them", total, session, self.capacity_bytes)  # fmt: skip
            self.stats.rejected += 1
            return {}
        t0 = time.perf_counter()
        with self._recv_lock:
            if self._recv is None or self._recv.nbytes < total:
                if self._recv is not None:
                    self._engine.unregister_memory(self._recv.ctypes.data)
                self._recv = np.zeros(max(total, 1 << 20), np.uint8)
                self._register(self._recv)
            base = self._recv.ctypes.data
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            code = self._engine.batch_transfer_sync_read(
                session, [base + int(o) for o in offsets], [int(b[1]) for b in blocks], sizes
            )
            if code != 0:
                log.warning("KV transfer: reading %d blocks from %s failed (code %s); "
                            "recomputing them", len(blocks), session, code)  # fmt: skip
                self.stats.bad += 1
                return {}
            datas = [self._recv[o : o + n].tobytes() for o, n in zip(offsets, sizes, strict=True)]
        out = {}
        for (key, _, _), data in zip(blocks, datas, strict=True):
            try:
                out[int(key)] = decode_block(data, self.fingerprint, int(key))
            except ValueError as e:
                self.stats.bad += 1
                log.warning("KV transfer: block %x from %s rejected (%s); recomputing from there",
                            int(key), session, e)  # fmt: skip
                break
        self.pulls += 1
        self.pulled_bytes += sum(sizes[: len(out)])
        self.pull_seconds += time.perf_counter() - t0
        return out

    def more_stats(self) -> dict:
        """The reads from other engines (`pull`), beside the tier's own counters."""
        return {"transfer_pulls": self.pulls, "transfer_pulled_bytes": self.pulled_bytes,
                "transfer_pull_seconds": self.pull_seconds}  # fmt: skip

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            for buffer in (self._buffer, self._recv):
                if buffer is not None:
                    engine.unregister_memory(buffer.ctypes.data)


def _start_engine(config: dict):
    """A Mooncake TransferEngine under a segment name of its own (`local_hostname` plus a free
    port when it has none: engines on one host must not share a name)."""
    try:
        from mooncake.engine import TransferEngine  # the `mooncake` extra
    except ImportError as e:
        raise MooncakeUnavailable(f"the KV transfer engine needs {INSTALL_HINT} ({e})") from e
    os.environ.setdefault("GLOG_minloglevel", "2")
    name = config["local_hostname"]
    if ":" not in name:
        with socket.socket() as s:
            s.bind((name, 0))
            name = f"{name}:{s.getsockname()[1]}"
    server = config["metadata_server"]
    if server.startswith("http://"):
        _check_reachable(server.removeprefix("http://").split("/", 1)[0], "metadata_server")
    engine = TransferEngine()
    code = engine.initialize(name, server, config["protocol"], config["device_name"])
    if code != 0:
        raise ConnectionError(
            f"the Mooncake transfer engine did not start (code {code}) with metadata server "
            f"{server}: is mooncake_master running there with its HTTP metadata server?"
        )
    return engine, name
