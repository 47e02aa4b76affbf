"""KV cache tiers below the device pool: host RAM (in-process) and a local disk directory.

A block is one full page's K/V (every layer), as numpy arrays, keyed by the page's chain hash
(`block_manager.page_hashes`, stable across processes) under a model/config fingerprint
(`fingerprint`): weights digest, dtype, KV quantization, page size, layer layout. A block never
attaches to another model: the fingerprint is part of every key and of every disk header.

- `HostTier`: bounded bytes, least-recently-used eviction.
- `DiskTier`: one file per block (`<fingerprint>-<key>.kvb`); a header holds the fingerprint,
  every array's dtype and shape, and a blake2b checksum of the payload. A file that is
  truncated, corrupted, or written for another fingerprint is a miss with a warning (the caller
  recomputes), never a wrong block. Bounded bytes; the oldest files are removed first.
- `TieredStore`: the tiers in order (host, disk, then a shared store: `cache.mooncake`). `put`
  writes through to every tier; `get` returns the first tier's valid block and copies a lower
  tier's hit up into the tiers above it; `prefetch` reads a prefix's blocks on a background
  thread while the scheduler keeps stepping other requests (every tier is thread-safe).

Pure Python and numpy (no JAX): the engine gathers pages off the device and scatters them back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections import OrderedDict

import numpy as np

log = logging.getLogger(__name__)

Block = tuple  # tuple[np.ndarray, ...]: the page's K, V (and scales of quantized pages)

_MAGIC = b"JXKV1\n"


def fingerprint(parts: dict) -> str:
    """A short stable digest of what makes a page's K/V valid (model, weights, layout)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def weights_digest(leaves) -> str:
    """A digest of the weights: every leaf's shape, dtype and first and last 256 values (cheap
    to read off a device; two checkpoints of one shape differ there in practice)."""
    h = hashlib.blake2b(digest_size=12)
    for leaf in leaves:
        a = np.asarray(leaf.reshape(-1)[:256]), np.asarray(leaf.reshape(-1)[-256:])
        h.update(f"{leaf.shape}{leaf.dtype}".encode())
        for part in a:
            h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def block_bytes(block: Block) -> int:
    return int(sum(a.nbytes for a in block))


def encode_block(fp: str, key: int, block: Block) -> bytes:
    """A block as self-checking bytes (the disk tier's files, the Mooncake tier's values): a
    header with the fingerprint, the key, every array's dtype and shape and a blake2b checksum
    of the payload, then the payload."""
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in block)
    header = json.dumps(
        {
            "fingerprint": fp,
            "key": key,
            "arrays": [[str(a.dtype), list(a.shape)] for a in block],
            "nbytes": len(payload),
            "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }
    ).encode()
    return _MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_block(data: bytes, fp: str, key: int) -> Block:
    """`encode_block`'s inverse; ValueError for bytes that are not exactly a block of this
    fingerprint and key (truncated, corrupted, another model's)."""
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a KV block")
        (n,) = struct.unpack_from("<I", data, len(_MAGIC))
        start = len(_MAGIC) + 4
        header = json.loads(data[start : start + n])
        if header["fingerprint"] != fp or header["key"] != key:
            raise ValueError(f"written for another model or block ({header['fingerprint']})")
        payload = memoryview(data)[start + n :]
        if len(payload) != header["nbytes"]:
            raise ValueError(f"{len(payload)} payload bytes, header says {header['nbytes']}")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
            raise ValueError("checksum mismatch")
        arrays, offset = [], 0
        for dtype, shape in header["arrays"]:
            dt = np.dtype(dtype)
            count = int(np.prod(shape))
            arrays.append(np.frombuffer(payload, dt, count, offset).reshape(shape).copy())
            offset += count * dt.itemsize
    except (KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed block header ({e!r})") from e
    if offset != len(payload):
        raise ValueError("array sizes do not add up to the payload")
    return tuple(arrays)


@dataclasses.dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bad: int = 0  # blocks found but rejected (checksum, size, fingerprint)
    puts: int = 0
    bytes_in: int = 0  # written into the tier
    bytes_out: int = 0  # read from the tier
    evictions: int = 0
    rejected: int = 0  # writes the tier had no room for (a shared store's full segments)


class HostTier:
    """Blocks in host memory, at most `capacity_bytes`, least recently used evicted first."""

    name = "host"
    slow = False  # in this process's memory: read inline, no prefetch thread

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"kv_host_cache_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._lock = threading.Lock()  # the engine's and the prefetch thread's calls
        self.bytes = 0
        self.stats = TierStats()

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: int) -> Block | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_out += block_bytes(block)
            return block

    def put(self, key: int, block: Block) -> None:
        size = block_bytes(block)
        if size > self.capacity_bytes:
            return  # a block larger than the whole tier is not kept
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            while self.bytes + size > self.capacity_bytes:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= block_bytes(old)
                self.stats.evictions += 1
            self._blocks[key] = block
            self.bytes += size
            self.stats.puts += 1
            self.stats.bytes_in += size


class DiskTier:
    """Blocks as files in `directory` (created if missing), at most `capacity_bytes` of them."""

    name = "disk"
    slow = True  # file reads: prefetched on a background thread

    def __init__(self, directory: str, fingerprint: str, capacity_bytes: int | None = None):
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"kv_disk_cache_bytes must be >= 1, got {capacity_bytes}")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        # Files already there (an earlier run): oldest first, for the byte bound.
        self._files: OrderedDict[str, int] = OrderedDict()
        entries = []
        for name in os.listdir(self.directory):
            if name.endswith(".kvb"):
                path = os.path.join(self.directory, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                entries.append((st.st_mtime, name, st.st_size))
        for _, name, size in sorted(entries):
            self._files[name] = size
        self.bytes = sum(self._files.values())

    def _name(self, key: int) -> str:
        return f"{self.fingerprint}-{key & 0xFFFFFFFFFFFFFFFF:016x}.kvb"

    def __contains__(self, key: int) -> bool:
        return self._name(key) in self._files

    def put(self, key: int, block: Block) -> None:
        name = self._name(key)
        if name in self._files:
            return
        data = encode_block(self.fingerprint, key, block)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            return
        path = os.path.join(self.directory, name)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except OSError as e:
            log.warning("KV disk tier: could not write %s (%s); block not stored", path, e)
            return
        with self._lock:  # the bookkeeping; the engine's and the prefetch thread's calls
            if name in self._files:
                os.remove(tmp)
                return
            while (
                self.capacity_bytes is not None
                and self._files
                and self.bytes + len(data) > self.capacity_bytes
            ):
                old, size = self._files.popitem(last=False)
                self.bytes -= size
                self.stats.evictions += 1
                try:
                    os.remove(os.path.join(self.directory, old))
                except OSError:
                    pass
            try:
                os.replace(tmp, path)  # readers never see a half-written block
            except OSError as e:
                log.warning("KV disk tier: could not write %s (%s); block not stored", path, e)
                return
            self._files[name] = len(data)
            self.bytes += len(data)
            self.stats.puts += 1
            self.stats.bytes_in += len(data)

    def get(self, key: int) -> Block | None:
        name = self._name(key)
        if name not in self._files:
            self.stats.misses += 1
            return None
        path = os.path.join(self.directory, name)
        try:
            block = self._read(path, key)  # outside the lock: a slow read blocks no writer
        except (OSError, ValueError) as e:
            with self._lock:
                self.stats.misses += 1
                if name not in self._files:
                    return None  # evicted while it was being read
                log.warning("KV disk tier: bad block %s (%s): recomputing it", path, e)
                self.stats.bad += 1
                self.bytes -= self._files.pop(name)
                try:
                    os.remove(path)
                except OSError:
                    pass
                return None
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
            self.stats.hits += 1
            self.stats.bytes_out += block_bytes(block)
        return block

    def _read(self, path: str, key: int) -> Block:
        with open(path, "rb") as f:
            return decode_block(f.read(), self.fingerprint, key)


class TieredStore:
    """The tiers below the device pool, fastest first; what the block manager talks to.

    Called from the engine's thread and the prefetch thread at once: each tier is thread-safe
    and holds its lock only for its bookkeeping, never across a read (a slow store's read does
    not stall the engine's lookups and writes)."""

    def __init__(self, tiers: list, fingerprint: str):
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.offloaded_blocks = 0
        self.loaded_blocks = 0
        self.io_seconds = 0.0  # the engine's device<->host page moves (gather, scatter)
        self.lookup_seconds = 0.0  # the engine waiting on the tiers (admission, prefetch waits)
        self.prefetches = 0
        self.prefetch_seconds = 0.0  # reads on the prefetch thread, overlapping engine steps
        self._prefetcher = None  # a one-thread pool, made at the first prefetch of a slow tier

    def __contains__(self, key: int) -> bool:
        return any(key in t for t in self.tiers)

    def get(self, key: int) -> Block | None:
        t0 = time.perf_counter()
        try:
            return self._get(key)
        finally:
            self.lookup_seconds += time.perf_counter() - t0

    def _get(self, key: int) -> Block | None:
        for i, tier in enumerate(self.tiers):
            block = tier.get(key)  # a miss is counted by the tier (one store call, not two)
            if block is not None:
                for upper in self.tiers[:i]:
                    upper.put(key, block)  # a lower tier's hit moves up
                return block
        return None

    def put(self, key: int, block: Block) -> None:
        for tier in self.tiers:
            tier.put(key, block)

    def prefetch(self, keys: list[int]) -> concurrent.futures.Future:
        """Starts reading the blocks of `keys` (a prefix chain, in order) up to the first no
        tier holds. The future's result: ({key: block}, the key that missed or None). With
        only in-memory tiers the reads happen now (the future is already done); otherwise on
        a background thread, so the engine keeps stepping other requests."""
        self.prefetches += 1
        if not any(getattr(t, "slow", True) for t in self.tiers):
            done = concurrent.futures.Future()
            done.set_result(self._read_chain(keys))
            return done
        if self._prefetcher is None:
            self._prefetcher = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kv-prefetch"
            )
        return self._prefetcher.submit(self._read_chain, list(keys))

    def _read_chain(self, keys: list[int]) -> tuple[dict[int, Block], int | None]:
        t0 = time.perf_counter()
        blocks, missed = {}, None
        try:
            for key in keys:
                block = self._get(key)
                if block is None:
                    missed = key
                    break
                blocks[key] = block
        except Exception as e:  # a tier's own failure handling missed something: recompute
            log.warning("KV tiers: prefetch failed (%s); recomputing the rest", e)
            missed = key
        self.prefetch_seconds += time.perf_counter() - t0
        return blocks, missed

    def close(self) -> None:
        """Lets go of the tiers that hold connections (a shared store's client)."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None
        for tier in self.tiers:
            if hasattr(tier, "close"):
                tier.close()

    def stats(self) -> dict:
        out = {
            "offloaded_blocks": self.offloaded_blocks,
            "loaded_blocks": self.loaded_blocks,
            "io_seconds": self.io_seconds,
            "lookup_seconds": self.lookup_seconds,
            "prefetches": self.prefetches,
            "prefetch_seconds": self.prefetch_seconds,
        }
        for tier in self.tiers:
            for field, value in dataclasses.asdict(tier.stats).items():
                out[f"{tier.name}_{field}"] = value
            if tier.bytes is not None:
                out[f"{tier.name}_bytes_stored"] = tier.bytes
            if hasattr(tier, "more_stats"):
                out.update(tier.more_stats())
        return out
