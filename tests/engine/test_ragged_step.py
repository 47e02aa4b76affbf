"""The ragged step (tiny model): a started engine serves a generated mix of requests without
compiling anything, and a request's tokens do not depend on what shares its steps."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jaxgen import LLM, SamplingParams
from jaxgen.engine.metrics import CompileCounter
from jaxgen.engine.params import MAX_LOGIT_BIAS, StructuredOutputs

LIMITS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, page_size=8)


@pytest.fixture(scope="module")
def llm(tiny):
    cfg, params, tok = tiny
    # 40 pages of 8 tokens: four long sequences do not fit at once (preemption).
    return LLM.from_parts(cfg, params, tok, num_kv_pages=40, **LIMITS)


def _requests(draw_lists):
    prompts, params = [], []
    rng = np.random.RandomState(0)
    shared = rng.randint(3, 49152, 24).tolist()  # a common prefix: cached pages, copies on fork
    for draw in draw_lists:
        length, out, n, temperature, seed, prefix, min_tokens, logprobs, bias, regex, pen = draw
        ids = rng.randint(3, 49152, length).tolist()
        prompts.append(shared + ids if prefix else ids)
        biased = rng.choice(49152, bias, replace=False).tolist()
        params.append(
            SamplingParams(
                max_tokens=out,
                min_tokens=min(min_tokens, out),
                n=n,
                temperature=temperature,
                seed=seed,
                stop=["the"] if seed % 2 else None,
                ignore_eos=bool(seed % 3),
                logprobs=logprobs,
                logit_bias={t: rng.uniform(-5, 5) for t in biased} or None,
                structured=StructuredOutputs(regex=r"[a-z ]{1,40}") if regex else None,
                repetition_penalty=1.3 if pen else 1.0,
                frequency_penalty=0.4 if pen else 0.0,
                presence_penalty=0.2 if pen else 0.0,
            )
        )
    return prompts, params


REQUEST = st.tuples(
    st.integers(1, 200),  # prompt tokens (with the prefix, up to 224 of max_model_len 256)
    st.integers(1, 24),  # output tokens
    st.integers(1, 3),  # n
    st.sampled_from([0.0, 0.8]),
    st.integers(0, 2**20),
    st.booleans(),  # shares a prefix with the others
    st.integers(0, 4),  # min_tokens
    st.sampled_from([None, 0, 3, 20]),  # top logprobs
    st.sampled_from([0, 2, MAX_LOGIT_BIAS]),  # logit-bias pairs
    st.booleans(),  # structured output (a regex)
    st.booleans(),  # repetition, frequency and presence penalties
)


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(REQUEST, min_size=1, max_size=7))
def test_a_started_engine_compiles_nothing(llm, draws):
    prompts, params = _requests(draws)
    # prompt + output tokens within max_model_len
    params = [
        p if len(ids) + p.max_tokens <= LIMITS["max_model_len"] else None
        for ids, p in zip(prompts, params, strict=True)
    ]
    prompts = [ids for ids, p in zip(prompts, params, strict=True) if p is not None]
    params = [p for p in params if p is not None]
    if not prompts:
        return
    counter = CompileCounter().install()
    try:
        outs = llm.generate(prompts, params)
    finally:
        counter.close()
    assert counter.compiles == 0, "a request needed a program the ladder does not hold"
    for out, p in zip(outs, params, strict=True):
        assert len(out.outputs) == p.n
        assert all(0 < len(c.token_ids) <= p.max_tokens for c in out.outputs)
        for c in out.outputs:
            if p.logprobs:  # the top p.logprobs, and the sampled token's when it is not among them
                assert len(c.logprobs) == len(c.token_ids)
                assert all(p.logprobs <= len(d) <= p.logprobs + 1 for d in c.logprobs)


def test_tokens_do_not_depend_on_the_batch(llm):
    """Greedy tokens of a request alone equal its tokens in a mixed batch (decode rows beside
    prefill chunks, cached prefixes), within the rounding of a different token bucket: the
    step computes every sequence from its own tokens and pages only."""
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 49152, n).tolist() for n in (5, 90, 33, 140)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_sampling_options_ride_the_ladder_programs(llm, tiny):
    """Top logprobs, logit bias, structured output and penalties are arrays of every ragged
    program (at their maxima, applied only in a step that asks): requests with them get the
    tokens and logprobs the row-shaped step gives them, which compiles each as a variant."""
    cfg, params, tok = tiny
    rng = np.random.RandomState(7)
    prompts = [rng.randint(3, 49152, n).tolist() for n in (9, 30)]
    sp = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        logprobs=5,
        logit_bias={int(t): 3.0 for t in rng.choice(49152, 40, replace=False)},
        structured=StructuredOutputs(regex=r"[a-z ]{1,40}"),
    )
    penalized = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=2.0, presence_penalty=1.0
    )
    row = LLM.from_parts(cfg, params, tok, ragged_step=False, warmup=False, **LIMITS)
    counter = CompileCounter().install()
    try:
        got = llm.generate(prompts, [sp, penalized])
    finally:
        counter.close()
    assert counter.compiles == 0
    want = row.generate(prompts, [sp, penalized])
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    text = got[0].outputs[0].text
    assert text and all(c.islower() or c == " " for c in text)
    # Within the rounding of another attention's summation order (f32, logprobs near -11).
    diffs = []
    for g, w in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs, strict=True):
        assert g.keys() == w.keys()
        diffs += [abs(g[t].logprob - w[t].logprob) for t in g]
    assert max(diffs) < 1e-3, max(diffs)


def test_beam_search_rides_the_ladder_programs(llm):
    """Beam search (beams forked on shared pages, each step's top 2 x width logprobs) runs on
    the ladder's programs: nothing compiles."""
    rng = np.random.RandomState(9)
    prompts = [rng.randint(3, 49152, n).tolist() for n in (7, 40)]
    counter = CompileCounter().install()
    try:
        outs = llm.beam_search(prompts, beam_width=2, max_tokens=6, ignore_eos=True)
    finally:
        counter.close()
    assert counter.compiles == 0
    assert [len(o.sequences) for o in outs] == [2, 2]
