"""cache.tiers: the host tier's byte bound and LRU order, the disk tier's round trip, restart and
rejection of bad files, the tiered store's promotion; the block manager's tier lookups."""

import logging
import os

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
