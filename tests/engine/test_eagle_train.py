"""Training EAGLE heads (`engine.spec_decode.eagle_train`) and `jaxgen train-draft`: on a tiny
target that has learnt a corpus of repeated patterns, a few dozen steps lower the head's loss
and raise its held-out acceptance (greedy chains against the target's true greedy
continuation) well above the untrained head's; the command runs end to end and its head loads."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgen.engine.spec_decode import eagle_train
from jaxgen.model.config import ModelConfig
from jaxgen.model.eagle_io import load_head
from jaxgen.model.llama import Transformer, init_params

TARGET = ModelConfig(
    arch="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)


def pattern_stream(length, seed):
    """Six fixed 5-token words in random order: inside a word the next token is determined."""
    words = np.random.RandomState(0).randint(0, TARGET.vocab_size, (6, 5))
    picks = np.random.RandomState(seed).randint(0, len(words), length // 5 + 1)
    return words[picks].ravel()[:length].astype(np.int32)


@pytest.fixture(scope="module")
def target_params():
    """The tiny target, trained on the pattern corpus until it predicts inside the words."""
    params = init_params(TARGET, jax.random.PRNGKey(0))
    rows = eagle_train.chunks(pattern_stream(16 * 64 * 8, seed=1), 64)
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, tokens):
        def loss(p):
            logits, _ = Transformer(TARGET).apply({"params": p}, tokens)
            logp = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    for i in range(60):
        params, state, value = step(
            params, state, jnp.asarray(rows[(i % 8) * 16 : (i % 8 + 1) * 16])
        )
    assert float(value) < 1.5  # ln 64 = 4.2 untrained; ~0.36 is the corpus's entropy
    return params


@pytest.mark.slow
@pytest.mark.parametrize("version", [3, 2])
def test_training_lowers_loss_and_raises_heldout_acceptance(version, target_params, tmp_path):
    train = eagle_train.DraftTrainConfig(
        version=version,
        steps=60,
        learning_rate=1e-2,
        warmup_steps=4,
        batch_size=8,
        seq_len=64,
        ttt_steps=2,
        num_draft=4,
        draft_vocab_size=48,
        aux_layers=(1, 2, 3) if version == 3 else None,
        eval_windows=32,
        eval_context=24,
        eval_batch=16,
        checkpoint_every=20,
    )
    report = eagle_train.train_head(
        TARGET,
        target_params,
        pattern_stream(8000, seed=2),
        pattern_stream(2000, seed=3),  # held out: the same words in another order
        train,
        str(tmp_path),
        show_progress=False,
    )
    first, last = np.mean(report.losses[:3]), np.mean(report.losses[-3:])
    before = report.acceptance_before["tokens_per_step"]
    after = report.acceptance_after["tokens_per_step"]
    print(
        f"EAGLE-{version}: loss {first:.3f} -> {last:.3f}, held-out tokens/step "
        f"{before:.2f} -> {after:.2f} (k=4)"
    )
    assert last < 0.5 * first
    assert after >= before + 1.0, (before, after)
    # The saved head loads and drafts as it did in training.
    cfg, params, d2t = load_head(str(tmp_path), TARGET)
    assert cfg == train.head_config(TARGET)
    windows = eagle_train.heldout_windows(pattern_stream(2000, seed=3), 32, 24)
    again = eagle_train.acceptance(TARGET, cfg, params, d2t, target_params, windows, 4, 16)
    assert again["tokens_per_step"] == pytest.approx(after)
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["steps"] == 60 and len(saved["losses"]) == 60
    assert os.listdir(tmp_path / "checkpoints") == ["step_60"]


@pytest.mark.slow
def test_train_draft_command_end_to_end(tmp_path, capsys):
    """`jaxgen train-draft` on a tiny random target with the default model's tokenizer: the head
    it saves loads, its summary has the figures, and --time-steps projects the full run."""
    from jaxgen.cli.main import main
    from jaxgen.model import load_tokenizer, save_checkpoint

    tokenizer = load_tokenizer(None)
    cfg = ModelConfig(**{**vars(TARGET), "vocab_size": tokenizer.vocab_size, "num_layers": 3})
    model_dir = str(tmp_path / "target")
    save_checkpoint(model_dir, cfg, init_params(cfg, jax.random.PRNGKey(0)), tokenizer)
    words = "the cat sat on the mat and the dog ran in the park while it rained".split()
    rng = np.random.RandomState(0)
    for name in ("corpus.txt", "heldout.txt"):
        lines = [" ".join(rng.choice(words, 40)) for _ in range(30)]
        (tmp_path / name).write_text("\n".join(lines))
    args = ["train-draft", "--model", model_dir, "--corpus", str(tmp_path / "corpus.txt")]
    args += ["--heldout", str(tmp_path / "heldout.txt"), "--steps", "3", "--batch-size", "2"]
    args += ["--seq-len", "32", "--draft-vocab-size", "64", "--aux-layers", "0,1,3"]
    args += ["--eval-windows", "4", "--eval-context", "16", "--eval-batch", "4", "--quiet"]
    out = str(tmp_path / "head")
    assert main([*args, "--out", out, "--json", "--checkpoint-every", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and summary["tokens_trained"] == 3 * 2 * 32
    assert summary["acceptance_after"]["windows"] == 4
    assert os.path.isfile(os.path.join(out, "loss.png"))
    head_cfg, params, d2t = load_head(out, cfg)
    assert head_cfg.aux_layers == (0, 1, 3) and d2t.shape == (64,)
    assert main([*args, "--out", str(tmp_path / "timed"), "--json", "--time-steps", "2"]) == 0
    timed = json.loads(capsys.readouterr().out)
    assert timed["steps"] == 2 and timed["projected_minutes"] >= 0
    assert 0 < timed["projected_cpu_minutes"]


@pytest.mark.parametrize("tie", [True, False])
def test_teacher_forcing_over_the_draft_vocabulary(tie):
    """Training computes the target's logits at the draft vocabulary only: the same numbers as
    the full logits' columns there, and the same states."""
    cfg = ModelConfig(**{**vars(TARGET), "tie_word_embeddings": tie})
    params = init_params(cfg, jax.random.PRNGKey(0))
    train = eagle_train.DraftTrainConfig(draft_vocab_size=20, aux_layers=(1, 2, 3))
    ecfg = train.head_config(cfg)
    d2t = jnp.arange(20, dtype=jnp.int32) * 3
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, cfg.vocab_size)
    logits, states = eagle_train._teacher_forced(cfg, ecfg, params, tokens, d2t)
    full, full_states = eagle_train._target_pass(cfg, ecfg, params, tokens)
    np.testing.assert_allclose(logits, full[..., d2t], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(states, full_states)


def test_generated_answers_join_the_corpus():
    """--generate: the target's greedy chat answers to prompts cut from the corpus, each
    conversation's prompt and answer tokens followed by EOS."""
    from jaxgen.cli.train_draft import _generated
    from jaxgen.model import load_tokenizer

    tokenizer = load_tokenizer(None)
    cfg = ModelConfig(**{**vars(TARGET), "vocab_size": tokenizer.vocab_size, "eos_token_ids": (2,)})
    words = " ".join(f"word{i}" for i in range(40))
    text = "\n".join([words, "short line", words.upper()])
    ids = _generated(cfg, init_params(cfg, jax.random.PRNGKey(0)), tokenizer, text, 2, 5)
    text = tokenizer.decode(ids)
    assert ids[-1] == 2 and text.count("Continue this text: word0 word1") == 1
    assert text.count("Continue this text: WORD0 WORD1") == 1
    assert text.index("WORD0") > text.index("word39")  # one conversation after the other
