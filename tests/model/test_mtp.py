"""DeepSeek-V3's multi-token-prediction module: loaded from a checkpoint's model.layers.{L}.*
tensors (random weights: transformers drops the module), its cached forward equal to a
cache-free recomputation, and as the engine's speculative drafter, lossless: greedy tokens
identical to plain decoding, with acceptance counters reported."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.model import load_model, save_checkpoint
from jaxgen.model.mtp import mtp_block, mtp_logits, mtp_norm, trunk
from tests.engine.test_mla_engine import _contiguous_greedy
from tests.model.test_mla import _model

CASE = "v3-q-lora-grouped"


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A Hugging Face directory of the case's model plus one random MTP module (layer L: enorm,
    hnorm, eh_proj, a decoder block like the last layer's with other weights, shared_head)."""
    from safetensors.numpy import load_file, save_file

    from jaxgen.model import load_tokenizer

    _, directory, cfg, params = _model(CASE)
    out = tmp_path_factory.mktemp("mtp")
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    rng = np.random.RandomState(3)
    last, mtp, d = (
        f"model.layers.{cfg.num_layers - 1}.",
        f"model.layers.{cfg.num_layers}.",
        cfg.hidden_size,
    )
    written = {}
    for name in [n for n in tensors if n.startswith(last)]:
        w = tensors[name]
        if name.endswith("e_score_correction_bias"):
            new = w + rng.normal(0, 0.3, w.shape)
        elif "norm" in name:
            new = 1.0 + 0.1 * rng.randn(*w.shape)
        else:
            new = rng.normal(0, max(float(w.std()), 0.02), w.shape)
        written[mtp + name[len(last) :]] = new.astype(np.float32)
    written[f"{mtp}enorm.weight"] = (1.0 + 0.1 * rng.randn(d)).astype(np.float32)
    written[f"{mtp}hnorm.weight"] = (1.0 + 0.1 * rng.randn(d)).astype(np.float32)
    written[f"{mtp}eh_proj.weight"] = rng.normal(0, 0.05, (d, 2 * d)).astype(np.float32)
    written[f"{mtp}shared_head.norm.weight"] = (1.0 + 0.1 * rng.randn(d)).astype(np.float32)
    written[f"{mtp}shared_head.head.weight"] = tensors["lm_head.weight"]
    written[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    save_file({**tensors, **written}, str(out / "model.safetensors"))
    load_tokenizer(None).save_pretrained(str(out))
    return str(out), cfg, params, written


def test_mtp_module_loads_beside_the_unchanged_model(mtp_checkpoint, tmp_path):
    directory, cfg, params, written = mtp_checkpoint
    cfg2, params2 = load_model(directory, show_progress=False)
    assert cfg2 == cfg
    mtp = params2.pop("mtp")
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    prefix = f"model.layers.{cfg.num_layers}."
    np.testing.assert_array_equal(mtp["eh_proj"]["kernel"], written[prefix + "eh_proj.weight"].T)
    np.testing.assert_array_equal(mtp["hnorm"]["scale"], written[prefix + "hnorm.weight"])
    np.testing.assert_array_equal(mtp["norm"]["scale"], written[prefix + "shared_head.norm.weight"])
    kv_b = mtp["layer"]["attn"]["kv_b_proj"]["kernel"]
    np.testing.assert_array_equal(kv_b[0], written[prefix + "self_attn.kv_b_proj.weight"].T)
    router = mtp["layer"]["moe"]["router"]
    np.testing.assert_array_equal(router[0], written[prefix + "mlp.gate.weight"].T)
    # A jaxgen (orbax) checkpoint keeps the module.
    params2["mtp"] = mtp
    save_checkpoint(str(tmp_path), cfg2, params2)
    _, params3 = load_model(str(tmp_path), show_progress=False)
    jax.tree.map(np.testing.assert_array_equal, params3, params2)


def _module_no_cache(cfg, params, tokens, drafts=(), every=False):
    """Cache-free: the module over h(t_0..t_{n-1}) and t_1..t_n, then recursively over its own
    last output and each draft; returns the logits of the last position (every position's
    with `every`: causal, so entry i is what a prefix of i + 2 tokens drafts first)."""
    from jaxgen.cache.contiguous import StepMetadata

    n = len(tokens) - 1
    t = jnp.asarray([tokens], jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    md = StepMetadata(num_new=jnp.asarray([n], jnp.int32), fresh=True)
    h, _ = trunk(cfg, params, t[:, :-1], pos, None, md)
    g, _ = mtp_block(cfg, params, h, t[:, 1:], pos, None, md)
    for i in range(len(drafts)):  # position n + i: the previous output norm(g) and draft i
        h = jnp.concatenate([h, mtp_norm(cfg, params, g[:, -1:])], axis=1)
        nxt = jnp.concatenate([t[:, 1:], jnp.asarray([list(drafts[: i + 1])], jnp.int32)], 1)
        pos = jnp.arange(n + i + 1, dtype=jnp.int32)[None]
        md = StepMetadata(num_new=jnp.asarray([n + i + 1], jnp.int32), fresh=True)
        # Earlier positions keep their inputs; only the newest uses the recursive ones.
        g, _ = mtp_block(cfg, params, h, nxt, pos, None, md)
    logits = np.asarray(mtp_logits(cfg, params, g))[0]
    return logits if every else logits[-1]


def _spy(drafter):
    """Records the drafter's proposals [(sequence, drafts)] and the sequences whose first draft
    recomputed the main model's hidden states instead of reading the handed-over ones."""
    proposed, recomputed = [], []
    propose, run = drafter.propose, drafter._run_mtp

    def spy_propose(states, k, sa):
        seqs = {s.id: list(s.tokens) for s in states}
        drafts, logq, rows = propose(states, k, sa)
        proposed.extend((seqs[sid], d) for sid, d in drafts.items())
        return drafts, logq, rows

    def spy_run(rows, sa, step, hidden, index):
        if hidden is None:
            recomputed.extend(sid for sid, *_ in rows)
        return run(rows, sa, step, hidden, index)

    drafter.propose, drafter._run_mtp = spy_propose, spy_run
    return proposed, recomputed


@pytest.mark.slow
def test_mtp_drafter_is_lossless(mtp_checkpoint):
    """Greedy tokens with the MTP drafter (k = 3) equal plain decoding's, acceptance counters
    are reported; the drafter's proposals (through its latent pages), from the target's
    handed-over hidden states in the engine and from its own recomputation, equal the module's
    cache-free argmax, recursive drafts included."""
    from types import SimpleNamespace

    from jaxgen.engine.sample.sampling import SamplingArrays

    directory, cfg, _, _ = mtp_checkpoint
    prompts = [[5, 9, 17, 33, 2, 64], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # Plain greedy decoding (test_mla_engine: equal to the engine's and to transformers').
    want = [_contiguous_greedy(cfg, _model(CASE)[3], p, 8) for p in prompts]
    spec = LLM(
        model=directory,
        max_model_len=64,
        max_num_seqs=4,
        page_size=4,
        warmup=False,
        speculative={"method": "mtp", "num_tokens": 3},
    )
    drafter = spec.engine.drafter
    params = drafter.params
    proposed, recomputed = _spy(drafter)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp)]
    assert got == want
    stats = spec.engine.stats()["speculative"]
    assert stats["method"] == "mtp" and stats["drafted"] > 0 and stats["verify_rows"] > 0
    assert 0 <= stats["accepted"] <= stats["drafted"]
    print("MTP drafter on a random module:", stats)
    # The hand-over: every first draft in the engine read the hidden states its prefill or verify
    # step returned (the main layers never ran in the drafter), and each proposal equals the
    # module's cache-free argmax over the sequence it was drafted for.
    assert len(proposed) >= 2 * len(prompts) and not recomputed
    first = {}  # prompt -> the cache-free first draft after each prefix of its final sequence
    for p, out in zip(prompts, got, strict=True):
        first[p[0]] = np.argmax(_module_no_cache(cfg, params, p + out, every=True), -1)
    for seq, (d1, _, _) in proposed:
        assert d1 == first[seq[0]][len(seq) - 2]
    seq, (d1, d2, _) = proposed[-1]  # the recursive drafts follow the handed-over first one
    assert d2 == int(np.argmax(_module_no_cache(cfg, params, seq, [d1])))

    # The recomputation (a sequence with no handed-over states, here a probe) proposes the same.
    seq = prompts[0] + want[0][:1]
    state = SimpleNamespace(id="probe", tokens=seq, seq=SimpleNamespace(output_ids=want[0][:1]))
    sa = SamplingArrays.build([sp], np.zeros((1, 2), np.uint32))
    drafts, logq, rows = drafter.propose([state], 2, sa)
    d1, d2 = drafts["probe"]
    assert d1 == int(np.argmax(_module_no_cache(cfg, params, seq)))
    assert d2 == int(np.argmax(_module_no_cache(cfg, params, seq, [d1])))
    assert logq.shape == (1, 2, cfg.vocab_size) and rows == {"probe": 0}
    # As after a verify step accepting drafts: three more tokens, rolled back to all but the
    # newest, then a catch-up over several tokens with cached context.
    seq = seq + want[0][1:4]
    drafter.rollback("probe", len(seq) - 1)
    state = SimpleNamespace(id="probe", tokens=seq, seq=SimpleNamespace(output_ids=want[0][:4]))
    drafts, _, _ = drafter.propose([state], 2, sa)
    d1, d2 = drafts["probe"]
    assert d1 == int(np.argmax(_module_no_cache(cfg, params, seq)))
    assert d2 == int(np.argmax(_module_no_cache(cfg, params, seq, [d1])))
    drafter.release("probe")


def test_mtp_without_module_is_a_typed_error(tmp_path, default_tokenizer):
    _, _, cfg, params = _model(CASE)
    save_checkpoint(str(tmp_path), cfg, params, default_tokenizer)
    with pytest.raises(ValueError, match="multi-token-prediction module"):
        LLM(
            model=str(tmp_path),
            max_model_len=64,
            warmup=False,
            speculative={"method": "mtp", "num_tokens": 2},
        )


def test_the_command_line_offers_the_mtp_drafter():
    from jaxgen.cli.main import build_parser
    from jaxgen.cli.options import llm_options

    args = build_parser().parse_args(["generate", "hi", "--speculative", "mtp"])
    spec = llm_options(args)["speculative"]
    assert spec["method"] == "mtp" and spec["num_tokens"] == 4
