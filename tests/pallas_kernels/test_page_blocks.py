"""The XLA path's paged attention over a flat list of page blocks, against the gathered-dense
reference: ragged lengths, padding blocks, several query tokens, sliding windows, int8 pages,
a layered pool, and pages no row uses holding NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.page_blocks import (
    BLOCK_PAGES,
    _general_blocks,
    blocks_needed,
    empty_blocks,
    fill_blocks,
    page_blocks,
    paged_attention_blocks,
)
from tests.pallas_kernels.test_paged_attention import CPU_CASES, Case, make_inputs, reference


def host_blocks(tables, lens, page_size, extra=3):
    tables, lens = np.asarray(tables), np.asarray(lens)
    need = blocks_needed(lens, page_size)
    return page_blocks(list(tables), list(lens), page_size, num_blocks=need + extra)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_matches_reference(case):
    q, k, v, tables, lens, scales = make_inputs(case)
    blocks = host_blocks(tables, lens, case.page_size)
    assert (blocks.row[-3:] == len(lens)).all()  # padding blocks present
    out = paged_attention_blocks(
        q, k, v, jax.tree.map(jnp.asarray, blocks), lens, sliding_window=case.window, **scales
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    got = np.asarray(out, np.float32)
    assert np.isfinite(got).all()
    want = reference(q, k, v, tables, lens, scales, case.window)
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


DECODE_CASES = [
    Case(groups=3, page_size=16),
    Case(groups=3, window=7),
    Case(groups=3, int8=True, window=20),
    Case(groups=8, num_kv=1, head_dim=80, page_size=16),
    Case(dtype="bfloat16", groups=3),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_path_matches_general_path(case):
    """T == 1 takes its own path (multiply-reduce on the gathered layout, no dots): it matches
    the per-block dots of the general path and the reference, with NaN in every slot of a row's
    pages past its end, a layered pool and padding blocks."""
    q, k, v, tables, lens, scales = make_inputs(case)
    ps = case.page_size
    k, v = np.array(k), np.array(v)  # writable host copies
    ks, vs = (None if x is None else np.array(x) for x in scales.values())
    for b, n in enumerate(np.asarray(lens)):
        if n % ps:  # the slots of the row's last page past its end
            page = int(tables[b, n // ps])
            for arr in (ks, vs) if case.int8 else (k, v):
                arr[page, n % ps :] = np.nan
    k, v = jnp.asarray(k), jnp.asarray(v)
    scales = dict(k_scales=None if ks is None else jnp.asarray(ks))
    scales["v_scales"] = None if vs is None else jnp.asarray(vs)
    blocks = jax.tree.map(jnp.asarray, host_blocks(tables, lens, ps))
    k3, v3 = jnp.stack([k, k[::-1]]), jnp.stack([v, v[::-1]])
    s3 = {
        name: None if val is None else jnp.stack([val, val[::-1]]) for name, val in scales.items()
    }
    kw = dict(sliding_window=case.window, layer=jnp.int32(0), **s3)
    got = jax.jit(paged_attention_blocks)(q, k3, v3, blocks, lens, **kw)
    sm_scale = case.head_dim**-0.5
    general = _general_blocks(q, k3, v3, blocks, lens, sm_scale=sm_scale, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    got, general = np.asarray(got, np.float32), np.asarray(general, np.float32)
    assert np.isfinite(got).all()
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, general, atol=tol, rtol=tol)
    want = reference(q, k, v, tables, lens, scales, case.window)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_layered_pool_and_dispatch():
    """A [L, P, ...] pool with `layer=`, through `dispatch.paged_attention(blocks=...)`."""
    case = Case(groups=3, int8=True, num_queries=2)
    q, k, v, tables, lens, scales = make_inputs(case)
    _, ok, ov, _, _, oscales = make_inputs(case, seed=1)
    k3, v3 = jnp.stack([ok, k]), jnp.stack([ov, v])
    s3 = {name: jnp.stack([oscales[name], val]) for name, val in scales.items()}
    blocks = jax.tree.map(jnp.asarray, host_blocks(tables, lens, case.page_size))
    safe = jnp.where(tables >= k.shape[0], 0, tables)

    @jax.jit
    def f(q, k3, v3, blocks, layer):
        return dispatch.paged_attention(
            q, k3, v3, safe, lens, layer=layer, blocks=blocks, impl="xla", **s3
        )

    got = np.asarray(f(q, k3, v3, blocks, jnp.int32(1)))
    want = reference(q, k, v, tables, lens, scales, None)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_fill_blocks_layout_and_overflow():
    tables = [[7, 3, 9, 1, 4, 8], [5]]
    blocks = fill_blocks(empty_blocks(4, batch=2), tables, [5 * 16 + 1, 3], page_size=16)
    # Row 0 has 81 tokens: pages 7 3 9 1 | 4 8; row 1: page 5; one padding block (row 2).
    np.testing.assert_array_equal(blocks.row, [0, 0, 1, 2])
    np.testing.assert_array_equal(blocks.start, [0, 16 * BLOCK_PAGES, 0, 0])
    np.testing.assert_array_equal(blocks.pages[0], [7, 3, 9, 1])
    np.testing.assert_array_equal(blocks.pages[1], [4, 8, 0, 0])
    np.testing.assert_array_equal(blocks.pages[2], [5, 0, 0, 0])
    with pytest.raises(ValueError, match="3 page blocks needed, 2 allocated"):
        fill_blocks(empty_blocks(2, batch=2), tables, [5 * 16 + 1, 3], page_size=16)
