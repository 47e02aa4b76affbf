"""KV cache tiers below the device pool (cache.tiers) in the engine: a pool too small to keep a
prefix evicts it into the host / disk tier, a later prompt with that prefix loads it back, and
the greedy tokens equal recomputation's (f32, bitwise); a restarted engine finds its disk blocks;
a corrupted disk block is recomputed, never used."""

import logging
import os
import threading

import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.cli.main import build_parser
from jaxgen.entrypoints.server.worker import Metrics
from jaxgen.errors import JaxgenError

PAGE = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def make_llm(tiny, **kwargs):
    cfg, params, tok = tiny
    return LLM.from_parts(
        cfg,
        params,
        tok,
        warmup=False,
        max_model_len=256,
        page_size=PAGE,
        num_kv_pages=24,  # one 120-token prompt (15 pages) + its output; not two
        max_num_seqs=2,
        **kwargs,
    )


def workload(seed=0):
    """Three prompts sharing a 96-token prefix, with an unrelated prompt between them that
    evicts the prefix's pages from the tiny pool."""
    rng = np.random.RandomState(seed)
    doc = rng.randint(3, 49152, 96).tolist()
    qs = [doc + rng.randint(3, 49152, 24).tolist() for _ in range(3)]
    other = [rng.randint(3, 49152, 120).tolist() for _ in range(3)]
    return [p for pair in zip(qs, other, strict=True) for p in pair]


def run(llm, prompts):
    """One request at a time (each after the last has finished): the pool then holds only the
    latest prompts' pages."""
    return [
        llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in prompts
    ]


@pytest.fixture(scope="module")
def reference(tiny):
    llm = make_llm(tiny, enable_prefix_caching=False)
    return run(llm, workload())


def test_host_tier_hits_equal_recompute(tiny, reference):
    llm = make_llm(tiny, kv_host_cache_bytes=1 << 24)
    out = run(llm, workload())
    assert out == reference
    tiers = llm.engine.stats()["kv_tiers"]
    assert tiers["offloaded_blocks"] > 0
    # The second and third questions find the document's 12 pages (96 tokens): those the
    # unrelated prompt evicted come from host RAM, the rest are still on the device.
    assert tiers["loaded_blocks"] > 0 and tiers["host_hits"] == tiers["loaded_blocks"]
    assert llm.engine.bm.tier_hit_tokens == PAGE * tiers["loaded_blocks"]
    assert llm.engine.bm.prefix_hit_tokens >= 2 * 96
    assert tiers["host_bytes_stored"] <= 1 << 24
    llm.engine.bm.check_invariants()
    # The server's /metrics renders the same counters.
    metrics = Metrics(engine=llm.stats()).render()
    assert f'jaxgen_kv_tier_hits_total{{tier="host"}} {float(tiers["host_hits"])}' in metrics
    assert f"jaxgen_kv_loaded_blocks_total {float(tiers['loaded_blocks'])}" in metrics


def test_host_tier_bounded(tiny, reference):
    # Room for 4 blocks only: LRU evictions, and still the recomputed tokens.
    block = 2 * 2 * PAGE * 2 * 16 * 4  # K and V x layers x page x kv heads x head_dim x f32
    llm = make_llm(tiny, kv_host_cache_bytes=4 * block)
    assert run(llm, workload()) == reference
    tiers = llm.engine.stats()["kv_tiers"]
    assert tiers["host_bytes_stored"] <= 4 * block
    assert tiers["host_evictions"] > 0


def test_disk_tier_survives_restart(tiny, reference, tmp_path):
    prompts = workload()
    first = make_llm(tiny, kv_disk_cache_dir=str(tmp_path))
    assert run(first, prompts) == reference
    assert any(name.endswith(".kvb") for name in os.listdir(tmp_path))
    assert first.engine.flush_kv_tiers() > 0  # the pages still on the device, written down
    del first
    second = make_llm(tiny, kv_disk_cache_dir=str(tmp_path))
    # A fresh engine: its first prompt (120 tokens, 15 pages) finds every page but the last on
    # disk (the last prompt token is always computed).
    assert run(second, prompts[:1]) == reference[:1]
    tiers = second.engine.stats()["kv_tiers"]
    assert tiers["disk_hits"] == 14 and tiers["disk_bad"] == 0


def test_disk_tier_bad_blocks_recomputed(tiny, reference, tmp_path, caplog):
    prompts = workload()
    run(make_llm(tiny, kv_disk_cache_dir=str(tmp_path)), prompts)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".kvb"))
    assert len(files) >= 3
    # Flip a payload byte, truncate another, and rename a third under another fingerprint.
    with open(tmp_path / files[0], "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(tmp_path / files[1], "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / files[1]) // 2)
    with open(tmp_path / files[2], "r+b") as f:
        data = f.read()
    fp = files[2].split("-")[0]
    with open(tmp_path / files[2], "wb") as f:
        f.write(data.replace(fp.encode(), b"0" * len(fp), 1))
    llm = make_llm(tiny, kv_disk_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="jaxgen.cache.tiers"):
        assert run(llm, prompts) == reference
    tiers = llm.engine.stats()["kv_tiers"]
    assert tiers["disk_bad"] >= 1
    assert "bad block" in caplog.text
    llm.engine.bm.check_invariants()


def test_prefetch_overlaps_other_requests_steps(tiny, reference, tmp_path):
    """A prompt whose prefix is on disk is read on the prefetch thread while the engine keeps
    decoding another request; once read, it is admitted with those pages (greedy tokens equal
    recomputation's). The disk read is held back by a gate to make the overlap certain."""
    prompts = workload()
    first = make_llm(tiny, kv_disk_cache_dir=str(tmp_path))
    assert not first.engine.scheduler.prefetch_tiers  # the CPU backend's default
    run(first, prompts[:1])
    first.close()  # its pages written down to disk
    llm = make_llm(tiny, kv_disk_cache_dir=str(tmp_path), kv_prefetch=True)
    disk, gate = llm.engine.kv_store.tiers[0], threading.Event()
    read = disk.get
    disk.get = lambda key: (gate.wait(30), read(key))[1]
    rng = np.random.RandomState(9)
    busy_prompt = rng.randint(3, 49152, 16).tolist()
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    (busy,) = llm.processor.make_requests([{"prompt_token_ids": busy_prompt}], long)
    (doc,) = llm.processor.make_requests([{"prompt_token_ids": prompts[0]}], GREEDY)
    engine = llm.engine
    engine.add_request(busy)  # nothing of it on disk: admitted at once, no read
    while not busy.seqs[0].output_ids:
        engine.step()
    engine.add_request(doc)
    before = len(busy.seqs[0].output_ids)
    for _ in range(4):
        engine.step()
    # Four steps later the busy request has decoded on while the document waits on its read.
    assert len(busy.seqs[0].output_ids) >= before + 3
    assert [s.seq.request_id for s in engine.scheduler.waiting] == [doc.request_id]
    assert engine.kv_store.prefetches == 1 and disk.stats.hits == 0
    gate.set()
    while engine.has_work:
        engine.step()
    assert doc.seqs[0].output_ids == reference[0]
    tiers = engine.stats()["kv_tiers"]
    assert tiers["disk_hits"] == 14 and tiers["loaded_blocks"] == 14
    alone = run(llm, [busy_prompt])[0]  # the busy request by itself: the same tokens
    assert alone and busy.seqs[0].output_ids[: len(alone)] == alone
    assert engine.stats()["pages_used"] == 0
    engine.bm.check_invariants()
    llm.close()


def test_tier_options_typed_errors(tiny):
    with pytest.raises(JaxgenError, match="kv_host_cache_bytes"):
        make_llm(tiny, kv_host_cache_bytes=0)
    with pytest.raises(JaxgenError, match="prefix caching"):
        make_llm(tiny, kv_host_cache_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(JaxgenError, match="kv_disk_cache_dir"):
        make_llm(tiny, kv_disk_cache_bytes=1 << 20)
    with pytest.raises(JaxgenError, match="kv_eviction_policy='mru': use one of"):
        make_llm(tiny, kv_eviction_policy="mru")
    assert make_llm(tiny, kv_eviction_policy="lfu").engine.bm.eviction_policy == "lfu"


def test_serve_flags():
    args = build_parser().parse_args(
        ["serve", "--kv-host-cache-bytes", "1000", "--kv-disk-cache-dir", "/tmp/x"]
    )
    assert args.kv_host_cache_bytes == 1000 and args.kv_disk_cache_dir == "/tmp/x"
    assert args.kv_disk_cache_bytes is None


def test_router_prefers_the_instance_holding_the_prefix(tiny):
    from jaxgen.engine.sched.router import PrefixAwareRouter

    prompts = workload()
    a = make_llm(tiny, kv_host_cache_bytes=1 << 24)
    b = make_llm(tiny, kv_host_cache_bytes=1 << 24)
    run(b, prompts[:2])  # b computed the document, then evicted it into its host tier
    router = PrefixAwareRouter([a.engine, b.engine])
    decision = router.route(prompts[2])
    assert decision.index == 1 and decision.cached_tokens == [0, 96]
    # The prediction is what admission finds: b's next allocate reuses the 96 tokens.
    before = b.engine.bm.prefix_hit_tokens
    run(b, prompts[2:3])
    assert b.engine.bm.prefix_hit_tokens - before == 96
    # Load counts: with b busy on 150 prompt tokens, the prefix no longer pays for it.
    (busy_request,) = b.processor.make_requests([{"prompt_token_ids": list(range(5, 155))}], GREEDY)
    b.engine.add_request(busy_request)
    busy = PrefixAwareRouter([a.engine, b.engine], load_weight=1.0).route(prompts[4])
    assert busy.pending_tokens[1] >= 150 and busy.index == 0
    assert b.engine.abort(busy_request.request_id)


def test_preempted_sequences_resume_from_the_host_tier(tiny):
    """A pool too small for the batch preempts; a preempted sequence's computed pages (prompt
    and generated tokens) go to the host tier when evicted, and its re-admission loads them
    instead of recomputing: the same tokens as the recomputing engine, no page leaked."""
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 49152, rng.randint(20, 60)).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    cfg, weights, tok = tiny

    def engine(**kwargs):
        return LLM.from_parts(
            cfg, weights, tok, warmup=False, max_model_len=256, page_size=PAGE,
            num_kv_pages=24, max_num_seqs=6, **kwargs,
        )  # fmt: skip

    want = [o.outputs[0].token_ids for o in engine().generate(prompts, params)]
    llm = engine(kv_host_cache_bytes=1 << 24)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["kv_tiers"]["loaded_blocks"] > 0
    assert stats["pages_used"] == 0 and stats["pages_free"] == stats["pages_total"]
    llm.engine.bm.check_invariants()


def test_mooncake_store_shared_across_engines_restarts_and_faults(tiny, reference, caplog):
    """A Mooncake Store (real master and storage process on loopback) behind two engines: the
    second, started after the first closed, loads the first's pages; a corrupted block is
    recomputed; a master killed mid-run makes the engine recompute (same tokens, no leaked
    page), with a warning."""
    from jaxgen.cache.block_manager import page_hashes
    from jaxgen.cache.mooncake import MooncakeTier
    from jaxgen.entrypoints.mooncake_local import LocalMooncake

    prompts = workload()
    with LocalMooncake(segment_bytes=16 << 20) as store:
        first = make_llm(tiny, kv_mooncake=store.config())
        assert run(first, prompts) == reference
        assert first.stats()["kv_tiers"]["mooncake_puts"] > 0
        first.close()  # writes the pages still on the device down, then disconnects
        written = store.allocated_bytes()
        assert written > 0

        second = make_llm(tiny, kv_mooncake=store.config())
        # Its first prompt (15 pages) finds every page but the last in the store.
        assert run(second, prompts[:1]) == reference[:1]
        tiers = second.stats()["kv_tiers"]
        assert tiers["mooncake_hits"] == 14 and tiers["mooncake_bad"] == 0
        # A damaged block: a page of the second question's document, overwritten with garbage.
        tier = next(t for t in second.engine.kv_store.tiers if isinstance(t, MooncakeTier))
        key = tier._key(page_hashes(prompts[2], PAGE)[5])
        assert tier._client.remove(key, True) == 0 and tier._client.put(key, b"garbage") == 0
        with caplog.at_level(logging.WARNING, logger="jaxgen.cache.mooncake"):
            assert run(second, prompts[:4]) == reference[:4]
        assert second.stats()["kv_tiers"]["mooncake_bad"] >= 1 and "bad block" in caplog.text
        second.engine.bm.check_invariants()

        third = make_llm(tiny, kv_mooncake=store.config())
        assert run(third, prompts[:2]) == reference[:2]
        store.kill_master()
        with caplog.at_level(logging.WARNING, logger="jaxgen.cache.mooncake"):
            assert run(third, prompts[2:]) == reference[2:]
        assert "treated as down" in caplog.text
        stats = third.stats()
        assert stats["pages_used"] == 0 and stats["pages_free"] == stats["pages_total"]
        third.engine.bm.check_invariants()
        third.close()
        second.close()


def test_mooncake_option_errors(tiny):
    with pytest.raises(JaxgenError, match="kv_mooncake: the Mooncake config needs"):
        make_llm(tiny, kv_mooncake={"metadata_server": "x"})
    with pytest.raises(JaxgenError, match="is mooncake_master running"):
        make_llm(tiny, kv_mooncake={"master_server_address": "127.0.0.1:9",
                                    "metadata_server": "http://127.0.0.1:9/metadata",
                                    "local_hostname": "127.0.0.1"})  # fmt: skip
    args = build_parser().parse_args(["serve", "--kv-mooncake", "mc.json"])
    assert args.kv_mooncake == "mc.json"
