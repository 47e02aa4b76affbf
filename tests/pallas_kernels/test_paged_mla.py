"""Paged MLA decode kernel: interpret mode against the gathered-dense reference, CUDA lowering,
the dispatch's choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.paged_mla import (
    BlockSizes,
    paged_mla_attention,
    paged_mla_attention_reference,
)
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.tolerances import tol


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    latent: int = 32  # R
    rope: int = 16  # Hr
    heads: int = 4  # N
    page_size: int = 8
    num_queries: int = 1
    splits: int = 1

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


CPU_CASES = [
    Case(),
    Case(heads=3, page_size=4, splits=3),  # rows (T x N) not a power of two
    Case(dtype="bfloat16", latent=64, splits=2),
    Case(num_queries=4, heads=5, splits=2),  # speculative verification rows
]
# DeepSeek-V3's shapes (R 512, Hr 64, 128 heads; 16 per device under tp=8).
LOWER_ONLY = [
    Case(dtype="bfloat16", latent=512, rope=64, heads=h, page_size=p, num_queries=t)
    for h, p, t in ((16, 16, 1), (128, 64, 1), (16, 16, 4))
]
LAYERS = 2


def make_inputs(c: Case, seed=0):
    """A layered pool [L, P, page, R + Hr]; sequence lengths {T, page-1, page, page+1, max} with
    randomly permuted block tables; every page no sequence uses is NaN, table entries past each
    sequence are out of range."""
    rng = np.random.RandomState(seed)
    ps, max_pages = c.page_size, 5
    lens = np.maximum(np.array([1, ps - 1, ps, ps + 1, max_pages * ps]), c.num_queries)
    batch = len(lens)
    num_pages = batch * max_pages + 3
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    pages = rng.randn(LAYERS, num_pages, ps, c.latent + c.rope).astype(np.float32)
    used = {int(p) for b in range(batch) for p in tables[b, : -(-lens[b] // ps)]}
    pages[:, [p for p in range(num_pages) if p not in used]] = np.nan
    for b in range(batch):
        tables[b, -(-lens[b] // ps) :] = 10**6
    q = rng.randn(batch, c.num_queries, c.heads, c.latent + c.rope)
    dt = jnp.dtype(c.dtype)
    return (
        jnp.asarray(q, dt),
        jnp.asarray(pages, dt),
        jnp.asarray(tables, jnp.int32),
        jnp.asarray(lens, jnp.int32),
    )


def reference(c, q, pages, tables, lens, layer):
    tables = jnp.where(tables >= pages.shape[1], 0, tables)  # the reference gathers densely
    return paged_mla_attention_reference(
        q.astype(jnp.float32),
        pages.astype(jnp.float32),
        tables,
        lens,
        latent_dim=c.latent,
        sm_scale=0.125,
        layer=layer,
    )


class TestPagedMLA:
    interpret = True

    def run(self, c, q, pages, tables, lens, layer):
        return paged_mla_attention(
            q,
            pages,
            tables,
            lens,
            latent_dim=c.latent,
            sm_scale=0.125,
            layer=layer,
            block_sizes=BlockSizes(pages_per_block=2, num_splits=c.splits),
            interpret=self.interpret,
        )

    @pytest.mark.parametrize("case", CPU_CASES, ids=str)
    def test_matches_reference(self, case):
        q, pages, tables, lens = make_inputs(case)
        out = self.run(case, q, pages, tables, lens, layer=1)
        assert out.dtype == q.dtype and out.shape == (*q.shape[:3], case.latent)
        got = np.asarray(out, np.float32)
        assert np.isfinite(got).all()
        want = reference(case, q, pages, tables, lens, layer=1)
        np.testing.assert_allclose(got, want, atol=tol(case.dtype), rtol=tol(case.dtype))
        # Another layer of the same pool gives another answer (the kernel indexes the layer).
        other = reference(case, q, pages, tables, lens, layer=0)
        assert np.abs(np.asarray(other) - want).max() > 10 * tol(case.dtype)
        again = self.run(case, q, pages, tables, lens, layer=1)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


@pytest.mark.parametrize("case", CPU_CASES[:1] + LOWER_ONLY, ids=str)
def test_lowers_for_cuda(case):
    q, pages, tables, lens = make_inputs(case)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)

    def f(q, pages, tables, lens):
        return paged_mla_attention(
            q, pages, tables, lens, latent_dim=case.latent, sm_scale=0.1, layer=1
        )

    lowered = lower_for_cuda(f, spec(q), spec(pages), spec(tables), spec(lens))
    assert lowered.as_text().count("xla.gpu.triton") == 1


def test_dispatch_picks_the_kernel_where_it_applies(monkeypatch):
    """impl="pallas" (what the GPU backend resolves to) runs the kernel for T <= 16 and
    power-of-two R and Hr; longer chunks and other widths take the reference."""
    from jaxgen.pallas_kernels import paged_mla

    calls = []
    monkeypatch.setattr(
        paged_mla, "paged_mla_attention", lambda *a, **k: calls.append(k) or "kernel"
    )
    c = Case()
    q, pages, tables, lens = make_inputs(c)
    tables = jnp.where(tables >= pages.shape[1], 0, tables)
    kw = dict(latent_dim=c.latent, sm_scale=0.1, layer=0, impl="pallas")
    assert dispatch.paged_mla_attention(q, pages, tables, lens, **kw) == "kernel"
    assert not calls[0]["interpret"]
    long_q = jnp.zeros((q.shape[0], 17, c.heads, q.shape[-1]))
    assert dispatch.paged_mla_attention(long_q, pages, tables, lens + 17, **kw).shape[1] == 17
    odd = dict(kw, latent_dim=c.latent - 8)  # R 24, Hr 24
    assert dispatch.paged_mla_attention(q, pages, tables, lens, **odd).shape[-1] == 24
    assert len(calls) == 1
    assert dispatch.resolve(None) == ("pallas" if jax.default_backend() == "gpu" else "xla")


def test_bad_inputs():
    c = Case()
    q, pages, tables, lens = make_inputs(c)
    kw = dict(latent_dim=c.latent, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="pages"):
        paged_mla_attention(q, pages, tables, lens, **kw)  # layered pool without layer=
    with pytest.raises(ValueError, match="entry width"):
        paged_mla_attention(q[..., :-1], pages[0], tables, lens, **kw)
    with pytest.raises(ValueError, match="power-of-two"):
        paged_mla_attention(q, pages[0], tables, lens, **dict(kw, latent_dim=c.latent - 8))
    with pytest.raises(ValueError, match="at most 16"):
        paged_mla_attention(jnp.zeros((5, 17, 4, 48)), pages[0], tables, lens, **kw)
    with pytest.raises(ValueError, match="rows"):
        paged_mla_attention(q, pages[0], tables[:2], lens, **kw)


@pytest.mark.gpu
class TestPagedMLAGPU(TestPagedMLA):
    interpret = False
