"""Structured outputs: every token the engine emits under a constraint is one the grammar allows,
greedy rows take the most likely allowed token (checked against an independent replay of the
grammar over the raw logprobs the engine returns), unconstrained rows in the same batch are
unchanged, and bad constraints are typed errors before any device work."""

import json
import re

import jsonschema
import llguidance.numpy
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams, StructuredOutputs
from jaxgen.engine.sample.sampling import allowed_tokens
from jaxgen.engine.sample.structured import bitmask_width
from jaxgen.errors import InvalidSamplingParams

# Random weights write arbitrary JSON strings; keys, enums, booleans and bounded integers keep a
# tiny model's outputs short, and fixed separators keep it from padding with whitespace.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "owl"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["kind", "ok", "n", "tags"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(scope="module")
def llm(tiny):
    cfg, params, tok = tiny
    return LLM.from_parts(cfg, params, tok, max_model_len=256, warmup=False, max_num_seqs=8)


def prompts(num, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 49152, rng.randint(3, 20)).tolist() for _ in range(num)]


def test_bitmask_unpacks_as_llguidance_applies_it():
    rng = np.random.default_rng(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    mask = rng.integers(-(2**31), 2**31, (3, bitmask_width(vocab)), dtype=np.int64).astype(np.int32)
    logits = np.zeros((3, vocab), np.float32)
    llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(mask, vocab)), logits == 0)


def replay_greedy(llm, constraint, output):
    """Replays a greedy completion through a fresh matcher: each token is allowed, the listed
    alternatives (the 20 most likely allowed tokens, raw logprobs) are allowed too, and none is
    more likely than the chosen token."""
    matcher = llm.processor.grammars.matcher(constraint)
    width = bitmask_width(llm.cfg.vocab_size)
    for token, entry in zip(output.token_ids, output.logprobs, strict=True):
        mask = np.frombuffer(matcher.compute_bitmask(), np.int32)[:width][None]
        allowed = np.asarray(allowed_tokens(mask, llm.cfg.vocab_size))[0]
        assert allowed[token], (token, output.token_ids)
        listed = [t for t, lp in entry.items() if lp.logprob > -np.inf]
        assert allowed[listed].all(), (token, listed)
        assert max(entry[t].logprob for t in listed) == entry[token].logprob
        assert matcher.consume_token(token)
    assert matcher.is_stopped()  # finished by the grammar, not by max_tokens


def test_greedy_takes_the_best_allowed_token_and_leaves_other_rows_alone(llm):
    ps = prompts(4)
    constraints = [
        StructuredOutputs(json=SCHEMA),
        StructuredOutputs(regex=r"[a-c]{2,5}(-[0-9]{1,3})?"),
        StructuredOutputs(choice=["alpha", "beta", "gamma delta"]),
        None,  # unconstrained: must equal its output alone
    ]
    params = [
        SamplingParams(max_tokens=80, temperature=0.0, logprobs=20, structured=c)
        for c in constraints
    ]
    outs = llm.generate(ps, params)
    for c, o in zip(constraints[:3], outs, strict=False):
        assert o.outputs[0].finish_reason == "stop"
        replay_greedy(llm, c, o.outputs[0])
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert re.fullmatch(r"[a-c]{2,5}(-[0-9]{1,3})?", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in ("alpha", "beta", "gamma delta")
    alone = llm.generate(ps[3:], params[3])[0].outputs[0]
    assert alone.token_ids == outs[3].outputs[0].token_ids


def test_sampling_filters_and_penalties_compose_with_the_mask(llm):
    regex = r"(yes|no)( [0-9]{2})?"
    p = SamplingParams(
        n=3,
        max_tokens=40,
        temperature=1.3,
        top_k=40,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        seed=7,
        structured={"regex": regex},
    )
    json_p = SamplingParams(
        n=2, max_tokens=80, temperature=1.0, seed=3, structured={"json": SCHEMA}
    )
    outs = llm.generate(prompts(3, seed=1), [p, p, json_p])
    for o in outs[:2]:
        for c in o.outputs:
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    for c in outs[2].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # Seeded sampling under a constraint is reproducible.
    again = llm.generate(prompts(3, seed=1), [p, p, json_p])
    assert [c.token_ids for o in again for c in o.outputs] == [
        c.token_ids for o in outs for c in o.outputs
    ]


def test_overlapped_loop_gives_the_synchronous_outputs(llm, tiny):
    """A constrained step lands the step in flight, fills its masks, then dispatches (a ragged
    step's program takes the bitmask: no program of its own): the same tokens as the
    synchronous loop, with steps overlapped."""
    cfg, params, tok = tiny
    sync = LLM.from_parts(
        cfg, params, tok, max_model_len=256, warmup=False, max_num_seqs=8, overlap=False
    )
    ps = prompts(4, seed=2)
    params_list = [
        SamplingParams(max_tokens=30, temperature=0.0, structured={"regex": "[xyz]{3,9}"}),
        SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=5, structured={"json": SCHEMA}),
        SamplingParams(max_tokens=12, temperature=0.0),  # unconstrained, in the same steps
        SamplingParams(
            max_tokens=20, temperature=0.0, stop_token_ids=[7], structured={"choice": ["ab", "abc"]}
        ),
    ]
    before = llm.engine.overlapped_steps
    got = llm.generate(ps, params_list)
    assert llm.engine.overlapped_steps > before
    want = sync.generate(ps, params_list)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    assert not any("with a token bitmask" in str(k) for k in llm.compiled)
    while llm.engine.has_work:  # the step still in flight (rows of finished sequences)
        llm.engine.step()
    assert llm.engine.bm.num_used_pages == 0


def test_each_constraint_compiles_once(llm):
    grammars = llm.processor.grammars
    misses = grammars.misses
    p = SamplingParams(max_tokens=4, temperature=0.0, structured={"regex": "[0-9]{4}"})
    llm.generate(prompts(3, seed=3), p)
    llm.generate(prompts(1, seed=4), SamplingParams(max_tokens=4, structured={"regex": "[0-9]{4}"}))
    assert grammars.misses == misses + 1
    assert grammars.hits >= 3


@pytest.mark.parametrize(
    "structured, match",
    [
        ({"regex": "(unclosed"}, "regex constraint is not valid"),
        ({"json": {"type": "not-a-type"}}, "json constraint is not valid"),
        ({"json": "{not json"}, "json is not valid"),
        ({"grammar": "start: undefined_rule"}, "grammar constraint is not valid"),
        ({"regex": r"[^\s\S]"}, "accepts no output"),
        ({"grammar": 'start: a\na: a "x"'}, "accepts no output"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable"),
        ({"choice": []}, "at least one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"regexp": "a"}, "unknown fields"),
    ],
)
def test_bad_constraints_are_typed_errors(llm, structured, match):
    with pytest.raises(InvalidSamplingParams, match=match):
        llm.generate(prompts(1), SamplingParams(max_tokens=4, structured=structured))


def test_bad_combinations_are_typed_errors_and_the_engine_stays_usable(llm, tiny):
    cfg, params, tok = tiny
    static = LLM.from_parts(cfg, params, tok, kv_cache="contiguous", max_model_len=64, warmup=False)
    with pytest.raises(InvalidSamplingParams, match="paged engine"):
        static.generate(prompts(1), SamplingParams(max_tokens=4, structured={"regex": "a+"}))
    out = llm.generate(prompts(1), SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    while llm.engine.has_work:
        llm.engine.step()
    assert llm.engine.bm.num_used_pages == 0


def test_preemption_and_speculative_engines_keep_constraints(tiny):
    cfg, params, tok = tiny
    kw = dict(max_model_len=256, warmup=False, max_num_seqs=8)
    p = SamplingParams(max_tokens=60, temperature=0.0, structured={"json": SCHEMA})
    ps = prompts(6, seed=5)
    want = [o.outputs[0].token_ids for o in LLM.from_parts(cfg, params, tok, **kw).generate(ps, p)]
    small = LLM.from_parts(cfg, params, tok, num_kv_pages=24, page_size=8, **kw)
    got = small.generate(ps, p)
    assert small.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for method in ("ngram", "self"):
        # Each verify position is masked by the grammar advanced over the drafts before it.
        spec = LLM.from_parts(
            cfg, params, tok, speculative={"method": method, "num_tokens": 3}, **kw
        )
        assert [o.outputs[0].token_ids for o in spec.generate(ps, p)] == want, method
        stats = spec.stats()["speculative"]
        assert stats["drafted"] > 0, (method, stats)
    # Sampled verification (Leviathan et al.'s rule on the constrained target): valid outputs.
    sampled = SamplingParams(
        n=2, max_tokens=60, temperature=1.0, seed=1, structured={"json": SCHEMA}
    )
    for o in spec.generate(ps, sampled):
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_drafts_the_grammar_forces_are_accepted(tiny):
    """A forced continuation that the prompt also holds: n-gram drafts of it pass verification
    only if each verify position is masked by the grammar advanced over the drafts before it."""
    cfg, params, tok = tiny
    text = " the quick brown fox jumps over the lazy dog and keeps running far away"
    prompt = tok.encode("say:" + text + ". say:", add_special_tokens=False)
    p = SamplingParams(max_tokens=40, temperature=0.0, structured={"choice": [text]})
    kw = dict(max_model_len=256, warmup=False, max_num_seqs=4)
    spec = LLM.from_parts(cfg, params, tok, speculative={"method": "ngram", "num_tokens": 4}, **kw)
    out = spec.generate([prompt], p)[0].outputs[0]
    assert out.text == text and out.finish_reason == "stop"
    stats = spec.stats()["speculative"]
    assert stats["accepted"] >= len(out.token_ids) // 2, stats
    plain = LLM.from_parts(cfg, params, tok, **kw).generate([prompt], p)[0].outputs[0]
    assert plain.token_ids == out.token_ids


def test_ignore_eos_pads_a_complete_output_with_eos(llm):
    p = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, structured={"regex": "[ab]{3}"}
    )
    c = llm.generate(prompts(1, seed=6), p)[0].outputs[0]
    assert c.finish_reason == "length" and re.fullmatch("[ab]{3}", c.text)
    end = next(i for i, t in enumerate(c.token_ids) if t == 2)
    assert set(c.token_ids[end:]) == {2}


def test_beam_search_extends_beams_with_allowed_tokens_only(llm):
    choices = ["red apple", "green pear", "blue berry", "yellow banana"]
    outs = llm.beam_search(prompts(2, seed=7), 3, max_tokens=12, structured={"choice": choices})
    for out in outs:
        assert len(out.sequences) == 3
        assert all(h.text in choices and h.finish_reason == "stop" for h in out.sequences)
        # Distinct paths (two may spell the same choice with different tokens).
        assert len({tuple(h.token_ids) for h in out.sequences}) == 3


@pytest.mark.parametrize("mesh", ["tp=2", "dp=2"])
def test_meshes_give_the_single_device_outputs(llm, tiny, mesh):
    """Tensor parallel: the mask applies to the gathered logits; data parallel: each replica's
    engine fills its own steps' masks."""
    cfg, params, tok = tiny
    ps = prompts(4, seed=8)
    p = SamplingParams(max_tokens=60, temperature=0.0, structured={"json": SCHEMA})
    want = [o.outputs[0].token_ids for o in llm.generate(ps, p)]
    sharded = LLM.from_parts(
        cfg, params, tok, mesh=mesh, max_model_len=256, warmup=False, max_num_seqs=8
    )
    assert [o.outputs[0].token_ids for o in sharded.generate(ps, p)] == want


def test_a_schema_takes_only_the_keys_it_names_unless_the_request_says(llm):
    """vLLM's default through its grammar backends: an object schema that names its properties
    and says nothing of others allows no other key (`StructuredOutputs.additional_properties`
    opens it)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    tokens = llm.tokenizer.encode('{"name": "Ada", "name_name": "x"}')

    def accepted(constraint) -> int:  # how many of the tokens the grammar takes
        return llm.processor.grammars.matcher(constraint).validate_tokens(tokens)

    assert accepted(StructuredOutputs(json=schema, additional_properties=True)) == len(tokens)
    assert accepted(StructuredOutputs(json=schema)) < len(tokens)
    said = {**schema, "additionalProperties": {"type": "string"}}  # a schema's word is kept
    assert accepted(StructuredOutputs(json=said)) == len(tokens)
