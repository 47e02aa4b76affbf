"""EAGLE draft heads (`model.eagle`, `model.eagle_io`): the target's states at chosen layers
(default outputs unchanged), the head's forward and EAGLE-3 fusion, the training-time-test
unroll equal to chain drafting, and the HF layout round trip."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.model import eagle
from jaxgen.model.config import ModelConfig
from jaxgen.model.eagle_io import load_head, save_head
from jaxgen.model.errors import ModelLoadError
from jaxgen.model.llama import Transformer, init_params

TARGET = ModelConfig(
    arch="llama",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def target_params():
    return init_params(TARGET, jax.random.PRNGKey(0))


def _tokens(batch, length, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, TARGET.vocab_size)


def test_layer_states_leave_default_outputs_unchanged(target_params):
    tokens = _tokens(2, 7)
    model = Transformer(TARGET)
    logits, _ = model.apply({"params": target_params}, tokens)
    logits_h, _, states = model.apply({"params": target_params}, tokens, return_hidden=(0, 2, 5))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_h))
    assert states.shape == (3, 2, 7, TARGET.hidden_size)
    emb = jnp.take(target_params["embed"], tokens, axis=0)
    np.testing.assert_array_equal(np.asarray(states[0]), np.asarray(emb))
    # The state after the last layer, normed, is what return_hidden=True hands over.
    _, _, hidden = model.apply({"params": target_params}, tokens, return_hidden=True)
    from jaxgen.model.layers import RMSNorm

    normed = RMSNorm(TARGET.rms_norm_eps).apply({"params": target_params["final_norm"]}, states[2])
    np.testing.assert_allclose(np.asarray(normed), np.asarray(hidden), rtol=1e-6, atol=1e-6)
    # The default program is the same program: the jaxpr does not change.
    default = jax.make_jaxpr(lambda p, t: model.apply({"params": p}, t))(target_params, tokens)
    assert "collect" not in str(default) and str(default).count("scan") == 1
    with pytest.raises(ValueError, match=r"in \[0, 5\]"):
        model.apply({"params": target_params}, tokens, return_hidden=(6,))


def test_layer_states_agree_scanned_and_unrolled(target_params):
    from jaxgen.model.llama import unroll_layers

    tokens = _tokens(1, 5)
    model = Transformer(TARGET)
    _, _, scanned = model.apply({"params": target_params}, tokens, return_hidden=(1, 3, 4))
    unrolled = unroll_layers(target_params, TARGET)
    _, _, per_layer = model.apply({"params": unrolled}, tokens, return_hidden=(1, 3, 4))
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(per_layer), rtol=1e-5, atol=1e-6)


def _states(cfg, target_params, tokens):
    model = Transformer(TARGET)
    if cfg.version == 3:
        return model.apply({"params": target_params}, tokens, return_hidden=cfg.aux_layers)[2]
    return model.apply({"params": target_params}, tokens, return_hidden=True)[2]


@pytest.mark.parametrize("version", [2, 3])
def test_head_shapes_and_fusion(version, target_params):
    cfg = eagle.EagleConfig.for_target(
        TARGET,
        version,
        draft_vocab_size=40 if version == 3 else None,
        aux_layers=(1, 2, 4) if version == 3 else None,
    )
    params = eagle.init_params(cfg, jax.random.PRNGKey(2))
    fc = params["fc"]["kernel"]
    assert fc.shape == ((3 * 32, 32) if version == 3 else (64, 32))
    assert ("lm_head" in params) == (version == 3) and ("bias" in params["fc"]) == (version < 3)
    tokens = _tokens(2, 6)
    states = _states(cfg, target_params, tokens)
    if version == 3:
        # Fusion: fc over [low | mid | high], in that order.
        fused = eagle.fuse(cfg, params, states)
        expect = jnp.concatenate([states[0], states[1], states[2]], -1) @ fc
        np.testing.assert_allclose(np.asarray(fused), np.asarray(expect), rtol=1e-5, atol=1e-6)
        assert params["layer"]["q_proj"]["kernel"].shape == (64, 32)
    g = jax.jit(lambda p, e, s, t: eagle.unrolled_forward(cfg, p, e, s, t, num_steps=3))(
        params, target_params["embed"], states, tokens
    )
    assert g.shape == (3, 2, 6, 32)
    out = eagle.logits(cfg, params, TARGET, target_params, g)
    assert out.shape == (3, 2, 6, cfg.head_vocab_size) and out.dtype == jnp.float32
    d2t = jnp.arange(40, dtype=jnp.int32) * 2 if version == 3 else None
    drafts, logp = jax.jit(
        lambda p, s, t: eagle.chain_draft(cfg, p, d2t, TARGET, target_params, s, t, num_steps=4)
    )(params, states, tokens)
    assert drafts.shape == (2, 4) and logp.shape == (2, 4, cfg.head_vocab_size)
    if version == 3:
        assert np.all(np.asarray(drafts) % 2 == 0)  # mapped through draft_to_target


@pytest.mark.parametrize("version", [1, 3])
def test_training_time_test_is_chain_drafting(version, target_params):
    """Chain j's step s in the unrolled forward sees exactly what drafting from position j
    does, when the chain is fed the same tokens: their outputs match."""
    cfg = eagle.EagleConfig.for_target(
        TARGET, version, aux_layers=(1, 2, 4) if version == 3 else None
    )
    params = eagle.init_params(cfg, jax.random.PRNGKey(3))
    tokens = _tokens(1, 8)
    states = _states(cfg, target_params, tokens)
    steps = 3
    unrolled = jax.jit(
        lambda p, s, t: eagle.unrolled_forward(cfg, p, s[0], s[1], t, num_steps=steps)
    )
    g = unrolled(params, (target_params["embed"], states), tokens)
    j = 4  # chain from position j, teacher-forced tokens t_{j+1}, t_{j+2}, ...
    embed = target_params["embed"]
    hidden = eagle.fuse(cfg, params, states)[:, : j + 1]
    pos = jnp.arange(j + 1)[None]
    empty = jnp.zeros((1, 0, cfg.num_kv_heads, cfg.head_dim))
    head_step = jax.jit(functools.partial(eagle.step, cfg))
    out, pk, pv = head_step(
        params,
        embed,
        hidden,
        tokens[:, 1 : j + 2],
        pos,
        empty,
        empty,
        eagle.causal_mask(1, j + 1),
    )
    out = out[:, -1:]
    np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(g[0, 0, j]), rtol=1e-4, atol=1e-5)
    for s in range(1, steps):
        mask = jnp.ones((1, 1, pk.shape[1] + 1), bool)
        out, k, v = head_step(
            params,
            embed,
            out,
            tokens[:, j + s + 1 : j + s + 2],
            jnp.array([[j + s]]),
            pk,
            pv,
            mask,
        )
        pk, pv = jnp.concatenate([pk, k], 1), jnp.concatenate([pv, v], 1)
        np.testing.assert_allclose(
            np.asarray(out[0, 0]), np.asarray(g[s, 0, j]), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("version", [2, 3])
def test_hf_layout_round_trip(version, tmp_path, target_params):
    cfg = eagle.EagleConfig.for_target(
        TARGET,
        version,
        draft_vocab_size=40 if version == 3 else None,
        aux_layers=(1, 2, 4) if version == 3 else None,
    )
    params = eagle.init_params(cfg, jax.random.PRNGKey(4))
    params = jax.tree.map(lambda p: p + 0.01 * jnp.arange(p.size).reshape(p.shape) / p.size, params)
    d2t = np.sort(np.random.RandomState(0).choice(96, 40, replace=False)).astype(np.int32)
    save_head(str(tmp_path), cfg, params, d2t if version == 3 else None)
    config = json.loads((tmp_path / "config.json").read_text())
    from safetensors.numpy import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    if version == 3:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
        assert {
            "fc.weight",
            "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
        } <= names
    else:
        assert {
            "fc.weight",
            "fc.bias",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight",
        } <= names
    cfg2, params2, d2t2 = load_head(str(tmp_path), TARGET)
    assert cfg2 == cfg
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2
    )
    if version == 3:
        np.testing.assert_array_equal(d2t2, d2t)
    else:
        assert d2t2 is None
    with pytest.raises(ValueError, match="not made for this target"):
        load_head(str(tmp_path), ModelConfig(**{**vars(TARGET), "vocab_size": 97}))


def test_load_head_checks_shapes(tmp_path, target_params):
    from safetensors.numpy import load_file, save_file

    cfg = eagle.EagleConfig.for_target(TARGET, 3, aux_layers=(1, 2, 4))
    save_head(str(tmp_path), cfg, eagle.init_params(cfg, jax.random.PRNGKey(5)))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].copy()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fc.weight"):
        load_head(str(tmp_path), TARGET)
