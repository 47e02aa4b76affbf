"""GRPO on a tiny policy that rolls out with the engine it trains, in one process.

Each iteration samples `n` completions per prompt with `LLM.generate`, scores them with a
programmatic reward, takes one optax step on the GRPO objective (Shao et al. 2024, DeepSeekMath
§4.1: each completion's advantage is its reward standardised within its prompt's group; one
on-policy step, so the importance ratio is 1 and the clipped objective reduces to the policy
gradient) and hands the new params to the engine with `LLM.update_weights`: a pointer swap, no
copy, no recompile. Returns the reward and the time split (generate / train / update) per
iteration.

The task: copy a pattern. A prompt is [START, d1..dk, SEP] with k random symbols; a completion
of k tokens earns, per position, 1 for the symbol copied there and 0.5 for a symbol of the
pattern in the wrong place.

    python -m benchmarks.rl --iterations 100 [--mesh tp=2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgen.engine.params import SamplingParams
from jaxgen.entrypoints.llm import LLM
from jaxgen.model import ModelConfig, forward, init_params, load_tokenizer

START, SEP = 4, 5  # token ids of the prompt's frame (the tokenizer only renders them)
FIRST_SYMBOL = 10  # the pattern's alphabet: ids FIRST_SYMBOL, FIRST_SYMBOL + 1, ...


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """Copy `length` symbols of an alphabet of `num_symbols`; a policy of `vocab_size` tokens."""

    length: int = 4
    num_symbols: int = 8
    vocab_size: int = 64

    def prompts(self, rng: np.random.Generator, num: int) -> list[list[int]]:
        patterns = FIRST_SYMBOL + rng.integers(0, self.num_symbols, size=(num, self.length))
        return [[START, *map(int, p), SEP] for p in patterns]

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        pattern = prompt[1 : 1 + self.length]
        exact = sum(a == b for a, b in zip(pattern, completion, strict=False))
        present = sum(t in pattern for t in completion) - exact
        return (exact + 0.5 * present) / self.length


def policy_config(task: CopyTask) -> ModelConfig:
    """Two layers of width 64: compiles in seconds, learns the task in a few dozen steps."""
    return ModelConfig(
        arch="llama",
        vocab_size=task.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        eos_token_ids=(2,),
    )


def grpo_loss(params, tokens, mask, advantages, *, cfg):
    """-E[A * log pi(completion token)] over the completion's tokens (tokens i32[B, T], mask
    f32[B, T-1] on the predicted completion positions, advantages f32[B])."""
    logits = forward(cfg, params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    taken = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(advantages[:, None] * taken * mask) / jnp.sum(mask)


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation):
    @jax.jit
    def train_step(params, opt_state, tokens, mask, advantages):
        loss, grads = jax.value_and_grad(grpo_loss)(params, tokens, mask, advantages, cfg=cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """rewards f32[prompts, n] -> advantages standardised within each prompt's group."""
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    return ((rewards - mean) / (std + 1e-4)).reshape(-1)


def run(
    iterations: int = 100,
    *,
    prompts_per_step: int = 8,
    n: int = 8,
    learning_rate: float = 3e-3,
    seed: int = 0,
    mesh: str | None = None,
    task: CopyTask = CopyTask(),
    log=None,
) -> list[dict]:
    """The loop; one record per iteration: reward (mean over the rollouts of the weights
    before its step) and seconds of generate / train / update_weights."""
    cfg = policy_config(task)
    params = init_params(cfg, jax.random.key(seed))
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    train_step = make_train_step(cfg, optimizer)
    rows = prompts_per_step * n
    llm = LLM.from_parts(
        cfg,
        params,
        load_tokenizer(None),
        max_model_len=32,
        max_num_seqs=rows,
        num_kv_pages=4 * rows,
        seed=seed,
        warmup=False,
        mesh=mesh,
    )
    sampling = SamplingParams(n=n, temperature=1.0, max_tokens=task.length, ignore_eos=True)
    rng = np.random.default_rng(seed)
    history = []
    for it in range(iterations):
        prompts = task.prompts(rng, prompts_per_step)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling)
        t1 = time.perf_counter()
        completions = [[c.token_ids for c in o.outputs] for o in outs]
        rewards = np.array(
            [[task.reward(p, c) for c in cs] for p, cs in zip(prompts, completions, strict=True)],
            np.float32,
        )
        tokens = np.array([p + c for p, cs in zip(prompts, completions, strict=True) for c in cs])
        mask = np.zeros((rows, tokens.shape[1] - 1), np.float32)
        mask[:, len(prompts[0]) - 1 :] = 1.0  # positions that predict completion tokens
        params, opt_state, loss = train_step(
            params, opt_state, tokens, mask, group_advantages(rewards)
        )
        jax.block_until_ready(params)
        t2 = time.perf_counter()
        version = llm.update_weights(params)
        t3 = time.perf_counter()
        record = {
            "iteration": it,
            "reward": float(rewards.mean()),
            "loss": float(loss),
            "weights_version": version,
            "generate_s": t1 - t0,
            "train_s": t2 - t1,
            "update_s": t3 - t2,
        }
        history.append(record)
        if log is not None:
            log(record)
    return history


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mesh", default=None, help='e.g. "tp=2"')
    args = parser.parse_args(argv)
    run(
        args.iterations,
        prompts_per_step=args.prompts_per_step,
        n=args.n,
        learning_rate=args.learning_rate,
        seed=args.seed,
        mesh=args.mesh,
        log=lambda r: print(json.dumps(r), flush=True),
    )


if __name__ == "__main__":
    main()
