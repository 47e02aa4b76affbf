"""LLM API behaviour on the default model: seeds, batching independence, stop conditions,
streaming, logprobs, n > 1, compilation bounds and bad input."""

import pytest

from jaxgen import SamplingParams
from jaxgen.engine.detokenizer import IncrementalDetokenizer
from jaxgen.errors import InvalidPrompt, InvalidSamplingParams, JaxgenError

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = ["The history of Rome", "My favourite recipe is", "In 2050, cities will"]


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible(llm):
    a = llm.generate(PROMPTS[:1], SAMPLED)[0].outputs[0].token_ids
    b = llm.generate(PROMPTS[:1], SAMPLED)[0].outputs[0].token_ids
    c = llm.generate(PROMPTS[:1], SamplingParams(**{**SAMPLED.__dict__, "seed": 99}))
    assert a == b
    assert c[0].outputs[0].token_ids != a


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_row_output_independent_of_batch(llm, params):
    alone = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    together = llm.generate(PROMPTS + ["x " * 40], params)[0].outputs[0].token_ids
    assert alone == together


def test_streaming_concatenates_to_generate(llm):
    for params in (GREEDY, SAMPLED, SamplingParams(temperature=0, max_tokens=40, stop=["."])):
        full = llm.generate([PROMPTS[1]], params)[0].outputs[0].text
        deltas = list(llm.stream(PROMPTS[1], params))
        assert "".join(deltas) == full
        assert all("\ufffd" not in d for d in deltas)


def test_stop_string_across_token_boundary(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    pieces = [llm.tokenizer.decode([t]) for t in out.token_ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(
        i
        for i in range(5, len(pieces) - 1)
        if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    where = out.text.find(stop)
    assert where >= 0
    got = llm.generate([PROMPTS[0]], SamplingParams(**{**params.__dict__, "stop": [stop]}))[
        0
    ].outputs[0]
    assert got.text == out.text[:where]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    kept = llm.generate(
        [PROMPTS[0]],
        SamplingParams(**{**params.__dict__, "stop": [stop], "include_stop_str_in_output": True}),
    )[0].outputs[0]
    assert kept.text == out.text[: where + len(stop)]


def test_finish_reasons(llm):
    eos = llm.chat(
        [{"role": "user", "content": "Say just the word yes."}],
        SamplingParams(temperature=0, max_tokens=50),
    )
    out = eos[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason in llm.eos_ids
    assert "<|im_end|>" not in out.text
    length = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    token = length.token_ids[1]
    by_id = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[token])
    )
    assert by_id[0].outputs[0].stop_reason == token and len(by_id[0].outputs[0].token_ids) == 2


def test_min_tokens_blocks_eos(llm):
    msgs = [{"role": "user", "content": "Say just the word yes."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=30, min_tokens=12))[0].outputs[0]
    assert len(out.token_ids) >= 12


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate(PROMPTS[:1], params)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert token in entry and entry[token].logprob <= 0


def test_prompt_logprobs_cover_a_cached_prefix(llm):
    """A prompt whose pages are in the prefix cache still gets a logprob for every position:
    its first prefill computes them all instead of reusing the cached pages."""
    prompt = " ".join(PROMPTS) * 4  # several pages
    llm.generate([prompt], GREEDY)  # its pages are now cached
    fresh = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    out = fresh[0]
    assert len(out.prompt_token_ids) > 3 * 16
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.metrics.num_cached_prompt_tokens == 0
    assert all(out.prompt_token_ids[i] in e for i, e in enumerate(out.prompt_logprobs) if i)


def test_n_and_best_of(llm):
    out = llm.generate(PROMPTS[:1], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    best = llm.generate(
        PROMPTS[:1],
        SamplingParams(n=1, best_of=4, temperature=1.0, max_tokens=8, seed=5, logprobs=0),
    )[0]
    assert len(best.outputs) == 1
    # best_of picks by cumulative logprob, so the picks show it (with or without logprobs).
    two = llm.generate(
        PROMPTS[:1], SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=8, seed=5)
    )[0]
    scores = [c.cumulative_logprob for c in two.outputs]
    assert len(scores) == 2 and all(isinstance(x, float) and x < 0 for x in scores)
    assert scores[0] >= scores[1]


def test_metrics(llm):
    m = llm.generate(PROMPTS[:1], GREEDY)[0].metrics
    assert 0 < m.ttft <= m.e2e_latency
    assert m.num_generated_tokens == 24 and m.tokens_per_second > 0
    assert m.time_per_output_token >= 0


def test_compilations_bounded_for_mixed_workload(llm):
    before = set(llm.compiled)
    cfg = llm.engine_cfg
    prompts = ["word " * n for n in (1, 3, 9, 20, 33, 60, 5, 2)]
    for batch in (1, 3, 8):
        for max_tokens in (4, 10):
            llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=max_tokens))
    new = set(llm.compiled) - before
    # Buckets hit: batch {1, 4, 8} x prompt {16, 64} x cache {16, 64, 128} at most, per kind.
    for kind, _ in {(k[0], 0) for k in new}:
        assert sum(1 for k in new if k[0] == kind) <= 3 * 2 * 3
    assert all(k[1].num_rows in cfg.batch_buckets for k in new)  # ("paged_step", StepShape)
    count = llm.num_compilations
    for batch in (1, 3, 8):
        llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=10))
    assert llm.num_compilations == count  # the same workload again compiles nothing new


BAD = [
    ([], None, InvalidPrompt),
    ([""], None, InvalidPrompt),
    ([[]], None, InvalidPrompt),
    ([[1, 2, 10**7]], None, InvalidPrompt),
    (["hi " * 9000], SamplingParams(max_tokens=10), InvalidPrompt),
    (["hi"], SamplingParams(max_tokens=8192), InvalidPrompt),
    (["a", "b"], [SamplingParams()], InvalidSamplingParams),
]


@pytest.mark.parametrize("prompts,params,error", BAD)
def test_bad_input_is_a_typed_error_and_engine_survives(llm, prompts, params, error):
    with pytest.raises(error) as info:
        llm.generate(prompts, params)
    assert isinstance(info.value, JaxgenError) and isinstance(info.value, ValueError)
    assert (
        llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=0),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=-3.0),
        dict(frequency_penalty=2.5),
        dict(n=0),
        dict(logprobs=50),
        dict(min_tokens=20, max_tokens=10),
        dict(stop=[""]),
        dict(temperature="hot"),
        dict(top_p=None),
        dict(presence_penalty=[0.5]),
    ],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert str(info.value)


def test_unknown_model_path_is_typed(tmp_path):
    from jaxgen import LLM
    from jaxgen.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="no such file"):
        LLM(str(tmp_path / "missing"))


def test_detokenizer_never_emits_broken_utf8(default_tokenizer):
    text = "café 東京 🚀🎉 naïve — ok"
    ids = default_tokenizer(text)["input_ids"]
    d = IncrementalDetokenizer(default_tokenizer)
    deltas = [d.push(t) for t in ids] + [d.finish()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_detokenizer_deferred_decodes_once_at_the_end(default_tokenizer):
    """incremental=False (generate: nobody reads deltas): pushes return '' and the text is the
    whole decode, as the incremental deltas give; with stop strings it stays incremental."""
    text = "café 東京 🚀🎉 naïve — ok. Then more"
    ids = default_tokenizer(text)["input_ids"]
    eager, lazy = (
        IncrementalDetokenizer(default_tokenizer),
        IncrementalDetokenizer(default_tokenizer, incremental=False),
    )
    assert [lazy.push(t) for t in ids] == [""] * len(ids)
    assert lazy.current_text() == text  # e.g. an aborted completion's text
    assert lazy.finish() == text == "".join([eager.push(t) for t in ids] + [eager.finish()])
    stopped = IncrementalDetokenizer(default_tokenizer, stop=("ok.",), incremental=False)
    assert stopped.incremental
    deltas = []
    for t in ids:
        deltas.append(stopped.push(t))
        if stopped.stopped_by is not None:
            break
    assert stopped.stopped_by == "ok."
    assert "".join(deltas) + stopped.finish() == text[: text.index("ok.")]


def test_llm_leaves_jax_config_alone(llm):
    """LLM() turns on no process-wide JAX setting unless asked (compilation_cache=True)."""
    import jax

    assert llm.engine is not None
    assert not jax.config.jax_compilation_cache_dir
