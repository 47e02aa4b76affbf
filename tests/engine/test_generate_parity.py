"""Greedy generation is token-identical to transformers' generate on the default model."""

import numpy as np
import pytest
import torch

from jaxgen import SamplingParams

QUESTIONS = [
    "Explain in detail how photosynthesis works.",
    "Write a short story about a robot who learns to paint.",
    "List ten facts about the planet Mars.",
    "Hi",
]
NEW_TOKENS = 48


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def prompts_and_reference(llm, hf_default_model):
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    reference = [hf_greedy(hf_default_model, p["prompt_token_ids"], NEW_TOKENS) for p in prompts]
    return prompts, reference


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.mark.slow
def test_single_prompts_match_transformers(llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    for prompt, want in zip(prompts, reference, strict=True):
        got = llm.generate([prompt], PARAMS)[0].outputs[0].token_ids
        assert got == want


@pytest.mark.slow
def test_batched_mixed_lengths_match_transformers(llm, prompts_and_reference):
    prompts, reference = prompts_and_reference
    lengths = {len(p["prompt_token_ids"]) for p in prompts}
    assert len(lengths) == len(prompts)  # genuinely mixed lengths
    outs = llm.generate(prompts, PARAMS)
    for out, want in zip(outs, reference, strict=True):
        assert out.outputs[0].token_ids == want
        assert len(want) == NEW_TOKENS
    assert np.all([o.outputs[0].finish_reason == "length" for o in outs])
