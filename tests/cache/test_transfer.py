"""cache.transfer: KV blocks read by one engine straight out of another's registered memory with
Mooncake's transfer engine (two TransferTiers on loopback, a real `mooncake_master` as their
metadata server). Good blocks arrive bit for bit; a block of another model, a slot reused for a
newer block end the chain there, never a wrong block (an engine killed with its pages being
read: tests/entrypoints/test_disagg_faults.py)."""

import logging

import numpy as np
import pytest

from jaxgen.cache.transfer import TransferTier, transfer_config
from jaxgen.entrypoints.mooncake_local import LocalMooncake

FP = "a" * 24


def block(seed):
    rng = np.random.RandomState(abs(seed))
    return (rng.randn(2, 4, 8).astype(np.float32), rng.randn(2, 4, 8).astype(np.float32))


@pytest.fixture(scope="module")
def master():
    with LocalMooncake(segment_bytes=0) as m:  # the metadata server alone
        yield m


def test_blocks_are_read_from_another_engine(master):
    sender = TransferTier(master.config(), FP, 1 << 20)
    receiver = TransferTier(master.config(), FP, 1 << 20)
    assert sender.session != receiver.session  # a segment name each, on one host
    keys = [11, -22, 33, 44]
    for k in keys:
        sender.put(k, block(k))
    slot = sender.slot_bytes
    assert sender.bytes == 4 * slot and len(sender) == 4
    where = sender.locate(keys + [55, 66])
    assert [w[0] for w in where] == keys  # up to the first block it does not hold
    assert all(slot - 20 < w[2] <= slot for w in where)  # a slot fits the longest key
    got = receiver.pull(sender.session, where)
    assert list(got) == keys
    for k in keys:
        assert all(np.array_equal(a, b) for a, b in zip(got[k], block(k), strict=True))
    assert receiver.pulls == 1 and receiver.pulled_bytes == sum(w[2] for w in where)
    # The sender's tier is a host tier of its own engine too.
    assert all(np.array_equal(a, b) for a, b in zip(sender.get(33), block(33), strict=True))
    assert sender.get(99) is None and sender.stats.misses == 1
    # Another model's blocks (another fingerprint) are refused at the first one.
    other = TransferTier(master.config(), "b" * 24, 1 << 20)
    assert other.pull(sender.session, where) == {}
    assert other.stats.bad == 1
    for tier in (sender, receiver, other):
        tier.close()


def test_a_reused_slot_ends_the_chain(master, caplog):
    sender = TransferTier(master.config(), FP, 1 << 20)
    sender.put(1, block(1))
    slots = (1 << 20) // sender.slot_bytes
    for k in range(2, slots + 1):
        sender.put(k, block(k))
    where = sender.locate([1, 2, 3])
    assert len(where) == 3
    # Newer blocks take the least recently written slots: block 1's slot now holds another.
    sender.put(10_000, block(7))
    assert 1 not in sender and sender.stats.evictions == 1
    receiver = TransferTier(master.config(), FP, 1 << 20)
    with caplog.at_level(logging.WARNING):
        assert receiver.pull(sender.session, where) == {}  # stale address: rejected, not used
    assert "rejected" in caplog.text and receiver.stats.bad == 1
    got = receiver.pull(sender.session, sender.locate([2, 3]))
    assert list(got) == [2, 3]
    # A block of another size (not a full page of this model) is not kept.
    sender.put(5_000, (np.zeros(3, np.float32),))
    assert 5_000 not in sender and sender.stats.rejected == 1
    for tier in (sender, receiver):
        tier.close()


def test_bad_configs_are_typed_errors(master):
    with pytest.raises(ValueError, match="needs metadata_server"):
        transfer_config({"local_hostname": "127.0.0.1"})
    with pytest.raises(ValueError, match="kv_transfer must be a dict"):
        transfer_config(3)
    with pytest.raises(ValueError, match="kv_transfer_bytes must be an int >= 1"):
        TransferTier(master.config(), FP, 0)
    dead = dict(master.config(), metadata_server="http://127.0.0.1:1/metadata")
    with pytest.raises(ConnectionError, match="metadata_server"):
        TransferTier(dead, FP, 1 << 20)
    # A store's config serves too: its store keys are not the transfer engine's.
    assert transfer_config(master.config())["protocol"] == "tcp"


def test_an_unknown_engine_is_a_failed_read(master, caplog):
    receiver = TransferTier(master.config(), FP, 1 << 20)
    with caplog.at_level(logging.WARNING):
        assert receiver.pull("127.0.0.1:1", [[5, 4096, 700]]) == {}
    assert "failed" in caplog.text and receiver.stats.bad == 1
    # More bytes than the engine lends the transfer engine: refused before any read.
    assert receiver.pull("127.0.0.1:1", [[5, 4096, 2 << 20]]) == {}
    assert receiver.stats.rejected == 1
    receiver.close()
