"""Batch-invariant mode: a request's tokens and logprobs are bitwise the same whatever shares
its steps (alone, in random mixes and batch sizes)."""

import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.engine.runner.shapes import FlatShape, StepShape

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def prompts(n=64, seed=0):
    rng = np.random.RandomState(seed)
    # Short prompts; some span two or three 64-token chunks, two end one past a boundary.
    lens = rng.randint(2, 150, n)
    lens[:2] = (65, 129)
    return [rng.randint(3, 40000, int(m)).tolist() for m in lens]


def result(out):
    c = out.outputs[0]
    return c.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in c.logprobs]


def engine(tiny, **kwargs):
    cfg, params, tokenizer = tiny
    return LLM.from_parts(
        cfg,
        params,
        tokenizer,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        num_kv_pages=512,  # no preemption: a preempted row recomputes as a prefill
        warmup=False,
        **kwargs,
    )


# The ragged step (the attention in its invariant order, `ragged_xla`) and the row-shaped step
# (what an engine on the attention kernels runs in this mode).
@pytest.fixture(scope="module", params=[True, False], ids=["ragged", "rows"])
def invariant(tiny, request):
    return engine(tiny, batch_invariant=True, ragged_step=request.param)


def test_tokens_and_logprobs_do_not_depend_on_the_batch(invariant):
    ps = prompts()
    alone = [result(invariant.generate([p], PARAMS)[0]) for p in ps]
    rng = np.random.RandomState(1)
    for _ in range(2):
        order = rng.permutation(len(ps))
        i = 0
        while i < len(order):
            size = int(rng.choice([2, 3, 5, 8, 13, 64]))
            group = order[i : i + size]
            outs = invariant.generate([ps[j] for j in group], PARAMS)
            for j, out in zip(group, outs, strict=True):
                assert result(out) == alone[j], f"prompt {j} in a batch of {len(group)}"
            i += size
    assert invariant.engine.scheduler.num_preemptions == 0


def test_two_programs_only(invariant):
    """Every step ran at one of two shapes: the decode one or the prefill one."""
    if invariant.engine.flat:  # 8 decode rows; 2 prefill rows of 64 tokens on 128
        shapes = {key[1] for key in invariant.compiled if isinstance(key[1], FlatShape)}
        assert all(s.invariant for s in shapes)
        assert {(s.num_tokens, s.num_rows) for s in shapes} == {(8, 8), (128, 2)}
        return
    shapes = {key[1] for key in invariant.compiled if isinstance(key[1], StepShape)}
    assert {(s.num_decode, s.prefill_rows, s.prefill_len) for s in shapes} == {
        (8, 0, 0),
        (0, 2, 64),
    }


def test_bad_combinations_fail_with_what_to_change(tiny):
    cfg, params, tokenizer = tiny
    with pytest.raises(ValueError, match="paged engine"):
        LLM.from_parts(
            cfg, params, tokenizer, kv_cache="contiguous", batch_invariant=True, warmup=False
        )
    with pytest.raises(ValueError, match="speculative"):
        engine(tiny, batch_invariant=True, speculative={"method": "ngram", "num_tokens": 2})
