"""The GRPO loop of `benchmarks.rl` (notebooks/07_rl_loop.ipynb): the tiny policy's reward rises
while the engine it generates with takes each step's params, and nothing recompiles once the
loop's shapes have compiled."""

import numpy as np
import pytest

from benchmarks.rl import CopyTask, group_advantages, run
from jaxgen.engine.metrics import CompileCounter


def test_copy_task_reward():
    task = CopyTask(length=4)
    prompt = [4, 10, 11, 12, 13, 5]
    assert task.reward(prompt, [10, 11, 12, 13]) == 1.0
    assert task.reward(prompt, [11, 10, 30, 30]) == 0.25  # two in the wrong place
    assert task.reward(prompt, [30, 30, 30, 30]) == 0.0


def test_group_advantages_are_standardised_per_prompt():
    adv = group_advantages(np.array([[0.0, 1.0], [5.0, 5.0]], np.float32)).reshape(2, 2)
    assert adv[0, 1] > 0 > adv[0, 0]
    assert np.all(adv[1] == 0)  # a group of equal rewards teaches nothing


def counted_run(**kwargs):
    records = []
    counter = CompileCounter().install()
    try:
        run(log=lambda r: records.append({**r, "compiles": counter.compiles}), **kwargs)
    finally:
        counter.close()
    return records


@pytest.mark.slow
def test_reward_rises_and_updates_compile_nothing():
    records = counted_run(iterations=80)
    rewards = np.array([r["reward"] for r in records])
    assert rewards[-10:].mean() > rewards[:10].mean() + 0.25, rewards
    assert [r["weights_version"] for r in records] == list(range(1, 81))
    # The rollouts', the train step's and the update's programs compile in the first
    # iterations; the rest of the loop compiles nothing.
    assert records[-1]["compiles"] == records[2]["compiles"]
