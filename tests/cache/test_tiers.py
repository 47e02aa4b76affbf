"""cache.tiers: the host tier's byte bound and LRU order, the disk tier's round trip, restart and
rejection of bad files, the tiered store's promotion; the block manager's tier lookups."""

import logging
import os
import threading

import numpy as np
import pytest

from jaxgen.cache.block_manager import BlockManager, page_hashes
from jaxgen.cache.tiers import DiskTier, HostTier, TieredStore, fingerprint


def block(seed, shape=(2, 4, 3)):
    rng = np.random.RandomState(seed)
    return (rng.randn(*shape).astype(np.float32), rng.randint(-9, 9, shape).astype(np.int8))


def same(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True)
    )


def test_host_tier_lru_bound():
    size = sum(a.nbytes for a in block(0))
    tier = HostTier(3 * size)
    for k in range(3):
        tier.put(k, block(k))
    assert tier.get(0) is not None  # 0 is now the most recent: 1 goes first
    tier.put(3, block(3))
    assert 1 not in tier and 0 in tier and 3 in tier
    assert tier.bytes == 3 * size and tier.stats.evictions == 1
    assert tier.get(1) is None and tier.stats.misses == 1
    assert same(tier.get(3), block(3))
    with pytest.raises(ValueError):
        HostTier(0)


def test_disk_tier_round_trip_restart_and_bound(tmp_path):
    fp = fingerprint({"model": "a"})
    tier = DiskTier(tmp_path, fp)
    tier.put(-5, block(1))
    tier.put(7, block(2))
    again = DiskTier(tmp_path, fp)  # a restart
    assert same(again.get(-5), block(1)) and same(again.get(7), block(2))
    other = DiskTier(tmp_path, fingerprint({"model": "b"}))
    assert other.get(7) is None  # another model's blocks are not its keys
    one = os.path.getsize(next(iter(tmp_path.iterdir())))
    small = DiskTier(tmp_path / "small", fp, capacity_bytes=2 * one)
    for k in range(4):
        small.put(k, block(k))
    assert small.bytes <= 2 * one and small.stats.evictions == 2
    assert len(os.listdir(tmp_path / "small")) == 2 and 3 in small and 0 not in small


@pytest.mark.parametrize("damage", ["flip", "truncate", "fingerprint", "garbage"])
def test_disk_tier_bad_file_is_a_miss(tmp_path, caplog, damage):
    fp = fingerprint({"model": "a"})
    DiskTier(tmp_path, fp).put(3, block(3))
    (path,) = tmp_path.iterdir()
    data = path.read_bytes()
    if damage == "flip":
        data = data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
    elif damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "fingerprint":
        data = data.replace(fp.encode(), b"f" * len(fp), 1)
    else:
        data = b"nonsense"
    path.write_bytes(data)
    tier = DiskTier(tmp_path, fp)
    with caplog.at_level(logging.WARNING, logger="jaxgen.cache.tiers"):
        assert tier.get(3) is None
    assert tier.stats.bad == 1 and "bad block" in caplog.text
    assert not path.exists() and 3 not in tier  # dropped: the next write replaces it


def test_tiered_store_promotes_disk_hits(tmp_path):
    fp = fingerprint({"model": "a"})
    DiskTier(tmp_path, fp).put(9, block(9))
    store = TieredStore([HostTier(1 << 20), DiskTier(tmp_path, fp)], fp)
    assert 9 not in store.tiers[0]
    assert same(store.get(9), block(9))
    assert 9 in store.tiers[0]  # copied up
    stats = store.stats()
    assert stats["disk_hits"] == 1 and stats["host_misses"] == 1


def test_block_manager_loads_evicted_prefix_from_store():
    store = TieredStore([HostTier(1 << 20)], "fp")
    bm = BlockManager(num_pages=4, page_size=4, store=store)
    prompt = list(range(100, 113))  # 3 full pages + 1 token
    assert bm.allocate("a", prompt) == 0
    bm.mark_computed("a", len(prompt))
    bm.free("a")
    assert bm.allocate("b", list(range(200, 216))) == 0  # 4 pages: evicts every cached one
    assert [h for _, h in bm.pending_offload] == page_hashes(prompt, 4)
    old_pages = [page for page, _ in bm.pending_offload]
    for page, h in bm.pending_offload:  # what the engine does with the device's contents
        store.put(h, (np.full(2, page, np.float32),))
    bm.pending_offload.clear()
    bm.free("b")
    assert bm.allocate("c", prompt) == 12  # every full page, from the store
    assert len(bm.pending_load) == 3 and bm.tier_hit_tokens == 12
    assert [int(b[0][0]) for _, b in bm.pending_load] == old_pages  # in prefix order
    assert [p for p, _ in bm.pending_load] == bm.tables["c"][:3]
    bm.check_invariants()
    # A prompt of exactly 3 pages computes its last token: 2 pages come from the store.
    bm.free("c")
    bm.pending_load.clear()
    bm.reset_prefix_cache()
    assert bm.allocate("d", prompt[:12]) == 8


class GatedTier(HostTier):
    """A host tier that reads like a slow store: `get` waits for `gate` (prefetch thread)."""

    slow = True

    def __init__(self):
        super().__init__(1 << 20)
        self.gate = threading.Event()
        self.gets = 0

    def get(self, key):
        assert self.gate.wait(30), "the gate was never opened"
        self.gets += 1
        return super().get(key)


def test_prefetch_reads_on_a_thread_and_allocate_takes_its_blocks():
    tier = GatedTier()
    store = TieredStore([tier], "fp")
    bm = BlockManager(num_pages=8, page_size=4, store=store)
    prompt = list(range(100, 113))  # 3 full pages + 1 token
    hashes = page_hashes(prompt, 4)
    for i, h in enumerate(hashes[:2]):  # the store holds the first two pages
        tier.put(h, (np.full(2, i, np.float32),))
    # Nothing of this prompt anywhere: ready at once, no prefetch, no read.
    assert bm.prefetch("x", list(range(500, 513)))
    assert store.prefetches == 0 and tier.gets == 0
    # Its first page is in the store: the read runs on the prefetch thread, not ready yet.
    assert not bm.prefetch("a", prompt)
    assert not bm.prefetch("a", prompt)  # asked again: the same prefetch, still waiting
    assert store.prefetches == 1
    # Others are admitted meanwhile: "x" is not read from the store (the prefetch thread is
    # busy with "a", and the lookup said it holds nothing of "x").
    assert bm.allocate("x", list(range(500, 513))) == 0 and tier.gets == 0
    tier.gate.set()
    assert bm.prefetch("a", prompt, wait=True)
    assert tier.gets == 3  # two hits, then the miss that ended the chain
    assert bm.allocate("a", prompt) == 8  # the staged blocks, no second read of the store
    assert tier.gets == 3 and bm.tier_hit_tokens == 8 and not bm._prefetch
    assert [int(b[0][0]) for _, b in bm.pending_load] == [0, 1]
    bm.check_invariants()


def test_prefetch_is_bounded_by_the_pool_and_cancelled_on_abort():
    tier = GatedTier()
    store = TieredStore([tier], "fp")
    bm = BlockManager(num_pages=4, page_size=4, store=store)
    a, b = list(range(100, 113)), list(range(200, 213))  # 3 full pages each
    for p in (a, b):
        for h in page_hashes(p, 4)[:3]:
            tier.put(h, (np.zeros(2, np.float32),))
    assert not bm.prefetch("a", a)  # 3 pages staged of the pool's 4
    assert not bm.prefetch("b", b) and "b" not in bm._prefetch  # would pass 4: waits its turn
    bm.cancel_prefetch("a")  # aborted while waiting
    assert bm._prefetch_pages == 0
    assert not bm.prefetch("b", b) and "b" in bm._prefetch
    tier.gate.set()
    assert bm.prefetch("b", b, wait=True) and bm.allocate("b", b) == 12
    assert bm._prefetch_pages == 0
    store.close()
