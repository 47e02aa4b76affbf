"""Ahead-of-time compiled step buckets and executables serialized across starts (tiny model)."""

import dataclasses
import gc
import logging
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.engine import metrics
from jaxgen.engine.runner import aot, programs
from jaxgen.engine.runner.shapes import StepShape
from jaxgen.errors import CapacityError
from jaxgen.model import ModelConfig, init_params

CFG = ModelConfig(
    arch="llama",
    vocab_size=49152,  # the default tokenizer's
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)
BUCKETS = ["prefill:16", "prefill:32", "decode:1@64"]


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(3))


def make(params, tok, **kw):
    return LLM.from_parts(CFG, params, tok, max_model_len=256, max_num_seqs=2, **kw)


def run(llm):
    """Each prompt alone: a 1-row prefill, then 1-row decode steps."""
    return [llm.generate([p], SP)[0].outputs[0].token_ids for p in prompts()]


def prompts():
    rng = np.random.RandomState(0)
    # 12 and 25 tokens: prefill buckets 16 and 32; with 8 new tokens every context is <= 64.
    return [rng.randint(3, 49152, n).tolist() for n in (12, 25)]


SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_parse_buckets():
    assert [str(b) for b in aot.parse_buckets("prefill:32,decode:8,decode:4@1024")] == [
        "prefill:32",
        "decode:8@128",
        "decode:4@1024",
    ]
    for bad in ["prefill", "decode:0", "prefill:32@64", "encode:3", "decode:2@x"]:
        with pytest.raises(ValueError, match="bad compile bucket"):
            aot.parse_buckets([bad])


def test_the_ladder_compiles_at_start_and_nothing_while_serving(
    params, default_tokenizer, tmp_path, monkeypatch
):
    """A ragged engine compiles one step program per token bucket (and its page-copy programs)
    before it serves, then generates without compiling anything; its tokens are the row-shaped
    step's. A second start (nothing in the process) loads every executable from disk."""
    monkeypatch.setenv("JAXGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(aot, "_IN_PROCESS", weakref.WeakValueDictionary())  # as in a fresh process
    kw = dict(max_num_batched_tokens=64, executable_cache=True)
    llm = make(params, default_tokenizer, compile_buckets=BUCKETS, **kw)
    programs = llm.startup["programs"]
    assert [p["program"] for p in programs] == [
        *(f"ragged {t} tokens x {min(t, 2)} rows" for t in (1, 2, 4, 8, 16, 32, 64)),
        "copy_pages 1",
        "copy_pages 2",
    ]
    assert all(p["source"] == "compiled" and p["seconds"] > 0 for p in programs)
    counter = metrics.CompileCounter().install()
    try:
        outs = run(llm)
        two = llm.generate(prompts(), SP)  # both at once: mixed prefill and decode steps
    finally:
        counter.close()
    assert counter.compiles == 0, "a program compiled while serving"
    assert outs == [o.outputs[0].token_ids for o in two]
    assert outs == run(make(params, default_tokenizer, warmup=False, ragged_step=False))

    # A second start loads the serialized executables and generates the same tokens.
    monkeypatch.setattr(aot, "_IN_PROCESS", weakref.WeakValueDictionary())
    again = make(params, default_tokenizer, **kw)
    assert {p["source"] for p in again.startup["programs"]} == {"loaded"}
    assert run(again) == outs
    assert len(list((tmp_path / "executables").glob("*.jaxexe"))) == len(programs)

    # A damaged file is compiled afresh (and replaced), never loaded.
    for f in (tmp_path / "executables").glob("*.jaxexe"):
        f.write_bytes(b"not an executable")
    monkeypatch.setattr(aot, "_IN_PROCESS", weakref.WeakValueDictionary())
    third = make(params, default_tokenizer, **kw)
    assert {p["source"] for p in third.startup["programs"]} == {"compiled"}
    # In one process, a second engine of the same shapes takes the first one's executables.
    fourth = make(params, default_tokenizer, **kw)
    assert {p["source"] for p in fourth.startup["programs"]} == {"memory"}
    # Without warm-up, a program loads from the cache when a step first needs it.
    monkeypatch.setattr(aot, "_IN_PROCESS", weakref.WeakValueDictionary())
    lazy = make(params, default_tokenizer, warmup=False, **kw)
    counter = metrics.CompileCounter().install()
    try:
        assert run(lazy) == outs
    finally:
        counter.close()
    assert counter.compiles == 0 and lazy.engine.stats()["programs"] > 0


def test_bad_buckets_fail_before_work(params, default_tokenizer):
    with pytest.raises(ValueError, match="bad compile bucket"):
        LLM(compile_buckets=["prefill:abc"])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(params, default_tokenizer, compile_buckets=["prefill:300"], max_num_batched_tokens=128)
    with pytest.raises(CapacityError, match="max_model_len"):
        make(params, default_tokenizer, compile_buckets=["decode:1@4096"])


def test_every_compile_is_announced_with_its_expected_cost(params, default_tokenizer):
    """A line goes out before each ahead-of-time compile and before the first run of each new
    step shape, with what is compiled and what it is expected to cost; a shape compiled ahead
    of time is not announced again when it runs."""
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("jaxgen")
    logger.addHandler(handler)
    try:
        llm = make(params, default_tokenizer, compile_buckets=["prefill:16"], ragged_step=False)
        ahead = stream.getvalue()
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0))  # prefill:16
        assert stream.getvalue() == ahead
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0))
        later = stream.getvalue()[len(ahead) :]
    finally:
        logger.removeHandler(handler)
    assert "compiling 1 step program ahead of time (1 at once), no compile time measured" in ahead
    assert "1/1" in ahead and "prefill 1x16 (8 pages) compiled in" in ahead
    lines = [x for x in later.splitlines() if x.startswith("compiling paged_step")]
    assert lines and all("a new step shape, about" in x and "(median of" in x for x in lines)
    assert len(lines) == len(set(lines))
    assert logger.level == logging.INFO and not logger.propagate  # jaxgen._logging's default


def test_cover_new_shapes_runs_a_step_on_a_larger_compiled_program(params, default_tokenizer):
    """With cover_new_shapes, a step whose program has not compiled runs on a compiled one that
    covers it (padding: more rows, wider tables) within the factor, and gives the tokens it
    gives at its own shape; a step nothing covers within the factor compiles its own."""
    rng = np.random.RandomState(1)
    pair = [rng.randint(3, 49152, n).tolist() for n in (20, 22)]  # prefill 2x32, decode 2
    one, short = rng.randint(3, 49152, 18).tolist(), rng.randint(3, 49152, 5).tolist()
    want = make(params, default_tokenizer, warmup=False).generate([one, short], SP)
    llm = make(params, default_tokenizer, warmup=False, cover_new_shapes=2.0)
    llm.generate(pair, SP)
    programs = llm.engine._note_program.keys
    seen = set(programs)
    got = llm.generate([one], SP)[0].outputs[0].token_ids
    assert got == want[0].outputs[0].token_ids
    assert programs == seen  # its 1-row prefill and decode steps ran on the pair's programs
    assert llm.stats()["covered_steps"] == 1 + SP.max_tokens - 1
    # 5 tokens: a 1x16 prefill, a quarter of 2x32's tokens: beyond the factor, it compiles.
    assert llm.generate([short], SP)[0].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert any(k[1].prefill_len == 16 for k in programs - seen if len(k) == 2)
    # The rule itself: sampling options must match; a fresh-prefill program does not read
    # cached context; decode rows keep their page tables or page blocks.
    base = dict(
        num_decode=0,
        verify_rows=0,
        verify_len=0,
        prefill_rows=1,
        prefill_len=32,
        max_pages=8,
        num_rows=1,
        prefill_fresh=True,
        num_copies=1,
        stop_width=4,
    )
    s = StepShape(**base)
    assert StepShape(**{**base, "prefill_rows": 2, "num_rows": 2}).covers(s, 2.0, 16)
    assert not StepShape(**{**base, "prefill_rows": 4, "num_rows": 4}).covers(s, 2.0, 16)
    assert not StepShape(**base, num_logprobs=1).covers(s, 9.0, 16)
    assert not s.covers(StepShape(**{**base, "prefill_fresh": False}), 9.0, 16)
    dec = dict(base, num_decode=2, prefill_rows=0, prefill_len=0, num_rows=2)
    blocks = StepShape(**dec, decode_blocks=8)
    assert blocks.covers(StepShape(**dec), 9.0, 16)  # 2 rows' 8-page tables: 4 blocks
    assert not StepShape(**dec).covers(blocks, 9.0, 16)
    assert blocks.covers(StepShape(**{**dec, "num_decode": 1, "num_rows": 1}, decode_blocks=8),
                         2.0, 16)  # fmt: skip


def test_compile_in_background_runs_the_step_on_a_cover_meanwhile(
    params, default_tokenizer, monkeypatch
):
    """With compile_in_background, a step that nothing covers within the factor runs on a larger
    compiled program (any padding) while its own program compiles on another thread, and gives
    the tokens its own program gives; once compiled, that program runs the steps of its shape."""
    rng = np.random.RandomState(1)
    pair = [rng.randint(3, 49152, n).tolist() for n in (20, 22)]  # prefill 2x32, decode 2
    short = rng.randint(3, 49152, 5).tolist()  # a 1x16 prefill: beyond 2x of 2x32's work
    want = make(params, default_tokenizer, warmup=False).generate([short], SP)
    llm = make(params, default_tokenizer, warmup=False, cover_new_shapes=2.0,
               compile_in_background=True)  # fmt: skip
    llm.generate(pair, SP)
    engine = llm.engine
    seen = set(engine._note_program.keys)
    gate = threading.Event()  # the background compile waits until the step has run
    compile_or_load = aot.compile_or_load

    def held(*args, **kwargs):
        assert gate.wait(120)
        return compile_or_load(*args, **kwargs)

    monkeypatch.setattr(aot, "compile_or_load", held)
    logged = []
    engine.on_step = lambda step: logged.append(dict(step))
    lines = []  # the engine's log, as `jaxgen bench disagg` counts compiles started and ended
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    engine_log = logging.getLogger("jaxgen.engine")
    engine_log.addHandler(handler)
    level = engine_log.level
    engine_log.setLevel(logging.INFO)
    got = llm.generate([short], SP)[0].outputs[0].token_ids
    assert got == want[0].outputs[0].token_ids
    first = logged[0]  # the prefill, on the pair's 2x32 program, its own still compiling
    assert first["chunks"] == [(5, 0)] and first["covered"] and not first["compiled"]
    assert first["compiling"] >= 1 and first["shape"]["prefill_len"] == 32
    assert not any(k[1].prefill_len == 16 for k in engine._note_program.keys - seen)
    assert sum(programs.BACKGROUND_COMPILE_STARTED in x for x in lines) == 1
    gate.set()
    # The end is logged by the compile thread itself: an idle engine collects nothing.
    deadline = time.monotonic() + 120
    while not any(programs.BACKGROUND_COMPILE_ENDED[0] in x for x in lines):
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    engine_log.removeHandler(handler)
    engine_log.setLevel(level)
    engine.wait_for_compiles()
    assert any(k[1].prefill_len == 16 for k in engine._note_program.keys - seen)
    logged.clear()
    assert llm.generate([short], SP)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    again = logged[0]  # now on its own program, compiled in the background: no stall
    assert not again["covered"] and not again["compiled"] and again["compiling"] == 0
    assert again["shape"]["prefill_len"] == 16
    with pytest.raises(ValueError, match="compile_in_background=True .* kv_cache='paged'"):
        make(params, default_tokenizer, warmup=False, kv_cache="contiguous",
             compile_in_background=True)  # fmt: skip


def test_frozen_programs_cover_every_step_they_can_and_compile_nothing(params, default_tokenizer):
    """`Engine.freeze_programs`: a step whose program has not compiled runs on the least-work
    compiled program that covers it at any padding (beyond cover_new_shapes), with its own
    tokens; only a step that nothing covers compiles; thawed, new shapes compile again."""
    rng = np.random.RandomState(1)
    pair = [rng.randint(3, 49152, n).tolist() for n in (20, 22)]  # prefill 2x32, decode 2
    short = rng.randint(3, 49152, 5).tolist()  # a 1x16 prefill: a quarter of 2x32's tokens
    long = rng.randint(3, 49152, 40).tolist()  # a 1x64 prefill: nothing compiled covers it
    want = make(params, default_tokenizer, warmup=False, ragged_step=False).generate(
        [short, long], SP
    )
    llm = make(params, default_tokenizer, warmup=False, ragged_step=False)  # cover_new_shapes off
    engine = llm.engine
    llm.generate(pair, SP)
    programs = engine._note_program.keys
    seen = set(programs)
    assert engine.freeze_programs() == len(seen)
    logged = []
    engine.on_step = lambda step: logged.append(dict(step))
    assert llm.generate([short], SP)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert programs == seen and len(logged) == SP.max_tokens
    assert all(s["covered"] and not s["compiled"] for s in logged)
    # The host beside them (`HostClock`): nothing traced or compiled on the engine's thread.
    assert all(s["jax_compiles"] == 0 and s["trace_seconds"] == 0 for s in logged)
    assert all(s["cpu_seconds"] > 0 and s["gc_seconds"] >= 0 for s in logged)
    assert logged[0]["shape"]["prefill_len"] == 32 and logged[0]["shape"]["prefill_rows"] == 2
    logged.clear()
    assert llm.generate([long], SP)[0].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert any(k[1].prefill_len == 64 for k in programs - seen if len(k) == 2)
    compiled = [s for s in logged if s["compiled"]]
    assert compiled and all(s["jax_compiles"] >= 1 and s["compile_seconds"] > 0 for s in compiled)
    engine.freeze_programs(False)
    seen = set(programs)
    assert llm.generate([short], SP)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert any(k[1].prefill_len == 16 for k in programs - seen if len(k) == 2)


def test_host_clock_counts_gc_pauses_and_compiles_on_its_thread():
    """`HostClock.since`: the garbage collector's pauses, and JAX's traces and compiles on the
    calling thread only (a background compile thread's are not the engine's), while installed."""
    clock = metrics.HostClock().install()
    x = jnp.arange(5.0)
    mark = clock.mark()
    gc.collect()
    jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
    got = clock.since(mark)
    assert got["gc_seconds"] > 0 and got["cpu_seconds"] > 0
    assert got["jax_compiles"] == 1 and got["trace_seconds"] > 0 and got["compile_seconds"] > 0
    assert got["compiled_functions"] == ["jit(<lambda>)"]
    mark = clock.mark()
    worker = threading.Thread(target=lambda: jax.jit(lambda x: x - 7)(x))
    worker.start()
    worker.join()
    assert clock.since(mark)["jax_compiles"] == 0 and clock.since(mark)["compiled_functions"] == []
    clock.close()  # its listeners go: a compile after that is nobody's
    mark = clock.mark()
    jax.jit(lambda x: x + 11)(x).block_until_ready()
    assert clock.since(mark)["jax_compiles"] == 0


def test_compile_counter_counts_every_thread_while_installed():
    """`CompileCounter` (`jaxgen_xla_compiles_total`): compiles on any thread while installed,
    none after it is closed."""
    x = jnp.arange(3.0)
    counter = metrics.CompileCounter().install()
    jax.jit(lambda x: x * 5 - 2)(x).block_until_ready()
    here = counter.compiles
    assert here >= 1 and counter.seconds > 0
    worker = threading.Thread(target=lambda: jax.jit(lambda x: x / 9)(x).block_until_ready())
    worker.start()
    worker.join()
    assert counter.compiles > here
    counter.close()
    seen = counter.compiles
    jax.jit(lambda x: x + 13)(x).block_until_ready()
    assert counter.compiles == seen


def test_a_program_compiles_once_whatever_its_token_input(params, default_tokenizer):
    """A step program the engine compiles when a step first needs it is an executable of its
    own: run again with its tokens on the host (the synchronous loop) where it first ran with
    a pending token spliced in on the device (the overlapped loop), nothing compiles. A jitted
    call compiled such a program a second time, 3-7 s on XLA:CPU that no step log flagged
    (145 such steps in a bench disagg run)."""
    rng = np.random.RandomState(6)
    prompts = [rng.randint(3, 49152, n).tolist() for n in (9, 13)]
    # Weights placed on a device, as `jaxgen serve` loads them: the steps' outputs, and so the
    # spliced tokens, are committed to it (host tokens are not).
    llm = make(jax.device_put(params, jax.devices()[0]), default_tokenizer, warmup=False)
    engine = llm.engine
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, SP)]  # overlapped
    seen = set(engine._note_program.keys)
    engine.engine_cfg = dataclasses.replace(engine.engine_cfg, overlap=False)
    logged = []
    engine.on_step = lambda step: logged.append(dict(step))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP)] == want
    again = [s for s in logged if not s["compiled"]]
    ran_before = {k[1] for k in seen if len(k) == 2 and k[0] == "paged_step"}
    assert [s for s in again if s["shape"] in map(metrics.shape_record, ran_before)]
    assert all(s["jax_compiles"] == 0 for s in again), [s["jax_compiles"] for s in again]


def test_a_frozen_engine_defers_a_prefill_row_rather_than_compile(params, default_tokenizer):
    """`LLMEngine._defer_prefills`: frozen, a step that no compiled program covers leaves its
    last prefill rows to the next step until one does; a row is deferred once (its next row
    stays: that step compiles if nothing covers it). Every request keeps its own tokens."""
    rng = np.random.RandomState(4)
    solo = rng.randint(3, 49152, 12).tolist()
    a, b, c, d = (rng.randint(3, 49152, 12).tolist() for _ in range(4))  # 1x16 prefills
    fresh = make(params, default_tokenizer, warmup=False, ragged_step=False)
    want = [o.outputs[0].token_ids for o in fresh.generate([a, b], SP) + fresh.generate([c, d], SP)]
    llm = make(params, default_tokenizer, warmup=False, ragged_step=False)
    engine = llm.engine
    llm.generate([solo], SP)  # compiles a 1x16 prefill and a 1-row decode
    engine.freeze_programs()
    logged = []
    engine.on_step = lambda step: logged.append(dict(step))
    got = [o.outputs[0].token_ids for o in llm.generate([a, b], SP)]
    # Both prompts came at once (2x16, not compiled): b waited, and a's prefill ran alone on
    # its own program; then b's row stayed beside a's decode row, and that step compiled.
    first, second = logged[:2]
    assert (first["chunks"], first["deferred"], first["compiled"]) == ([(12, 0)], 1, False)
    assert (second["decode_rows"], second["chunks"], second["deferred"]) == (1, [(12, 0)], 0)
    assert second["compiled"]
    seen = set(engine._note_program.keys)
    logged.clear()
    got += [o.outputs[0].token_ids for o in llm.generate([c, d], SP)]
    # Again, and now every step after the deferral has a program: nothing compiles.
    assert set(engine._note_program.keys) == seen
    assert [s["deferred"] for s in logged][:2] == [1, 0] and not any(s["compiled"] for s in logged)
    assert got == want
    assert engine.stats()["deferred_prefills"] == 2
    assert not engine.programs.waited  # each deferred sequence ran a row since


def test_a_frozen_engine_runs_a_table_reading_decode_on_a_page_block_program(
    params, default_tokenizer
):
    """Decode rows that would read page tables run on a compiled program that reads page
    blocks when it has enough blocks for their tables' width (`StepShape.covers`), with their
    own tokens: a lone decode row after a warm-up whose only decode program read page blocks
    for 8 rows compiles nothing once frozen. A page-block step never runs on a table program
    (it does not say how wide its rows' tables are)."""
    rng = np.random.RandomState(2)
    batch = [rng.randint(3, 49152, 20).tolist() for _ in range(8)]
    one = rng.randint(3, 49152, 18).tolist()

    def eight():
        return LLM.from_parts(CFG, params, default_tokenizer, max_model_len=256, max_num_seqs=8,
                              warmup=False, ragged_step=False)  # fmt: skip

    want = eight().generate([one], SP)[0].outputs[0].token_ids
    llm = eight()
    engine = llm.engine
    llm.generate(batch, SP)
    shapes = [k[1] for k in engine._note_program.keys if len(k) == 2 and k[0] == "paged_step"]
    decode = [s for s in shapes if s.num_decode]
    assert decode and all(s.decode_blocks and not s.prefill_rows for s in decode)  # 8 rows
    engine.freeze_programs()
    seen = set(engine._note_program.keys)
    logged = []
    engine.on_step = lambda step: logged.append(dict(step))
    assert llm.generate([one], SP)[0].outputs[0].token_ids == want
    assert set(engine._note_program.keys) == seen
    lone = [s for s in logged if s["decode_rows"] == 1]
    assert len(lone) == SP.max_tokens - 1
    assert all(s["covered"] and not s["compiled"] for s in lone)
    # Logged as the program that ran them: the 8-row page-block one (a lone row's own shape,
    # 8 pages, reads tables: blocks would read 4x the pages).
    ran = {(s["shape"]["num_decode"], s["shape"]["decode_blocks"]) for s in lone}
    assert ran == {(decode[0].num_decode, decode[0].decode_blocks)}
    blocks = decode[0]  # 8 blocks of 4 pages
    table = dataclasses.replace(blocks, decode_blocks=0, num_decode=2, num_rows=2)
    assert blocks.covers(table, 99.0, 16)  # 2 rows' 8-page tables: at most 4 blocks
    assert not dataclasses.replace(table, num_decode=8, num_rows=8).covers(blocks, 99.0, 16)
    # Too few blocks for the tables' width: 8 rows of 8 pages, or 2 of 64, may need 16 or 32.
    assert not blocks.covers(dataclasses.replace(table, num_decode=8, num_rows=8), 99.0, 16)
    wide = dataclasses.replace(table, max_pages=64)
    assert not dataclasses.replace(blocks, max_pages=64).covers(wide, 99.0, 16)
