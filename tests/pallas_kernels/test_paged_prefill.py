"""Prefill of a chunk over a paged cache (prefix from its pages, chunk from the batch): the
kernel in interpret mode against the reference; the reference against writing the chunk into
the pages and attending over the gathered rows (the engine's old way); CUDA lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.flash_attention import flash_attention_reference
from jaxgen.pallas_kernels.paged_attention import gather_pages, kv_cache_shape
from jaxgen.pallas_kernels.paged_prefill import (
    PrefillBlocks,
    paged_prefill_attention,
    paged_prefill_reference,
)
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.tolerances import tol

SMALL = PrefillBlocks(block_m=16, block_k=16, pages_per_block=2)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    head_dim: int = 32
    groups: int = 2
    num_kv: int = 2
    chunk: int = 21
    page: int = 8
    window: int | None = None
    quantized: bool = False
    layered: bool = False

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


CASES = [
    Case(),
    Case(groups=1, num_kv=1, head_dim=24),
    Case(window=13),
    Case(dtype="bfloat16", groups=4, num_kv=1, page=16),
    Case(quantized=True),
    Case(layered=True, window=30),
]
CONTEXT = (0, 5, 37)  # no prefix, a partial page, several page blocks
NUM_NEW = (21, 9, 17)  # real tokens of each row's chunk


def make(c: Case, seed=0):
    rng = np.random.RandomState(seed)
    batch, n = len(CONTEXT), c.num_kv * c.groups
    dt = jnp.dtype(c.dtype)
    q = jnp.asarray(rng.randn(batch, c.chunk, n, c.head_dim), dt)
    k_new = jnp.asarray(rng.randn(batch, c.chunk, c.num_kv, c.head_dim), dt)
    v_new = jnp.asarray(rng.randn(batch, c.chunk, c.num_kv, c.head_dim), dt)
    max_pages = -(-(max(CONTEXT) + c.chunk) // c.page)
    num_pages = batch * max_pages + 3
    shape = kv_cache_shape(num_pages, c.page, c.num_kv, c.head_dim)
    if c.layered:
        shape = (3, *shape)
    pool = rng.randn(2, *shape).astype(np.float32)
    # Slots past each row's prefix may hold anything; NaN proves they are never read.
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    for b, ctx in enumerate(CONTEXT):
        for slot in range(ctx, max_pages * c.page):
            pool[
                (
                    slice(None),
                    *((slice(None),) if c.layered else ()),
                    tables[b, slot // c.page],
                    slot % c.page,
                )
            ] = np.nan
    if c.quantized:
        scales = np.abs(rng.randn(2, *shape[:-1])).astype(np.float32) * 0.05 + 0.01
        pages = jnp.asarray(np.nan_to_num(pool) / scales[..., None] * 0.3, jnp.float32)
        pages = jnp.clip(jnp.round(pages), -127, 127).astype(jnp.int8)
        k_scales, v_scales = jnp.asarray(scales[0]), jnp.asarray(scales[1])
        k_pages, v_pages = pages[0], pages[1]
    else:
        k_scales = v_scales = None
        k_pages, v_pages = jnp.asarray(pool[0], dt), jnp.asarray(pool[1], dt)
    return dict(
        q=q,
        k_new=k_new,
        v_new=v_new,
        k_pages=k_pages,
        v_pages=v_pages,
        block_tables=jnp.asarray(tables, jnp.int32),
        context_lens=jnp.asarray(CONTEXT, jnp.int32),
        num_new=jnp.asarray(NUM_NEW, jnp.int32),
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=c.window,
        layer=1 if c.layered else None,
    )


def valid_rows(out):
    return [np.asarray(out[b, :n], np.float32) for b, n in enumerate(NUM_NEW)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference(case):
    args = make(case)
    got = paged_prefill_attention(**args, blocks=SMALL, interpret=True)
    want = paged_prefill_reference(**args)
    assert got.shape == args["q"].shape and got.dtype == args["q"].dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    for g, w in zip(valid_rows(got), valid_rows(want), strict=True):
        np.testing.assert_allclose(g, w, atol=tol(case.dtype), rtol=tol(case.dtype))


def test_reference_equals_attending_over_the_written_pages():
    """Write the chunk into the rows' pages and attend over the gathered rows (what the engine
    did before): the same outputs as prefix-from-pages + chunk-from-batch."""
    case = Case()
    args = make(case)
    tables, ctx, k_pages, v_pages = (
        args["block_tables"],
        args["context_lens"],
        args["k_pages"],
        args["v_pages"],
    )
    for b, c in enumerate(CONTEXT):
        for t in range(case.chunk):
            page, slot = tables[b, (c + t) // case.page], (c + t) % case.page
            k_pages = k_pages.at[page, slot, :, : case.head_dim].set(args["k_new"][b, t])
            v_pages = v_pages.at[page, slot, :, : case.head_dim].set(args["v_new"][b, t])
    dense = lambda p: gather_pages(p, tables, None, case.head_dim)
    old = flash_attention_reference(
        args["q"],
        dense(k_pages),
        dense(v_pages),
        kv_lens=ctx + args["num_new"],
        q_offsets=ctx,
    )
    new = paged_prefill_reference(**args)
    for g, w in zip(valid_rows(new), valid_rows(old), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_dispatch_routes_by_impl():
    args = make(Case(groups=3, num_kv=1))
    ref = dispatch.paged_prefill(**args, impl="xla")
    kernel = dispatch.paged_prefill(**args, impl="interpret")
    for g, w in zip(valid_rows(kernel), valid_rows(ref), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_value_error():
    args = make(Case())
    with pytest.raises(ValueError, match="num_new"):
        paged_prefill_attention(**dict(args, num_new=args["num_new"][:2]), interpret=True)
    with pytest.raises(ValueError, match="k_new must be"):
        paged_prefill_attention(
            **dict(args, k_new=args["k_new"][:, :3], v_new=args["v_new"][:, :3])
        )
    with pytest.raises(ValueError, match="power of two"):
        PrefillBlocks(block_m=48)


@pytest.mark.parametrize(
    "case", [Case(dtype="bfloat16", head_dim=128), Case(quantized=True)], ids=str
)
def test_lowers_for_cuda(case):
    args = make(case)
    arrays = {k: v for k, v in args.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in args.items() if not isinstance(v, jax.Array)}
    names = sorted(arrays)
    spec = [jax.ShapeDtypeStruct(arrays[n].shape, arrays[n].dtype) for n in names]
    f = lambda *xs: paged_prefill_attention(**dict(zip(names, xs, strict=True)), **static)
    text = lower_for_cuda(f, *spec).as_text()
    assert text.count("xla.gpu.triton") == 1 and "paged_prefill" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiled_on_gpu_matches_reference(case):
    args = make(case)
    got = paged_prefill_attention(**args)
    want = paged_prefill_reference(**args)
    for g, w in zip(valid_rows(got), valid_rows(want), strict=True):
        np.testing.assert_allclose(g, w, atol=tol(case.dtype), rtol=tol(case.dtype))
