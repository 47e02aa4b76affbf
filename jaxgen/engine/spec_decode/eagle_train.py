"""Training an EAGLE draft head for a loaded target in JAX (optax), and measuring what it buys.

The target runs by teacher forcing over a token corpus inside each jitted train step (its
states at the head's layers and its next-token distribution, no gradient), and the head learns:

  EAGLE-1/2 (Li et al. 2024 §4): smooth-L1 between the head's g_j and the target's next state
    h_{j+1}, plus `token_weight` x cross-entropy of the target's distribution at j+1 against the
    target's LM head on g_j (EAGLE's v_w = 1.0, p_w = 0.1).
  EAGLE-3 (Li et al. 2025 §3.3): no state regression; cross-entropy of the target's
    distribution (restricted to the draft vocabulary, renormalised) against the head's, summed
    over `ttt_steps` unrolled drafting steps (training-time test) weighted 0.8^s.

`acceptance` is the held-out figure: windows of held-out text, the target's true greedy
continuation of each (k + 1 tokens), the head's greedy chain of k drafts from the window, and
the tokens a greedy verify step would emit (accepted drafts + 1).

Token ids in, figures out: tokenizing text and writing reports is `cli.train_draft`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgen.model import eagle
from jaxgen.model.config import ModelConfig
from jaxgen.model.eagle_io import save_head
from jaxgen.model.layers import RMSNorm
from jaxgen.model.llama import Transformer

log = logging.getLogger("jaxgen.engine")

TTT_DECAY = 0.8  # EAGLE-3's weight of unrolled step s: 0.8^s


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    version: int = 3  # EAGLE version: 1, 2 (the same head) or 3
    steps: int = 120
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    batch_size: int = 8
    seq_len: int = 256
    ttt_steps: int = 3  # EAGLE-3's training-time test unroll (the paper: 7)
    num_draft: int = 4  # k of the held-out acceptance estimate
    draft_vocab_size: int | None = 8192  # EAGLE-3: the most frequent training tokens (None: V)
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3 (None: eagle.default_aux_layers)
    hidden_weight: float = 1.0  # EAGLE-1/2: smooth-L1 on the next state
    token_weight: float = 0.1  # EAGLE-1/2: cross-entropy on the next token
    eval_windows: int = 64  # held-out windows for the acceptance estimate
    eval_context: int = 64  # tokens of context per window
    eval_batch: int = 16
    checkpoint_every: int = 50  # orbax checkpoint of the head every N steps (0: only the last)
    seed: int = 0

    def __post_init__(self):
        if self.version not in eagle.VERSIONS:
            raise ValueError(f"version must be one of {eagle.VERSIONS}, got {self.version}")
        for field in ("steps", "batch_size", "num_draft", "ttt_steps", "eval_batch"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.seq_len < 2 or self.eval_context < 2:
            raise ValueError("seq_len and eval_context must be >= 2 (a state and its next token)")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.eval_windows < 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("eval_windows, warmup_steps and checkpoint_every must be >= 0")

    def head_config(self, target: ModelConfig) -> eagle.EagleConfig:
        v3 = self.version == 3
        vocab = self.draft_vocab_size if v3 and self.draft_vocab_size else None
        if vocab is not None and vocab >= target.vocab_size:
            vocab = None
        return eagle.EagleConfig.for_target(target, self.version, vocab, self.aux_layers)


def draft_vocabulary(tokens: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """EAGLE-3's reduced draft vocabulary: the `size` most frequent ids of the training tokens
    (ties and unseen ids by id), ascending: i32[size] draft id -> target id."""
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size)[:vocab_size]
    top = np.argsort(-counts, kind="stable")[:size]
    return np.sort(top).astype(np.int32)


def chunks(tokens: np.ndarray, length: int) -> np.ndarray:
    """A 1-D token stream cut into rows of `length` (the tail dropped): i32[N, length]."""
    tokens = np.asarray(tokens, np.int32).ravel()
    rows = len(tokens) // length
    if rows == 0:
        raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one row of {length}")
    return tokens[: rows * length].reshape(rows, length)


def _target_pass(tcfg: ModelConfig, ecfg: eagle.EagleConfig, target_params, tokens):
    """The target by teacher forcing: (logits f32[B, T, V], the head's input states)."""
    layers = ecfg.aux_layers if ecfg.version == 3 else True
    out, _, states = Transformer(tcfg).apply(
        {"params": target_params}, tokens, return_hidden=layers
    )
    return jax.lax.stop_gradient(out), jax.lax.stop_gradient(states)


def _teacher_forced(tcfg: ModelConfig, ecfg: eagle.EagleConfig, target_params, tokens, d2t):
    """The target by teacher forcing for training: (its logits over the head's vocabulary
    f32[B, T, Vh], the head's input states). EAGLE-3 with a reduced vocabulary computes only
    the draft vocabulary's logits: the full ones go unused and XLA drops them (the LM head of a
    49k-token vocabulary is a fifth of a 135M target's work per token)."""
    if ecfg.version < 3 or d2t is None:
        return _target_pass(tcfg, ecfg, target_params, tokens)
    layers = (*ecfg.aux_layers, tcfg.num_layers)
    _, _, states = Transformer(tcfg).apply({"params": target_params}, tokens, return_hidden=layers)
    last = RMSNorm(tcfg.rms_norm_eps).apply({"params": target_params["final_norm"]}, states[-1])
    if tcfg.tie_word_embeddings:
        rows = jnp.take(target_params["embed"], d2t, axis=0).T
    else:
        rows = jnp.take(target_params["lm_head"]["kernel"], d2t, axis=1)
    logits = (last @ rows).astype(jnp.float32)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(states[:-1])


def _cross_entropy(p, logits):
    """Mean over the last axis' distribution p of -log softmax(logits): f32[...]."""
    return -jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def _masked_mean(x, mask):
    mask = jnp.broadcast_to(mask, x.shape).astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def head_loss(
    head_params, target_params, tokens, draft_to_target, *, tcfg, ecfg, train: DraftTrainConfig
):
    """(loss, metrics) of a head on a batch i32[B, T] (the EAGLE losses in the module doc)."""
    target_logits, states = _teacher_forced(tcfg, ecfg, target_params, tokens, draft_to_target)
    embed = eagle.token_embedding(head_params, target_params)
    t = tokens.shape[1]
    valid = jnp.arange(t)
    if ecfg.version < 3:
        g = eagle.unrolled_forward(ecfg, head_params, embed, states, tokens, num_steps=1)[0]
        mask = (valid < t - 1).astype(jnp.float32)[None, :, None]
        next_state = jnp.pad(states[:, 1:], ((0, 0), (0, 1), (0, 0)))
        hidden_loss = _masked_mean(optax.huber_loss(g, next_state).mean(-1, keepdims=True), mask)
        p = jax.nn.softmax(jnp.pad(target_logits[:, 1:], ((0, 0), (0, 1), (0, 0))), axis=-1)
        out = eagle.logits(ecfg, head_params, tcfg, target_params, g)
        token_loss = _masked_mean(_cross_entropy(p, out)[..., None], mask)
        agree = (jnp.argmax(out, -1) == jnp.argmax(p, -1))[..., None]
        loss = train.hidden_weight * hidden_loss + train.token_weight * token_loss
        metrics = {"hidden_loss": hidden_loss, "token_loss": token_loss}
        metrics["accuracy"] = _masked_mean(agree, mask)
        return loss, metrics
    p = jax.nn.softmax(target_logits, axis=-1)  # [B, T, Vh]
    g = eagle.unrolled_forward(ecfg, head_params, embed, states, tokens, num_steps=train.ttt_steps)
    loss, metrics = 0.0, {}
    for s in range(train.ttt_steps):
        # Chain j's step s predicts t_{j+s+2}: the target's distribution at j+s+1.
        p_s = jnp.pad(p[:, s + 1 :], ((0, 0), (0, s + 1), (0, 0)))
        mask = (valid < t - 1 - s).astype(jnp.float32)[None, :]
        out = eagle.logits(ecfg, head_params, tcfg, target_params, g[s])
        ce = _masked_mean(_cross_entropy(p_s, out), mask)
        loss = loss + TTT_DECAY**s * ce
        metrics[f"token_loss_{s}"] = ce
        agree = jnp.argmax(out, -1) == jnp.argmax(p_s, -1)
        metrics[f"accuracy_{s}"] = _masked_mean(agree, mask)
    metrics["accuracy"] = metrics["accuracy_0"]
    return loss, metrics


def optimizer(train: DraftTrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        train.learning_rate,
        min(train.warmup_steps, train.steps - 1) if train.steps > 1 else 0,
        max(train.steps, 2),
        end_value=train.learning_rate * 0.1,
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))


@functools.partial(jax.jit, static_argnames=("tcfg", "ecfg", "train"), donate_argnums=(0, 1))
def train_step(
    head_params, opt_state, target_params, tokens, draft_to_target, *, tcfg, ecfg, train
):
    """One optax step on a batch i32[B, T]: (params, opt_state, loss, metrics)."""
    grad_fn = jax.value_and_grad(head_loss, has_aux=True)
    (loss, metrics), grads = grad_fn(
        head_params, target_params, tokens, draft_to_target, tcfg=tcfg, ecfg=ecfg, train=train
    )
    updates, opt_state = optimizer(train).update(grads, opt_state, head_params)
    return optax.apply_updates(head_params, updates), opt_state, loss, metrics


@functools.partial(jax.jit, static_argnames=("tcfg", "ecfg"))
def _greedy_pass(target_params, tokens, *, tcfg, ecfg):
    logits, states = _target_pass(tcfg, ecfg, target_params, tokens)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), states


@functools.partial(jax.jit, static_argnames=("tcfg", "ecfg", "num_steps"))
def _draft(
    head_params, draft_to_target, target_params, states, next_tokens, *, tcfg, ecfg, num_steps
):
    drafts, _ = eagle.chain_draft(
        ecfg,
        head_params,
        draft_to_target,
        tcfg,
        target_params,
        states,
        next_tokens,
        num_steps=num_steps,
    )
    return drafts


def heldout_windows(tokens: np.ndarray, num: int, length: int) -> np.ndarray:
    """`num` windows of `length` held-out tokens at evenly spaced offsets: i32[num, length]."""
    tokens = np.asarray(tokens, np.int32).ravel()
    if len(tokens) < length + 1:
        raise ValueError(f"held-out text has {len(tokens)} tokens; a window needs {length + 1}")
    starts = np.linspace(0, len(tokens) - length, num).astype(np.int64)
    return np.stack([tokens[s : s + length] for s in starts])


def greedy_continuations(tcfg, ecfg, target_params, windows: np.ndarray, num: int):
    """The target's greedy continuation of each window (`num` tokens, i32[B, num]) and its
    states over the window (for the head). Causal attention: the window's states and each
    next token do not depend on the zeros after them, so one program serves every step."""
    b, w = windows.shape
    buf = np.zeros((b, w + num), np.int32)
    buf[:, :w] = windows
    states = None
    for i in range(num):
        greedy, s = _greedy_pass(target_params, jnp.asarray(buf), tcfg=tcfg, ecfg=ecfg)
        if states is None:
            states = s[..., :w, :]
        buf[:, w + i] = np.asarray(greedy[:, w - 1 + i])
    return buf[:, w:], states


def acceptance(
    tcfg, ecfg, head_params, draft_to_target, target_params, windows, num_draft: int, batch: int
) -> dict:
    """Greedy verification of the head's k-token chains against the target's true greedy
    continuation of each held-out window: mean tokens per verify step (accepted drafts + the
    target's own token) and the acceptance rate at each draft depth."""
    accepted = []
    for start in range(0, len(windows), batch):
        part = windows[start : start + batch]
        if len(part) < batch:  # pad to the compiled batch; the padding rows are dropped
            part = np.concatenate([part, np.repeat(part[-1:], batch - len(part), 0)])
        truth, states = greedy_continuations(tcfg, ecfg, target_params, part, num_draft + 1)
        next_tokens = np.concatenate([part[:, 1:], truth[:, :1]], axis=1)
        drafts = _draft(
            head_params,
            draft_to_target,
            target_params,
            states,
            jnp.asarray(next_tokens),
            tcfg=tcfg,
            ecfg=ecfg,
            num_steps=num_draft,
        )
        hits = np.cumprod(np.asarray(drafts) == truth[:, 1:], axis=1)
        accepted.append(hits[: len(windows) - start])
    hits = np.concatenate(accepted)
    return {
        "tokens_per_step": float(1.0 + hits.sum(1).mean()),
        "acceptance_by_depth": [float(x) for x in hits.mean(0)],
        "windows": int(len(hits)),
        "num_draft": num_draft,
    }


@dataclasses.dataclass
class TrainReport:
    head_dir: str
    steps: int
    tokens: int  # training tokens the head saw (steps x batch x seq_len)
    seconds: float
    losses: list[float]
    accuracies: list[float]
    acceptance_before: dict | None
    acceptance_after: dict | None
    step_seconds: list[float]
    eval_seconds: float  # both acceptance measurements together
    # The process's CPU seconds for the same: on a shared machine, wall time includes waiting
    # for cores that other processes hold.
    step_cpu_seconds: list[float]
    eval_cpu_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def cpu_seconds() -> float:
    """This process's CPU time (user + system, all threads)."""
    times = os.times()
    return times.user + times.system


def save_checkpoint(directory: str, step: int, params, opt_state) -> str:
    """An orbax checkpoint of the head and its optimizer state at `step` (the previous one is
    removed: training keeps its latest)."""
    import orbax.checkpoint as ocp

    root = os.path.join(os.path.abspath(directory), "checkpoints")
    path = os.path.join(root, f"step_{step}")
    if os.path.exists(path):  # a rerun into the same directory
        shutil.rmtree(path)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, {"params": params, "opt_state": jax.tree.leaves(opt_state), "step": step})
    ckpt.wait_until_finished()
    for name in os.listdir(root):
        if name != f"step_{step}" and name.startswith("step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return path


def train_head(
    tcfg: ModelConfig,
    target_params,
    train_tokens: np.ndarray,
    heldout_tokens: np.ndarray | None,
    train: DraftTrainConfig,
    out_dir: str,
    *,
    show_progress: bool = True,
    max_steps: int | None = None,
) -> TrainReport:
    """Trains a head on a 1-D token stream, saves it in the HF layout into `out_dir` (orbax
    checkpoints under out_dir/checkpoints) and measures held-out acceptance before and after.
    `max_steps` stops early (timing runs) with the schedule of `train.steps`."""
    from tqdm import tqdm

    ecfg = train.head_config(tcfg)
    ecfg.check_target(tcfg)
    rows = chunks(train_tokens, train.seq_len)
    if len(rows) < train.batch_size:
        raise ValueError(
            f"the corpus makes {len(rows)} rows of {train.seq_len} tokens, fewer than a batch of "
            f"{train.batch_size}: lower --seq-len or --batch-size, or give more text"
        )
    draft_to_target = None
    if ecfg.draft_vocab_size is not None:
        draft_to_target = jnp.asarray(
            draft_vocabulary(train_tokens, tcfg.vocab_size, ecfg.draft_vocab_size)
        )
    dtype = jnp.dtype(jax.tree.leaves(target_params)[0].dtype)
    params = eagle.init_params(ecfg, jax.random.PRNGKey(train.seed), dtype)
    opt_state = optimizer(train).init(params)
    windows = None
    if heldout_tokens is not None and train.eval_windows:
        windows = heldout_windows(heldout_tokens, train.eval_windows, train.eval_context)

    def measure():
        if windows is None:
            return None
        return acceptance(
            tcfg,
            ecfg,
            params,
            draft_to_target,
            target_params,
            windows,
            train.num_draft,
            train.eval_batch,
        )

    start, cpu = time.perf_counter(), cpu_seconds()
    before = measure()
    eval_seconds, eval_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    rng = np.random.default_rng(train.seed)
    order = rng.permutation(len(rows))
    losses, accuracies, step_seconds, step_cpu = [], [], [], []
    steps = train.steps if max_steps is None else min(max_steps, train.steps)
    bar = tqdm(range(steps), desc="train-draft", unit="step", disable=not show_progress)
    for i in bar:
        at = (i * train.batch_size) % len(rows)
        if at + train.batch_size > len(rows):  # next epoch
            order, at = rng.permutation(len(rows)), 0
        batch = jnp.asarray(rows[order[at : at + train.batch_size]])
        t0, cpu = time.perf_counter(), cpu_seconds()
        params, opt_state, loss, metrics = train_step(
            params,
            opt_state,
            target_params,
            batch,
            draft_to_target,
            tcfg=tcfg,
            ecfg=ecfg,
            train=train,
        )
        losses.append(float(loss))
        step_seconds.append(time.perf_counter() - t0)
        step_cpu.append(cpu_seconds() - cpu)
        accuracies.append(float(metrics["accuracy"]))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{accuracies[-1]:.2f}")
        if train.checkpoint_every and (i + 1) % train.checkpoint_every == 0 and i + 1 < steps:
            save_checkpoint(out_dir, i + 1, params, opt_state)
    save_checkpoint(out_dir, steps, params, opt_state)
    t0, cpu = time.perf_counter(), cpu_seconds()
    after = measure()
    eval_seconds += time.perf_counter() - t0
    eval_cpu += cpu_seconds() - cpu
    save_head(
        out_dir, ecfg, params, None if draft_to_target is None else np.asarray(draft_to_target)
    )
    report = TrainReport(
        head_dir=os.path.abspath(out_dir),
        steps=steps,
        tokens=steps * train.batch_size * train.seq_len,
        seconds=time.perf_counter() - start,
        losses=losses,
        accuracies=accuracies,
        acceptance_before=before,
        acceptance_after=after,
        step_seconds=step_seconds,
        eval_seconds=eval_seconds,
        step_cpu_seconds=step_cpu,
        eval_cpu_seconds=eval_cpu,
    )
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump({"config": _jsonable(train), **report.to_json()}, f, indent=1)
    return report


def _jsonable(train: DraftTrainConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(train).items()}


def plot_losses(report: TrainReport, path: str) -> bool:
    """The loss curve as a PNG (False when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(report.losses) + 1), report.losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("EAGLE head training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
