"""cache.mooncake: the Mooncake Store tier against a real `mooncake_master` and storage process
on loopback (entrypoints.mooncake_local): blocks shared between clients and kept after the
writer exits, bad values rejected, a full store, a dead and a stalled master."""

import logging
import time

import numpy as np
import pytest

from jaxgen.cache.mooncake import MooncakeTier, mooncake_config
from jaxgen.cache.tiers import encode_block
from jaxgen.entrypoints.mooncake_local import LocalMooncake

FP = "f" * 24


def block(seed, nbytes=4096):
    rng = np.random.RandomState(seed)
    n = nbytes // 8
    return (rng.randn(2, n // 2).astype(np.float32), rng.randn(2, n // 2).astype(np.float32))


@pytest.fixture(scope="module")
def store():
    with LocalMooncake(segment_bytes=32 << 20) as s:
        yield s


def test_blocks_are_shared_and_outlive_their_writer(store):
    writer = MooncakeTier(store.config(), FP)
    blocks = {k: block(k) for k in range(1, 6)}
    for k, b in blocks.items():
        writer.put(k, b)
    assert writer.stats.puts == 5 and writer.stats.bytes_in > 5 * 4096
    writer.close()  # the storage process holds the blocks, not the writer
    reader = MooncakeTier(store.config(), FP)
    for k, b in blocks.items():
        assert k in reader
        got = reader.get(k)
        assert all(np.array_equal(x, y) for x, y in zip(got, b, strict=True))
    assert 99 not in reader and reader.get(99) is None
    assert reader.stats.hits == 5 and reader.stats.misses == 1
    # Another model's fingerprint never sees them.
    other = MooncakeTier(store.config(), "0" * 24)
    assert 1 not in other and other.get(1) is None
    assert store.allocated_bytes() > 0
    reader.close()
    other.close()


def test_bad_values_are_misses_and_removed(store, caplog):
    tier = MooncakeTier(store.config(), FP)
    good = encode_block(FP, 11, block(11))
    flipped = bytearray(good)
    flipped[-3] ^= 0xFF
    raw = tier._client
    assert raw.put(tier._key(11), bytes(flipped)) == 0  # corrupted payload
    assert raw.put(tier._key(12), good[: len(good) // 2]) == 0  # truncated
    assert raw.put(tier._key(13), good) == 0  # block 11's bytes under key 13
    assert raw.put(tier._key(14), b"not a block") == 0
    with caplog.at_level(logging.WARNING, logger="jaxgen.cache.mooncake"):
        for k in (11, 12, 13, 14):
            assert k in tier
            assert tier.get(k) is None
            assert k not in tier  # removed: the next engine recomputes it too
    assert tier.stats.bad == 4 and tier.stats.hits == 0
    assert caplog.text.count("bad block") == 4
    tier.close()


def test_a_full_store_skips_writes_and_stays_bounded():
    with LocalMooncake(segment_bytes=16 << 20) as small:
        tier = MooncakeTier(small.config(), FP)
        for k in range(40):  # 40 blocks of 1 MiB into 16 MiB
            tier.put(k, block(k, 1 << 20))
        assert tier.stats.puts + tier.stats.rejected == 40
        assert tier.stats.puts >= 8  # it stored what fits
        assert small.allocated_bytes() <= small.capacity_bytes()
        stored = [k for k in range(40) if k in tier]
        assert len(stored) <= 16
        got = tier.get(stored[-1])
        assert np.array_equal(got[0], block(stored[-1], 1 << 20)[0])
        assert not tier.down
        tier.close()


def test_dead_master_makes_fast_misses_with_one_warning(caplog):
    with LocalMooncake(segment_bytes=16 << 20) as s:
        tier = MooncakeTier(s.config(), FP, retry_after_s=60)
        tier.put(1, block(1))
        assert 1 in tier
        s.kill_master()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="jaxgen.cache.mooncake"):
            assert 1 not in tier
            assert tier.get(1) is None
            tier.put(2, block(2))
        assert time.monotonic() - t0 < 2.0
        assert tier.down and tier.failures == 1  # later calls did not reach the client
        assert caplog.text.count("treated as down") == 1
        tier.close()


def test_stalled_master_times_out_instead_of_hanging(caplog):
    with LocalMooncake(segment_bytes=16 << 20) as s:
        tier = MooncakeTier(s.config(), FP, timeout_s=0.5, retry_after_s=0.2)
        tier.put(1, block(1))
        s.pause_master()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="jaxgen.cache.mooncake"):
            assert 1 not in tier
        assert time.monotonic() - t0 < 2.0
        assert tier.down and "no answer within 0.5 s" in caplog.text
        time.sleep(0.3)
        # The stuck call still holds the worker: the next call fails at once, never queues.
        t0 = time.monotonic()
        assert tier.get(1) is None
        assert time.monotonic() - t0 < 0.2
        s.pause_master(False)
        # Once the master answers again (after the down window), the tier serves again.
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not (not tier.down and 1 in tier):
            time.sleep(0.3)
        assert tier.get(1) is not None
        tier.close()


def test_config_errors_say_what_to_change(tmp_path):
    ok = {"master_server_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata",
          "local_hostname": "127.0.0.1"}  # fmt: skip
    assert (
        mooncake_config({**ok, "global_segment_size": "512MB"})["global_segment_size"] == 512 << 20
    )
    assert mooncake_config({**ok, "local_buffer_size": "1.5 GiB"})["local_buffer_size"] == 3 << 29
    path = tmp_path / "mooncake.json"
    path.write_text('{"master_server_address": "h:1", "metadata_server": "P2PHANDSHAKE", '
                    '"local_hostname": "h"}')  # fmt: skip
    assert mooncake_config(str(path))["protocol"] == "tcp"
    with pytest.raises(ValueError, match="needs master_server_address"):
        mooncake_config({"metadata_server": "x", "local_hostname": "h"})
    with pytest.raises(ValueError, match="global_segment_size must be bytes"):
        mooncake_config({**ok, "global_segment_size": "lots"})
    with pytest.raises(ValueError, match="unknown Mooncake config keys \\['master'\\]"):
        mooncake_config({**ok, "master": "x"})
    with pytest.raises(ValueError, match="cannot read the Mooncake config"):
        mooncake_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConnectionError, match="is mooncake_master running"):
        MooncakeTier({**ok, "master_server_address": "127.0.0.1:9"}, FP, timeout_s=20)
