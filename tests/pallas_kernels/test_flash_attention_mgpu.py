"""The Hopper (Mosaic GPU) FlashAttention forward: in JAX's Mosaic GPU interpreter against the f32
reference, with its race detector on; CUDA lowering; the same checks compiled on a GPU.

Every configuration of the Triton kernel's tests (`test_flash_attention.CPU_CASES`) runs here,
with f32 inputs taken as bf16 (the Hopper kernel is for the tensor cores' 16-bit types; f32 stays
on the Triton kernel, see `test_dispatch_*`), and the same tolerances. Larger cases add several
row tiles per (batch, kv head), more key tiles than pipeline stages, and every kind of tile
(masked at the window's start, unmasked, masked on the diagonal and at kv_len).

The interpreter needs JAX >= 0.12 (0.10's has no transposed wgmma operand): these tests run in
`make test-newest-jax`; the lowering tests run on both JAXes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels import dispatch, mosaic_interpret
from jaxgen.pallas_kernels.flash_attention_mgpu import (
    MosaicBlocks,
    flash_attention_mgpu,
    supports,
)
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.test_flash_attention import (
    CPU_CASES,
    Case,
    kwargs,
    make_inputs,
    reference_f32,
)
from tests.pallas_kernels.tolerances import tol

NO_INTERPRETER = (
    "JAX 0.10's Mosaic GPU interpreter has no transposed wgmma operand (these tests run in "
    "make test-newest-jax)"
)


def sixteen_bit(c: Case) -> Case:
    return c if c.dtype != "float32" else dataclasses.replace(c, dtype="bfloat16")


CASES = [sixteen_bit(c) for c in CPU_CASES] + [
    # Two row tiles per (batch, kv head), 5 key tiles through 3 stages, causal skipping.
    Case(dtype="bfloat16", seq_q=150, seq_k=300, groups=1, num_kv=1),
    # The window starts inside the context: masked, unmasked and masked tiles in one row.
    Case(dtype="bfloat16", seq_q=128, seq_k=320, groups=2, num_kv=1, window=130),
    Case(dtype="float16", head_dim=128, seq_q=70, seq_k=200, groups=4, num_kv=1),
]


class TestFlashAttentionMosaic:
    interpret = True

    def run(self, q, k, v, **kw):
        return flash_attention_mgpu(q, k, v, interpret=self.interpret, **kw)

    @pytest.fixture(autouse=True)
    def _no_races(self):
        if self.interpret and not mosaic_interpret.available():
            pytest.skip(NO_INTERPRETER)
        if self.interpret:
            mosaic_interpret.reset()
        yield
        if self.interpret:
            assert not mosaic_interpret.races(), "the interpreter saw a data race"

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_forward_matches_reference(self, case):
        q, k, v, kv_lens, q_offsets = make_inputs(case)
        kw = kwargs(case, kv_lens, q_offsets)
        out = self.run(q, k, v, **kw)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert np.isfinite(np.asarray(out, np.float32)).all()  # NaN padding never leaks
        np.testing.assert_allclose(
            np.asarray(out, np.float32),
            reference_f32(q, k, v, **kw),
            atol=tol(case.dtype),
            rtol=tol(case.dtype),
        )

    def test_log_sum_exp_matches_reference(self):
        case = Case(dtype="bfloat16", groups=3)
        q, k, v, kv_lens, q_offsets = make_inputs(case)
        kw = kwargs(case, kv_lens, q_offsets)
        _, lse = self.run(q, k, v, return_lse=True, **kw)
        f32 = lambda x: np.asarray(x, np.float32)
        valid = (
            np.arange(case.seq_k)[None, :, None, None] < np.asarray(kv_lens)[:, None, None, None]
        )
        kk = np.where(valid, f32(k), 0.0)
        s = np.einsum("btkgh,bskh->bkgts", f32(q).reshape(2, case.seq_q, 2, 3, -1), kk)
        s = s * case.head_dim**-0.5
        t = np.asarray(q_offsets)[:, None] + np.arange(case.seq_q)[None]
        j = np.arange(case.seq_k)
        mask = (j[None, None] < np.asarray(kv_lens)[:, None, None]) & (
            j[None, None] <= t[..., None]
        )
        s = np.where(mask[:, None, None], s, -np.inf)
        want = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        np.testing.assert_allclose(
            np.asarray(lse), want.reshape(2, 6, case.seq_q), atol=2e-2, rtol=2e-2
        )

    def test_rows_with_nothing_to_attend_are_zero(self):
        case = Case(dtype="bfloat16")
        q, k, v, _, _ = make_inputs(case)
        out = self.run(
            q,
            k,
            v,
            causal=True,
            kv_lens=jnp.array([0, 10], jnp.int32),
            q_offsets=jnp.array([0, 0], jnp.int32),
        )
        assert np.all(np.asarray(out[0], np.float32) == 0)
        assert np.isfinite(np.asarray(out, np.float32)).all()

    def test_tilings(self):
        case = Case(dtype="bfloat16", seq_q=100, seq_k=400, groups=2, num_kv=1)
        q, k, v, kv_lens, q_offsets = make_inputs(case)
        kw = kwargs(case, kv_lens, q_offsets)
        want = reference_f32(q, k, v, **kw)
        for blocks in (MosaicBlocks(block_kv=128, stages=2), MosaicBlocks(stages=4)):
            out = flash_attention_mgpu(q, k, v, interpret=self.interpret, blocks=blocks, **kw)
            np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "case",
    [Case(dtype="bfloat16", head_dim=128, seq_q=2048, seq_k=2048, groups=4, num_kv=8)]
    + [sixteen_bit(c) for c in CPU_CASES[:8]],
    ids=str,
)
def test_lowers_for_cuda(case):
    q, k, v, kv_lens, q_offsets = (
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in make_inputs(case)
    )
    fwd = lambda q, k, v, lens, offs: flash_attention_mgpu(q, k, v, **kwargs(case, lens, offs))
    text = lower_for_cuda(fwd, q, k, v, kv_lens, q_offsets).as_text()
    assert text.count("mosaic_gpu") >= 1 and "xla.gpu.triton" not in text


def test_unsupported_inputs_are_named():
    f32 = jnp.zeros((1, 8, 2, 64), jnp.float32)
    bf16 = f32.astype(jnp.bfloat16)
    assert "dtype" in supports(f32, f32, f32)
    assert "head_dim" in supports(*(jnp.zeros((1, 8, 2, 256), jnp.bfloat16),) * 3)
    assert supports(bf16, bf16, bf16) is None
    with pytest.raises(ValueError, match="use flash_attention"):
        flash_attention_mgpu(f32, f32, f32)
    with pytest.raises(ValueError, match="block_kv"):
        MosaicBlocks(block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        MosaicBlocks(stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        flash_attention_mgpu(bf16, bf16, bf16, blocks=MosaicBlocks(block_kv=256, stages=8))


@pytest.mark.gpu
class TestFlashAttentionMosaicGPU(TestFlashAttentionMosaic):
    """The same checks, compiled for an sm_90 GPU."""

    interpret = False


def test_dispatch_table_and_fallbacks(monkeypatch):
    from jaxgen.pallas_kernels import prefill_table

    bf16 = jnp.zeros((1, 2048, 32, 128), jnp.bfloat16)
    kv = jnp.zeros((1, 2048, 8, 128), jnp.bfloat16)
    cls = dispatch.shape_class(bf16, kv, True)
    assert cls == "bfloat16/h128/g4/causal/s<=4k"
    # Off the GPU, or with no measured entry, prefill runs the Triton kernel.
    assert dispatch.prefill_kernel(bf16, kv, kv, True) == "triton"
    assert dispatch.prefill_kernel(bf16, kv, kv, True, device_kind="NVIDIA H200") == "triton"
    monkeypatch.setitem(prefill_table.TABLE, "NVIDIA H200", {cls: "mosaic"})
    assert dispatch.prefill_kernel(bf16, kv, kv, True, device_kind="NVIDIA H200") == "mosaic"
    assert dispatch.prefill_kernel(bf16, kv, kv, False, device_kind="NVIDIA H200") == "triton"
    f32, kv32 = bf16.astype(jnp.float32), kv.astype(jnp.float32)  # the kernel does not take f32
    monkeypatch.setitem(
        prefill_table.TABLE, "NVIDIA H200", {dispatch.shape_class(f32, kv32, True): "mosaic"}
    )
    assert dispatch.prefill_kernel(f32, kv32, kv32, True, device_kind="NVIDIA H200") == "triton"


def test_dispatch_mosaic_lowers_to_the_hopper_kernel_and_f32_to_triton():
    sd = jax.ShapeDtypeStruct
    for dtype, want in ((jnp.bfloat16, "mosaic_gpu"), (jnp.float32, "xla.gpu.triton")):
        q, kv = sd((1, 256, 8, 128), dtype), sd((1, 256, 2, 128), dtype)
        text = lower_for_cuda(
            lambda q, k, v: dispatch.attention(q, k, v, impl="mosaic"), q, kv, kv
        ).as_text()
        assert want in text


def test_dispatch_mosaic_interpret_and_gradient():
    """impl="mosaic_interpret" runs the Hopper kernel forward (f32 falls back to the Triton
    kernel); jax.grad through it takes the Triton backward and matches the reference's."""
    if not mosaic_interpret.available():
        pytest.skip(NO_INTERPRETER)
    case = Case(dtype="bfloat16", groups=2)
    q, k, v, kv_lens, q_offsets = make_inputs(case)
    valid = jnp.arange(case.seq_k)[None, :, None, None] < kv_lens[:, None, None, None]
    k, v = jnp.where(valid, k, 0), jnp.where(valid, v, 0)
    kw = kwargs(case, kv_lens, q_offsets)
    out = dispatch.attention(q, k, v, impl="mosaic_interpret", **kw)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), reference_f32(q, k, v, **kw), atol=2e-2, rtol=2e-2
    )
    w = jax.random.normal(jax.random.key(1), q.shape)

    def loss(impl):
        f = lambda q, k, v: dispatch.attention(q, k, v, impl=impl, **kw)
        return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)

    got = jax.grad(loss("mosaic_interpret"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("interpret"), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_bench_writes_the_table_the_dispatch_reads(tmp_path, monkeypatch):
    """`kernels flash --table` on a compiled run: per shape class, the faster of our kernels;
    an interpret-mode run is refused (its times say nothing)."""
    import importlib.util

    from benchmarks import kernels
    from jaxgen.pallas_kernels import prefill_table

    def row(kernel, seq, ms):
        return {"kernel": kernel, "batch": 16384 // seq, "seq": seq, "fwd_ms": ms}

    result = {
        "machine": {"device": "NVIDIA H200"},
        "interpret": False,
        "dtype": "bfloat16",
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "rows": [
            row("jaxgen", 2048, 2.0),
            row("jaxgen_mosaic", 2048, 1.0),
            row("jaxgen", 8192, 3.0),
            row("jaxgen_mosaic", 8192, 4.0),
            row("cudnn", 8192, 1.0),
        ],
    }
    assert kernels.prefill_table(result) == {
        "bfloat16/h128/g4/causal/s<=4k": "mosaic",
        "bfloat16/h128/g4/causal/s>4k": "triton",
    }
    path = tmp_path / "prefill_table.py"
    path.write_text(open(prefill_table.__file__).read())
    monkeypatch.setitem(prefill_table.TABLE, "NVIDIA H100", {"x": "triton"})
    kernels.write_prefill_table(result, str(path))
    spec = importlib.util.spec_from_file_location("written", path)
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    assert written.TABLE["NVIDIA H100"] == {"x": "triton"}  # other GPUs' entries kept
    assert written.TABLE["NVIDIA H200"] == kernels.prefill_table(result)
    assert written.__doc__ == prefill_table.__doc__
    monkeypatch.setattr(prefill_table, "TABLE", written.TABLE)
    q = jnp.zeros((8, 2048, 32, 128), jnp.bfloat16)
    kv = jnp.zeros((8, 2048, 8, 128), jnp.bfloat16)
    assert dispatch.prefill_kernel(q, kv, kv, True, device_kind="NVIDIA H200") == "mosaic"
    with pytest.raises(ValueError, match="compiled GPU run"):
        kernels.write_prefill_table(dict(result, interpret=True), str(path))
