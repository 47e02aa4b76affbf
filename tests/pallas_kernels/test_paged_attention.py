"""Paged decode kernel: interpret mode against the gathered-dense reference, CUDA lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels.paged_attention import (
    BlockSizes,
    kv_cache_shape,
    paged_attention,
    paged_attention_multi,
    paged_attention_reference,
)
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.tolerances import tol


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    head_dim: int = 64
    groups: int = 1
    num_kv: int = 2
    page_size: int = 8
    num_queries: int = 1  # 1: paged_attention; > 1: paged_attention_multi
    int8: bool = False
    splits: int = 1
    window: int | None = None

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


CPU_CASES = [
    Case(),
    Case(groups=3, head_dim=80),
    Case(groups=8, num_kv=1, head_dim=128, page_size=16),
    Case(page_size=32, splits=3),
    Case(dtype="bfloat16", groups=3, splits=2),
    Case(int8=True, groups=3),
    Case(num_queries=4, groups=3, splits=2),
    Case(num_queries=3, window=6),
]
LOWER_ONLY = [Case(head_dim=h, page_size=p, dtype="bfloat16") for h in (64, 128) for p in (16, 32)]


def make_inputs(c: Case, seed=0):
    """Sequence lengths {1, page-1, page, page+1, max} with randomly permuted block tables;
    every page no sequence uses is NaN."""
    rng = np.random.RandomState(seed)
    ps = c.page_size
    max_pages = 6
    lens = np.array([max(1, c.num_queries), ps - 1, ps, ps + 1, max_pages * ps], np.int32)
    lens = np.maximum(lens, c.num_queries)
    batch = len(lens)
    num_pages = batch * max_pages + 3
    tables = (
        rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    )
    shape = kv_cache_shape(num_pages, ps, c.num_kv, c.head_dim)
    if c.int8:
        k = rng.randint(-127, 128, shape).astype(np.int8)
        v = rng.randint(-127, 128, shape).astype(np.int8)
        ks = (np.abs(rng.randn(*shape[:3])) * 0.02).astype(np.float32)
        vs = (np.abs(rng.randn(*shape[:3])) * 0.02).astype(np.float32)
    else:
        k, v = rng.randn(*shape).astype(np.float32), rng.randn(*shape).astype(np.float32)
        ks = vs = None
    k[..., c.head_dim :] = 0
    v[..., c.head_dim :] = 0
    used = {int(p) for b in range(batch) for p in tables[b, : -(-lens[b] // ps)]}
    unused = [p for p in range(num_pages) if p not in used]
    if not c.int8:
        k[unused] = np.nan
        v[unused] = np.nan
    else:
        ks[unused] = np.nan
        vs[unused] = np.nan
    # Table entries past each sequence point at garbage; the kernel must not read them.
    for b in range(batch):
        tables[b, -(-lens[b] // ps) :] = 10**6
    dt = jnp.dtype(c.dtype)
    q = rng.randn(batch, c.num_queries, c.num_kv * c.groups, c.head_dim)
    pages_dt = jnp.int8 if c.int8 else dt
    scales = dict(
        k_scales=None if ks is None else jnp.asarray(ks),
        v_scales=None if vs is None else jnp.asarray(vs),
    )
    return (
        jnp.asarray(q, dt),
        jnp.asarray(k, pages_dt),
        jnp.asarray(v, pages_dt),
        jnp.asarray(tables),
        jnp.asarray(lens),
        scales,
    )


def reference(q, k, v, tables, lens, scales, window):
    # The reference gathers pages densely, so give it in-range table entries.
    tables = jnp.where(tables >= k.shape[0], 0, tables)
    f32 = (lambda x: x.astype(jnp.float32)) if k.dtype != jnp.int8 else (lambda x: x)
    return paged_attention_reference(
        q.astype(jnp.float32), f32(k), f32(v), tables, lens, sliding_window=window, **scales
    )


class TestPagedAttention:
    interpret = True

    def run(self, c, q, k, v, tables, lens, scales):
        blocks = BlockSizes(pages_per_block=2, num_splits=c.splits)
        kw = dict(block_sizes=blocks, interpret=self.interpret, sliding_window=c.window, **scales)
        if c.num_queries == 1:
            return paged_attention(q[:, 0], k, v, tables, lens, **kw)[:, None]
        return paged_attention_multi(q, k, v, tables, lens, **kw)

    @pytest.mark.parametrize("case", CPU_CASES, ids=str)
    def test_matches_reference(self, case):
        q, k, v, tables, lens, scales = make_inputs(case)
        out = self.run(case, q, k, v, tables, lens, scales)
        assert out.dtype == q.dtype and out.shape == q.shape
        want = reference(q, k, v, tables, lens, scales, case.window)
        got = np.asarray(out, np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=tol(case.dtype), rtol=tol(case.dtype))
        again = self.run(case, q, k, v, tables, lens, scales)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(again))

    def test_layered_pool_reads_the_right_layer(self):
        """Pages with a leading layer axis and `layer=`: the kernel indexes the layer itself."""
        case = Case(groups=3, int8=True)
        q, k, v, tables, lens, scales = make_inputs(case)
        other_q, other_k, other_v, _, _, other_scales = make_inputs(case, seed=1)
        k3, v3 = jnp.stack([other_k, k]), jnp.stack([other_v, v])
        s3 = {name: jnp.stack([other_scales[name], val]) for name, val in scales.items()}
        blocks = BlockSizes(pages_per_block=2, num_splits=2)
        out = paged_attention(
            q[:, 0],
            k3,
            v3,
            tables,
            lens,
            layer=1,
            interpret=self.interpret,
            block_sizes=blocks,
            **s3,
        )
        want = reference(q, k, v, tables, lens, scales, None)[:, 0]
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1e-5, rtol=1e-5)

    def test_split_count_does_not_change_result(self):
        case = Case(page_size=8, groups=3)
        q, k, v, tables, lens, scales = make_inputs(case)
        one = self.run(dataclasses.replace(case, splits=1), q, k, v, tables, lens, scales)
        many = self.run(dataclasses.replace(case, splits=6), q, k, v, tables, lens, scales)
        np.testing.assert_allclose(one, many, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CPU_CASES + LOWER_ONLY, ids=str)
def test_lowers_for_cuda(case):
    q, k, v, tables, lens, scales = make_inputs(case)
    spec = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)

    def f(q, k, v, tables, lens, ks, vs):
        return paged_attention_multi(
            q, k, v, tables, lens, k_scales=ks, v_scales=vs, sliding_window=case.window
        )

    lowered = lower_for_cuda(
        f,
        spec(q),
        spec(k),
        spec(v),
        spec(tables),
        spec(lens),
        spec(scales["k_scales"]),
        spec(scales["v_scales"]),
    )
    assert lowered.as_text().count("xla.gpu.triton") == 1


def test_bad_inputs():
    q = jnp.zeros((2, 6, 80))
    good = jnp.zeros(kv_cache_shape(4, 8, 2, 80))
    tables, lens = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="padded to 128"):
        paged_attention(q, jnp.zeros((4, 8, 2, 80)), jnp.zeros((4, 8, 2, 80)), tables, lens)
    with pytest.raises(ValueError, match="need k_scales"):
        paged_attention(q, good.astype(jnp.int8), good.astype(jnp.int8), tables, lens)
    with pytest.raises(ValueError, match="at most 16"):
        paged_attention_multi(jnp.zeros((2, 17, 6, 80)), good, good, tables, lens)


@pytest.mark.gpu
class TestPagedAttentionGPU(TestPagedAttention):
    interpret = False


def test_layered_pool_lowers_for_cuda():
    case = Case(dtype="bfloat16", groups=3)
    q, k, v, tables, lens, _ = make_inputs(case)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    pool = jax.ShapeDtypeStruct((4, *k.shape), k.dtype)
    f = lambda q, k, v, t, n, layer: paged_attention(q[:, 0], k, v, t, n, layer=layer)
    lowered = lower_for_cuda(
        f, spec(q), pool, pool, spec(tables), spec(lens), jax.ShapeDtypeStruct((), jnp.int32)
    )
    assert lowered.as_text().count("xla.gpu.triton") == 1
