"""Beam search inside the scheduler: width 1 is greedy; on a tiny model it matches a
reference beam search that rescores every candidate with a full forward pass, and with
width = vocabulary it finds the exhaustive optimum."""

import itertools

import jax
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.model import ModelConfig, forward, init_params

VOCAB = 10  # <= 10: beam width up to the whole vocabulary


@pytest.fixture(scope="module")
def tiny(default_tokenizer):
    cfg = ModelConfig(
        arch="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    # Larger weights than the default init so the distributions are far from uniform.
    params = jax.tree.map(lambda p: p * 20, init_params(cfg, jax.random.key(7)))
    return cfg, params, make_llm(cfg, params, default_tokenizer)


def make_llm(cfg, params, tokenizer, **kwargs):
    llm = LLM.from_parts(
        cfg,
        params,
        tokenizer,
        max_model_len=256,
        max_num_seqs=16,
        page_size=4,
        warmup=False,
        **kwargs,
    )
    llm.eos_ids = frozenset({2})
    return llm


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def reference_beam_search(cfg, params, prompt, width, max_tokens, eos, length_penalty=1.0):
    """Independent implementation: full forward for every beam at every step, no cache."""
    beams = [([], 0.0)]
    finished = []
    for step in range(max_tokens):
        cands = []
        for toks, cum in beams:
            logits = np.asarray(forward(cfg, params, [prompt + toks]))[0, -1]
            lp = log_softmax(logits.astype(np.float64))
            for t in np.argsort(-lp)[: 2 * width]:
                cands.append((cum + lp[t], toks + [int(t)]))
        cands.sort(key=lambda c: -c[0])
        beams = []
        for cum, toks in cands:
            if toks[-1] in eos:
                finished.append((toks, cum, cum / len(toks) ** length_penalty))
                continue
            beams.append((toks, cum))
            if len(beams) == width:
                break
        finished = sorted(finished, key=lambda h: -h[2])[:width]
        length = step + 1
        if (
            not beams
            or length >= max_tokens
            or (len(finished) >= width and beams[0][1] / length**length_penalty < finished[-1][2])
        ):
            break
    finished += [(toks, cum, cum / len(toks) ** length_penalty) for toks, cum in beams]
    return sorted(finished, key=lambda h: -h[2])[:width]


def test_width_one_is_greedy(tiny):
    _, _, llm = tiny
    prompt = [3, 5, 7, 9, 4]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    beam = llm.beam_search([prompt], beam_width=1, max_tokens=10, ignore_eos=True)
    assert beam[0].sequences[0].token_ids == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("width,max_tokens", [(2, 6), (4, 5)])
def test_matches_reference_beam_search(tiny, width, max_tokens):
    cfg, params, llm = tiny
    prompt = [4, 8, 1, 6]
    ours = llm.beam_search([prompt], beam_width=width, max_tokens=max_tokens)[0].sequences
    want = reference_beam_search(cfg, params, prompt, width, max_tokens, eos={2})
    assert [h.token_ids for h in ours] == [w[0] for w in want]
    np.testing.assert_allclose([h.score for h in ours], [w[2] for w in want], atol=1e-4)
    assert llm.engine.bm.num_used_pages == 0  # every beam's pages were freed


def test_full_width_finds_exhaustive_optimum(tiny):
    cfg, params, llm = tiny
    prompt = [5, 3, 7]
    out = llm.beam_search([prompt], beam_width=VOCAB, max_tokens=2, ignore_eos=True)[0]
    best, best_score = None, -np.inf
    for pair in itertools.product(range(VOCAB), repeat=2):
        logits = np.asarray(forward(cfg, params, [prompt + [pair[0]]]))[0]
        score = (
            log_softmax(logits[-2].astype(np.float64))[pair[0]]
            + log_softmax(logits[-1].astype(np.float64))[pair[1]]
        )
        if score > best_score:
            best, best_score = list(pair), score
    top = out.sequences[0]
    assert top.token_ids == best
    assert top.cumulative_logprob == pytest.approx(best_score, abs=1e-4)


def test_preempted_beams_give_the_same_beams(tiny, default_tokenizer):
    """A pool too small for every beam of every request preempts beams mid-search; the
    request's other beams wait for the preempted ones, so the search (and its result) is the
    one a large pool gives."""
    cfg, params, llm = tiny
    prompts = [[3 + (i * 3 + j) % 7 for j in range(10 + 3 * i)] for i in range(4)]

    def beams(out):
        return [[(h.token_ids, round(h.score, 4)) for h in o.sequences] for o in out]

    want = beams(llm.beam_search(prompts, beam_width=4, max_tokens=24, ignore_eos=True))
    small = make_llm(cfg, params, default_tokenizer, num_kv_pages=40)
    assert beams(small.beam_search(prompts, beam_width=4, max_tokens=24, ignore_eos=True)) == want
    assert small.stats()["preemptions"] > 0  # the pool really was too small
    assert small.stats()["pages_used"] == 0
    small.engine.bm.check_invariants()
