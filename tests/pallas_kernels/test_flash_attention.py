"""FlashAttention kernel: interpret mode against the f32 reference, gradients, CUDA lowering.

`TestFlashAttentionGPU` runs the same checks compiled on a GPU (skipped elsewhere).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.disagg import planner
from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels import flash_attention as flash_module
from jaxgen.pallas_kernels.flash_attention import (
    Q_BLOCK,
    BlockSizes,
    flash_attention,
    flash_attention_reference,
    reference_pairs,
)
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.tolerances import tol

SMALL_BLOCKS = BlockSizes(block_m=16, block_k=16, block_m_bwd=16, block_k_bwd=16)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    head_dim: int = 64
    groups: int = 1  # GQA ratio N / K
    num_kv: int = 2
    seq_q: int = 37  # not a multiple of the block
    seq_k: int = 53
    causal: bool = True
    ragged: bool = True  # kv_lens < S, q_offsets > 0
    window: int | None = None
    soft_cap: float | None = None

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


CPU_CASES = [
    Case(),
    Case(causal=False),
    Case(groups=3),
    Case(groups=8, num_kv=1, head_dim=80),
    Case(head_dim=80, dtype="bfloat16"),
    Case(dtype="float16", groups=3),
    Case(window=7),
    Case(soft_cap=4.0, groups=3),
    Case(ragged=False, seq_q=53, seq_k=53),
    Case(causal=False, window=11, dtype="bfloat16"),
]
LOWER_ONLY = [Case(head_dim=h, dtype=d) for h in (96, 128, 256) for d in ("float32", "bfloat16")]


def make_inputs(c: Case, seed=0):
    rng = np.random.RandomState(seed)
    b, n = 2, c.num_kv * c.groups
    q = rng.randn(b, c.seq_q, n, c.head_dim)
    k = rng.randn(b, c.seq_k, c.num_kv, c.head_dim)
    v = rng.randn(b, c.seq_k, c.num_kv, c.head_dim)
    if c.ragged:
        kv_lens = np.array([c.seq_k, c.seq_k - 14], np.int32)
        q_offsets = np.array([c.seq_k - c.seq_q, 3], np.int32)
    else:
        kv_lens = np.full(b, c.seq_k, np.int32)
        q_offsets = np.zeros(b, np.int32)
    # Poison: keys/values past each row's kv_len are NaN; they must never reach the output.
    for row in range(b):
        k[row, kv_lens[row] :] = np.nan
        v[row, kv_lens[row] :] = np.nan
    dt = jnp.dtype(c.dtype)
    return (
        jnp.asarray(q, dt),
        jnp.asarray(k, dt),
        jnp.asarray(v, dt),
        jnp.asarray(kv_lens),
        jnp.asarray(q_offsets),
    )


def kwargs(c: Case, kv_lens, q_offsets):
    return dict(
        causal=c.causal,
        kv_lens=kv_lens,
        q_offsets=q_offsets,
        sliding_window=c.window,
        logits_soft_cap=c.soft_cap,
    )


def reference_f32(q, k, v, **kw):
    f32 = lambda x: x.astype(jnp.float32)
    return flash_attention_reference(f32(q), f32(k), f32(v), **kw)


class TestFlashAttention:
    interpret = True
    cases = CPU_CASES
    blocks = SMALL_BLOCKS

    def run(self, q, k, v, **kw):
        return flash_attention(q, k, v, interpret=self.interpret, block_sizes=self.blocks, **kw)

    @pytest.mark.parametrize("case", CPU_CASES, ids=str)
    def test_forward_matches_reference(self, case):
        q, k, v, kv_lens, q_offsets = make_inputs(case)
        kw = kwargs(case, kv_lens, q_offsets)
        out = self.run(q, k, v, **kw)
        assert out.dtype == q.dtype and out.shape == q.shape
        want = reference_f32(q, k, v, **kw)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        np.testing.assert_allclose(
            np.asarray(out, np.float32), want, atol=tol(case.dtype), rtol=tol(case.dtype)
        )
        again = self.run(q, k, v, **kw)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(again))  # bit-identical reruns

    @pytest.mark.parametrize(
        "case",
        [
            Case(),
            Case(groups=3, window=7, soft_cap=4.0),
            Case(causal=False, head_dim=80, groups=8, num_kv=1),
        ],
        ids=str,
    )
    def test_gradients_match_reference(self, case):
        q, k, v, kv_lens, q_offsets = make_inputs(case)
        # Gradients w.r.t. padding are undefined; use finite padding here.
        valid = jnp.arange(case.seq_k)[None, :, None, None] < kv_lens[:, None, None, None]
        k, v = jnp.where(valid, k, 0.0), jnp.where(valid, v, 0.0)
        kw = kwargs(case, kv_lens, q_offsets)
        w = jax.random.normal(jax.random.key(0), q.shape)

        def loss(fn):
            return lambda q, k, v: jnp.sum(fn(q, k, v, **kw) * w)

        got = jax.grad(loss(self.run), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(loss(flash_attention_reference), argnums=(0, 1, 2))(q, k, v)
        for name, g, r in zip("qkv", got, want, strict=True):
            scale = float(jnp.abs(r).max())
            np.testing.assert_allclose(
                g, r, atol=1e-5 * max(scale, 1.0), rtol=1e-4, err_msg=f"d{name}"
            )

    def test_rows_with_nothing_to_attend_are_zero(self):
        case = Case()
        q, k, v, _, _ = make_inputs(case)
        kv_lens = jnp.array([0, 10], jnp.int32)
        out = self.run(
            q, k, v, causal=True, kv_lens=kv_lens, q_offsets=jnp.array([0, 0], jnp.int32)
        )
        assert np.all(np.asarray(out[0]) == 0)
        assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("case", CPU_CASES + LOWER_ONLY, ids=str)
def test_lowers_for_cuda(case):
    q, k, v, kv_lens, q_offsets = (
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in make_inputs(case)
    )
    fwd = lambda q, k, v, lens, offs: flash_attention(q, k, v, **kwargs(case, lens, offs))
    lowered = lower_for_cuda(fwd, q, k, v, kv_lens, q_offsets)
    assert lowered.as_text().count("xla.gpu.triton") == 1
    grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    lowered = lower_for_cuda(grad, q, k, v, kv_lens, q_offsets)
    assert lowered.as_text().count("xla.gpu.triton") == 3  # forward + two backward kernels


@pytest.mark.parametrize(
    "case",
    [
        Case(seq_q=2 * Q_BLOCK + 37, seq_k=2 * Q_BLOCK + 37, ragged=False, groups=3),
        Case(seq_q=Q_BLOCK + 5, seq_k=3 * Q_BLOCK, ragged=True),  # offsets: every key
        Case(seq_q=Q_BLOCK + 5, seq_k=Q_BLOCK + 5, ragged=False, window=40, soft_cap=20.0),
        Case(seq_q=Q_BLOCK + 5, seq_k=Q_BLOCK + 9, ragged=True, causal=False),
    ],
    ids=str,
)
def test_reference_in_query_blocks_equals_one_block(case):
    """Long rows go in query blocks, a causal block from position 0 over the keys up to its
    last query: the same output as all queries against all keys at once."""
    q, k, v, kv_lens, q_offsets = make_inputs(case)
    kw = kwargs(case, kv_lens, q_offsets)
    if not case.ragged:
        kw["q_offsets"] = None  # the default offsets: blocks stop at their last query
    got = flash_attention_reference(q, k, v, **kw)
    lens, offs, scale = flash_module._defaults(q, k, kw["kv_lens"], kw["q_offsets"], None)
    want = flash_module._dense_attention(
        q, k, v, lens, offs, causal=case.causal, sm_scale=scale,
        sliding_window=case.window, logits_soft_cap=case.soft_cap,
    )  # fmt: skip
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_reference_pairs_count_the_blocks():
    b = Q_BLOCK
    assert reference_pairs(b, b, True) == b * b
    assert reference_pairs(4 * b, 4 * b, True) == b * b * (1 + 2 + 3 + 4)
    assert reference_pairs(2 * b + 1, 2 * b + 1, True) == b * b + b * 2 * b + 1 * (2 * b + 1)
    assert reference_pairs(4 * b, 12 * b, False) == 48 * b * b
    for n in (1, 5, b, b + 1, 3 * b + 7):  # the planner's copy (it cannot import JAX)
        for keys in (n, n + 64):
            for fresh in (True, False):
                want = reference_pairs(n, keys, fresh)
                assert planner.reference_pairs(n, keys, fresh) == want


def test_dispatch_picks_reference_on_cpu_and_kernel_on_request():
    case = Case(groups=3)
    q, k, v, kv_lens, q_offsets = make_inputs(case)
    kw = kwargs(case, kv_lens, q_offsets)
    assert dispatch.default_impl() == "xla"
    ref = dispatch.attention(q, k, v, **kw)
    kernel = dispatch.attention(q, k, v, impl="interpret", **kw)
    np.testing.assert_allclose(kernel, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.attention(q, k, v, impl="cuda", **kw)


def test_bad_inputs_raise_value_error():
    q = jnp.zeros((1, 4, 6, 64))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, jnp.zeros((1, 4, 4, 64)), jnp.zeros((1, 4, 4, 64)), interpret=True)
    with pytest.raises(ValueError, match="share one of"):
        flash_attention(
            q, jnp.zeros((1, 4, 2, 64), jnp.bfloat16), jnp.zeros((1, 4, 2, 64)), interpret=True
        )
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_m=24)


@pytest.mark.gpu
class TestFlashAttentionGPU(TestFlashAttention):
    """The same checks, compiled for the GPU, on the full grid and default tile sizes."""

    interpret = False
    blocks = None
