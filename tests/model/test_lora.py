"""Multi-LoRA: PEFT adapters loaded onto a tiny random Llama, logits against transformers + PEFT
with the adapter merged, batches that mix adapters, and the typed errors of bad adapters."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.model import LoRABatch, LoRAError, forward, load_adapter, load_model, stack_adapters
from jaxgen.quant.apply import quantize_params
from tests.helpers import LORA_ADAPTERS, hf_logits, save_peft_adapter, tiny_hf_model

TOL = 1e-4
SEQ = 12


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(cfg, params, adapter dirs, merged reference models, the three adapters stacked)."""
    root = tmp_path_factory.mktemp("lora")
    hf = tiny_hf_model(str(root / "base"))
    cfg, params = load_model(str(root / "base"), show_progress=False)
    dirs, merged = [], []
    for seed, (name, kwargs) in enumerate(LORA_ADAPTERS.items()):
        dirs.append(str(root / name))
        merged.append(save_peft_adapter(hf, dirs[-1], seed, **kwargs))
    weights = stack_adapters(cfg, [load_adapter(d, cfg) for d in dirs])
    return cfg, params, hf, dirs, merged, weights


def tokens_for(cfg, batch, seed=1):
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, SEQ))


def with_ids(weights, ids):
    return LoRABatch(weights, jnp.asarray(ids, jnp.int32))


def test_loaded_layout(lora_setup):
    cfg, _, _, dirs, _, weights = lora_setup
    patterns = load_adapter(dirs[2], cfg)
    assert sorted(patterns.modules) == ["down_proj", "o_proj", "q_proj", "up_proj"]
    assert patterns.rank == 6  # down_proj's rank_pattern
    a, b = patterns.modules["q_proj"]
    assert a.shape == (cfg.num_layers, cfg.hidden_size, 4)
    assert not a[1, :, 2:].any() and not b[1, 2:].any()  # layer 1's q_proj has rank 2
    assert weights.targets == tuple(LORA_ADAPTERS["all-modules"]["target_modules"])
    assert (weights.num_adapters, weights.max_rank) == (3, 8)
    assert weights.q_proj.a.shape == (cfg.num_layers, 3, cfg.hidden_size, 8)


@pytest.mark.parametrize("index", range(len(LORA_ADAPTERS)), ids=list(LORA_ADAPTERS))
def test_logits_match_peft_merged(lora_setup, index):
    cfg, params, hf, _, merged, weights = lora_setup
    tokens = tokens_for(cfg, 2)
    got = np.asarray(forward(cfg, params, tokens, lora=with_ids(weights, np.full((2, SEQ), index))))
    want = hf_logits(merged[index], tokens)
    err = np.abs(got - want).max()
    assert err <= TOL, f"max |dlogit| = {err:.3g}"
    assert np.abs(want - hf_logits(hf, tokens)).max() > 100 * TOL  # the adapter does something


def test_mixed_batch_equals_rows_alone(lora_setup):
    cfg, params, _, _, _, weights = lora_setup
    row_ids = [2, -1, 0, 1, 0]
    tokens = tokens_for(cfg, len(row_ids))
    ids = np.repeat(np.asarray(row_ids)[:, None], SEQ, axis=1)
    mixed = np.asarray(forward(cfg, params, tokens, lora=with_ids(weights, ids)))
    for b in range(len(row_ids)):
        alone = forward(cfg, params, tokens[b : b + 1], lora=with_ids(weights, ids[b : b + 1]))
        np.testing.assert_allclose(mixed[b], np.asarray(alone)[0], atol=1e-5, rtol=0)


def test_per_token_adapters(lora_setup):
    """Each token of a row takes its own adapter (the engine packs sequences into one row)."""
    cfg, _, _, _, _, weights = lora_setup
    rng = np.random.RandomState(0)
    ids = rng.randint(-1, weights.num_adapters, (2, 7))
    x = rng.randn(2, 7, cfg.hidden_size).astype(np.float32)
    layer = jax.tree.map(lambda w: w[1], weights)  # what the layer scan hands layer 1
    got = np.asarray(with_ids(layer, ids).delta("k_proj", jnp.asarray(x)))
    a, b = np.asarray(layer.k_proj.a), np.asarray(layer.k_proj.b)
    for bt in np.ndindex(ids.shape):
        i = ids[bt]
        want = 0.0 if i < 0 else x[bt] @ a[i] @ b[i]
        np.testing.assert_allclose(got[bt], want, atol=1e-5, rtol=0)
    assert with_ids(layer, ids).delta("lm_head", jnp.asarray(x)) is None


def test_no_adapter_is_the_base_model_exactly(lora_setup):
    cfg, params, _, _, _, weights = lora_setup
    tokens = tokens_for(cfg, 5)
    base = np.asarray(forward(cfg, params, tokens))
    none = np.asarray(forward(cfg, params, tokens, lora=with_ids(weights, np.full((5, SEQ), -1))))
    np.testing.assert_array_equal(none, base)


def test_quantized_base(lora_setup):
    """An int8 base: tokens without an adapter give the quantized model's logits, and the
    adapter's change of the logits is the float model's (up to the base's int8 error)."""
    cfg, params, _, _, _, weights = lora_setup
    qparams = quantize_params(params, "int8")
    tokens = tokens_for(cfg, 2)
    ids = np.asarray([[0] * SEQ, [-1] * SEQ])
    got = np.asarray(forward(cfg, qparams, tokens, lora=with_ids(weights, ids)))
    qbase = np.asarray(forward(cfg, qparams, tokens))
    # Not bit-equal here: XLA fuses the int8 matmul's group sums differently next to the LoRA add.
    np.testing.assert_allclose(got[1], qbase[1], atol=1e-6, rtol=0)
    fbase = np.asarray(forward(cfg, params, tokens[:1]))[0]
    fgot = np.asarray(forward(cfg, params, tokens[:1], lora=with_ids(weights, ids[:1])))[0]
    shift, fshift = got[0] - qbase[0], fgot - fbase
    assert np.abs(shift - fshift).max() < 0.05 * np.abs(fshift).max()


# ----------------------------------------------------------------------------------------------
# Bad adapters
# ----------------------------------------------------------------------------------------------
def edited_adapter(source, directory, **fields):
    """A copy of adapter `source` whose adapter_config.json has `fields` changed."""
    os.makedirs(directory)
    with open(os.path.join(source, "adapter_config.json")) as f:
        config = json.load(f) | fields
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    os.link(
        os.path.join(source, "adapter_model.safetensors"),
        os.path.join(directory, "adapter_model.safetensors"),
    )
    return str(directory)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(bias="all"), "bias='none'"),
        (dict(use_dora=True), "DoRA"),
        (dict(lora_bias=True), "lora_bias=False"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "only LoRA"),
        (dict(r=2), "rank 4 but adapter_config.json says 2"),
    ],
)
def test_unsupported_configs(lora_setup, tmp_path, fields, message):
    cfg, _, _, dirs, _, _ = lora_setup
    with pytest.raises(LoRAError, match=message):
        load_adapter(edited_adapter(dirs[0], tmp_path / "bad", **fields), cfg)


@pytest.mark.parametrize(
    "base_overrides, lora_kwargs, message",
    [
        ({}, dict(target_modules=["embed_tokens"]), "LoRA on the embeddings"),
        ({}, dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
        (dict(intermediate_size=80), dict(target_modules=["up_proj"]), "another base model"),
        (dict(num_hidden_layers=3), dict(target_modules=["v_proj"]), "base model has 2 layers"),
    ],
)
def test_unsupported_or_mismatched_tensors(
    lora_setup, tmp_path, base_overrides, lora_kwargs, message
):
    cfg, _, hf, _, _, _ = lora_setup
    base = tiny_hf_model(str(tmp_path / "base"), **base_overrides) if base_overrides else hf
    save_peft_adapter(base, str(tmp_path / "adapter"), r=4, lora_alpha=4, **lora_kwargs)
    with pytest.raises(LoRAError, match=message):
        load_adapter(str(tmp_path / "adapter"), cfg)


def test_missing_or_pickled_files(lora_setup, tmp_path):
    cfg, _, hf, _, _, _ = lora_setup
    with pytest.raises(LoRAError, match="not a PEFT adapter"):
        load_adapter(str(tmp_path), cfg)
    save_peft_adapter(hf, str(tmp_path / "bin"), r=2, target_modules=["q_proj"])
    os.rename(tmp_path / "bin/adapter_model.safetensors", tmp_path / "bin/adapter_model.bin")
    with pytest.raises(LoRAError, match="safe_serialization=True"):
        load_adapter(str(tmp_path / "bin"), cfg)


def test_stack_limits_and_bad_ids(lora_setup):
    cfg, params, _, dirs, _, weights = lora_setup
    adapters = [load_adapter(d, cfg) for d in dirs]
    with pytest.raises(LoRAError, match="exceeds max_rank=4"):
        stack_adapters(cfg, adapters, max_rank=4)
    with pytest.raises(LoRAError, match="num_slots=2 cannot hold 3 adapters"):
        stack_adapters(cfg, adapters, num_slots=2)
    with pytest.raises(LoRAError, match="not in the stack's targets"):
        stack_adapters(cfg, adapters, targets=["q_proj", "v_proj"])
    fixed = stack_adapters(
        cfg, adapters[1:2], num_slots=4, max_rank=16, targets=["q_proj", "v_proj"]
    )
    assert (fixed.num_adapters, fixed.max_rank, fixed.targets) == (4, 16, ("q_proj", "v_proj"))
    tokens = tokens_for(cfg, 1)
    with pytest.raises(ValueError, match=r"adapter_ids must lie in \[-1, 3\)"):
        forward(cfg, params, tokens, lora=with_ids(weights, np.full((1, SEQ), 3)))
    with pytest.raises(ValueError, match="shaped like the tokens"):
        forward(cfg, params, tokens, lora=with_ids(weights, np.zeros((1, SEQ + 1))))
