"""Weights from a single-device trainer into an engine on a tp=2 mesh: `update_weights`
reshards them on the device (the same tokens as an engine built with them), and the GRPO loop
of `benchmarks.rl` trains with its rollouts on that mesh."""

import jax
import numpy as np
import pytest

from benchmarks.rl import CopyTask, policy_config, run
from jaxgen import LLM, SamplingParams
from jaxgen.model import init_params, load_tokenizer


def test_update_weights_reshards_onto_the_mesh():
    cfg, tok = policy_config(CopyTask()), load_tokenizer(None)
    options = dict(max_model_len=32, num_kv_pages=32, max_num_seqs=4, warmup=False, mesh="tp=2")
    old, new = init_params(cfg, jax.random.key(0)), init_params(cfg, jax.random.key(1))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[4, 10, 11, 12, 13, 5], [4, 13, 12, 11, 10, 5]]
    want = [
        o.outputs[0].token_ids
        for o in LLM.from_parts(cfg, new, tok, **options).generate(prompts, greedy)
    ]
    llm = LLM.from_parts(cfg, old, tok, **options)
    llm.generate(prompts, greedy)
    llm.update_weights(new)  # single-device arrays
    placed = llm.get_weights()["layers"]["attn"]["q_proj"]["kernel"]
    assert len(placed.sharding.device_set) == 2
    assert (
        placed.sharding == llm.placement.params(new)["layers"]["attn"]["q_proj"]["kernel"].sharding
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want


@pytest.mark.slow
def test_grpo_loop_on_tp2_mesh():
    records = run(iterations=60, mesh="tp=2")
    rewards = np.array([r["reward"] for r in records])
    assert rewards[-10:].mean() > rewards[:10].mean() + 0.2, rewards
    assert records[-1]["weights_version"] == 60
