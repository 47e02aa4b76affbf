"""Quantizing whole models: every method runs on a tiny model with real calibration text,
quantized checkpoints round-trip through orbax, and the CLI / LLM entry points work."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxgen import LLM, SamplingParams
from jaxgen.model import ModelConfig, forward, init_params, load_model, save_checkpoint
from jaxgen.model.quantize import QuantSpec, on_the_fly, quantize_model
from jaxgen.quant.apply import get_path, set_path
from jaxgen.quant.formats import QArray, QuantizationError, quantize_rtn

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "wikitext-2")
VALID = os.path.join(DATA, "valid.txt")
CFG = ModelConfig(
    arch="llama",
    vocab_size=49152,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)
FAST = dict(calib_seqs=4, calib_len=64, qat_steps=3)


@pytest.fixture(scope="module")
def tiny():
    return init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(method="rtn", bits=8),
        QuantSpec(method="rtn", bits=8, group_size=32, scale_dtype="float16"),
        QuantSpec(method="rtn", bits=4, group_size=64),
        QuantSpec(method="rtn", bits=3, group_size=64, symmetric=False),
        QuantSpec(method="nf4"),
        QuantSpec(method="nf4", double_quant=True),
        QuantSpec(method="fp8"),
        QuantSpec(method="smoothquant", **FAST),
        QuantSpec(method="llm_int8"),
        QuantSpec(method="llm_int8", outlier_share=0.01, **FAST),
        QuantSpec(method="awq", bits=4, group_size=64, **FAST),
        QuantSpec(method="gptq", bits=4, group_size=64, **FAST),
        QuantSpec(method="gptq", bits=4, group_size=64, act_order=True, **FAST),
        QuantSpec(method="qat", bits=4, group_size=64, **FAST),
    ],
    ids=lambda s: f"{s.method}-{s.fmt}-g{s.group}",
)
def test_every_method_quantizes_and_stays_close(tiny, default_tokenizer, spec):
    qparams, report = quantize_model(CFG, tiny, spec, tokenizer=default_tokenizer, calib_path=VALID)
    kernels = [
        qparams["layers"][a][n]["kernel"]
        for a, n in [("attn", "q_proj"), ("attn", "o_proj"), ("mlp", "down_proj")]
    ]
    assert all(isinstance(k, QArray) and k.fmt == spec.fmt for k in kernels)
    tokens = np.random.RandomState(0).randint(0, CFG.vocab_size, (2, 16))
    ref = np.asarray(forward(CFG, tiny, tokens))
    got = np.asarray(forward(CFG, qparams, tokens))
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert np.isfinite(got).all() and rel < (0.05 if spec.fmt in ("int8", "fp8") else 0.5), rel
    if spec.method == "awq":
        assert len(report["alphas"]) == CFG.num_layers * 3
    if spec.method == "qat":
        assert np.isfinite(report["qat_loss_last"])
    if spec.outlier_share is not None:  # one calibrated threshold per linear, in its QArray
        found = report["outlier_thresholds"]
        assert [k.outlier_threshold for k in kernels] == [
            found[n] for n in ("q_proj", "o_proj", "down_proj")
        ]
        assert all(0 < t < 6.0 for t in found.values())


def test_quantized_checkpoint_round_trips(tiny, tmp_path, default_tokenizer, capsys):
    """Also: a calibrated method shows its progress over the layers (tqdm, with an estimate)."""
    qparams, _ = quantize_model(
        CFG,
        tiny,
        QuantSpec(method="gptq", bits=4, group_size=64, **FAST),
        tokenizer=default_tokenizer,
        calib_path=VALID,
        progress=True,
    )
    err = capsys.readouterr().err
    assert "gptq: calibrating" in err and f"{CFG.num_layers}/{CFG.num_layers}" in err
    save_checkpoint(str(tmp_path), CFG, qparams)
    cfg2, loaded = load_model(str(tmp_path))
    assert cfg2 == CFG
    for a, b in zip(jax.tree.leaves(qparams), jax.tree.leaves(loaded), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = loaded["layers"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(q, QArray) and q.fmt == "int4" and q.group_size == 64


def test_bad_arguments(tiny, default_tokenizer):
    with pytest.raises(QuantizationError, match="bits"):
        QuantSpec(method="rtn", bits=5)
    with pytest.raises(QuantizationError, match="group size"):
        quantize_model(CFG, tiny, QuantSpec(method="rtn", bits=4, group_size=1000))
    with pytest.raises(QuantizationError, match="calibration file not found"):
        quantize_model(
            CFG,
            tiny,
            QuantSpec(method="gptq", bits=4),
            tokenizer=default_tokenizer,
            calib_path="/no/such/file.txt",
        )
    with pytest.raises(QuantizationError, match="needs calibration"):
        quantize_model(CFG, tiny, QuantSpec(method="awq", bits=4))
    with pytest.raises(QuantizationError, match="quantization must be one of"):
        on_the_fly(tiny, "int5")


def test_llm_quantization_on_the_fly_generates(default_tokenizer):
    llm = LLM(quantization="int8", max_num_seqs=2)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12),
    )
    assert "Paris" in out[0].outputs[0].text
    assert isinstance(llm.params["layers"]["attn"]["q_proj"]["kernel"], QArray)


@pytest.mark.slow
def test_cli_quantize_then_load(tmp_path):
    out = tmp_path / "q"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "quantize",
            "--method",
            "rtn",
            "--bits",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "generate",
            "--model",
            str(out),
            "What is 2+2?",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxgen.cli",
            "quantize",
            "--method",
            "gptq",
            "--out",
            str(tmp_path / "x"),
            "--calib",
            "/no/file",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "calibration file not found" in bad.stderr


def test_new_formats_reload_to_the_same_greedy_tokens(tiny, tmp_path, default_tokenizer):
    """One checkpoint holding every new format (one per linear, fp8 and q4k scale-searched;
    int8 with Q8_0's f16 group scales):
    orbax round trip, then the engine's greedy tokens from the reloaded checkpoint equal the
    in-memory quantized model's."""
    imp = np.random.RandomState(0).lognormal(0, 1, (CFG.num_layers, CFG.hidden_size)) ** 2
    formats = {
        ("attn", "q_proj"): dict(fmt="mxfp4"),
        ("attn", "k_proj"): dict(fmt="nvfp4", importance=imp),
        ("attn", "v_proj"): dict(fmt="fp8", importance=imp),
        ("attn", "o_proj"): dict(fmt="int8", group_size=32, scale_dtype="float16"),
        ("mlp", "gate_proj"): dict(fmt="q4k", importance=imp),
        ("mlp", "up_proj"): dict(fmt="mxfp4", importance=imp),
        ("mlp", "down_proj"): dict(fmt="q4k"),
    }
    qparams = tiny
    for (group, name), kwargs in formats.items():
        path = ("layers", group, name, "kernel")
        qparams = set_path(qparams, path, quantize_rtn(get_path(tiny, path), **kwargs))
    save_checkpoint(str(tmp_path), CFG, qparams)
    _, loaded = load_model(str(tmp_path))
    for (group, name), kwargs in formats.items():
        assert loaded["layers"][group][name]["kernel"].fmt == kwargs["fmt"]
    for a, b in zip(jax.tree.leaves(qparams), jax.tree.leaves(loaded), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, ignore_eos=True)

    def greedy(p):
        llm = LLM.from_parts(
            CFG, p, default_tokenizer, max_model_len=256, max_num_seqs=1, warmup=False
        )
        return llm.generate([[5, 17, 300, 42]], params)[0].outputs[0].token_ids

    assert greedy(loaded) == greedy(qparams)


def test_typed_errors_for_formats_and_calibration(tiny, default_tokenizer):
    with pytest.raises(QuantizationError, match="format must be one of"):
        QuantSpec(format="fp6")
    with pytest.raises(QuantizationError, match="search=True applies to"):
        QuantSpec(method="nf4", search=True)
    with pytest.raises(QuantizationError, match="outlier_share is the share"):
        QuantSpec(method="llm_int8", outlier_share=1.0)
    with pytest.raises(QuantizationError, match="apply to method 'llm_int8'"):
        QuantSpec(method="rtn", bits=8, outlier_share=0.01)
    with pytest.raises(QuantizationError, match="RTN's scale search"):
        QuantSpec(method="gptq", bits=4, search=True)
    with pytest.raises(QuantizationError, match="symmetric"):
        QuantSpec(method="rtn", bits=4, search=True, symmetric=False)
    with pytest.raises(QuantizationError, match="scale_dtype 'float16' applies to integer"):
        QuantSpec(method="gptq", bits=4, scale_dtype="float16")
    with pytest.raises(QuantizationError, match="fixed block of 16"):
        quantize_model(CFG, tiny, QuantSpec(format="nvfp4", group_size=64))
    with pytest.raises(QuantizationError, match="too small"):
        quantize_model(
            CFG,
            tiny,
            QuantSpec(format="q4k", search=True, calib_seqs=2, calib_len=64),
            tokenizer=default_tokenizer,
            calib_path=VALID,
        )


def test_int8_linears_mixture(tiny):
    spec = QuantSpec(method="rtn", format="q4k", int8_linears=("v_proj", "down_proj"))
    qparams, _ = quantize_model(CFG, tiny, spec)
    fmts = {
        n: qparams["layers"][g][n]["kernel"].fmt
        for g, n in [
            ("attn", "v_proj"),
            ("mlp", "down_proj"),
            ("mlp", "up_proj"),
            ("attn", "q_proj"),
        ]
    }
    assert fmts == {"v_proj": "int8", "down_proj": "int8", "up_proj": "q4k", "q_proj": "q4k"}
    with pytest.raises(QuantizationError, match="int8_linears"):
        QuantSpec(method="gptq", int8_linears=("lm_head",))
