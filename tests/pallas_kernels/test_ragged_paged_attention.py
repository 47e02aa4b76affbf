"""Ragged paged attention: the kernel in interpret mode and the XLA formulation against the
pure-jnp reference (itself checked against a float64 numpy loop), over one call mixing decode,
verify-like and prefill sequences (fresh and after cached context), with NaN in unused pages,
in slots past each sequence's end and in padded tokens; CUDA lowering; input validation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.paged_attention import kv_cache_shape
from jaxgen.pallas_kernels.ragged_paged_attention import (
    BlockSizes,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jaxgen.pallas_kernels.ragged_xla import ragged_paged_attention_xla
from tests.pallas_kernels.cuda import lower_for_cuda
from tests.pallas_kernels.tolerances import tol

MAX_PAGES = 6  # table width W


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    head_dim: int = 64
    groups: int = 1
    num_kv: int = 2
    page_size: int = 8
    int8: bool = False
    window: int | None = None

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


CPU_CASES = [
    Case(),
    Case(groups=4, head_dim=80, page_size=16),
    Case(groups=3, num_kv=1, page_size=4),
    Case(dtype="bfloat16", groups=3),
    Case(int8=True, groups=3),
    Case(groups=3, window=5),
]
LOWER_ONLY = [Case(dtype="bfloat16", head_dim=h, page_size=p) for h in (64, 128) for p in (16, 32)]


def sequences(ps: int):
    """(q_len, seq_len) per sequence: decode rows at ragged lengths {1, page-1, page, page+1,
    max}, verify-like rows of 4 tokens, a fresh prefill and a chunk after cached context."""
    full = MAX_PAGES * ps
    return [
        (1, 1),
        (1, ps - 1),
        (4, ps + 1),
        (1, ps),
        (3 * ps + 2, 3 * ps + 2),  # fresh prefill
        (1, ps + 1),
        (4, 4),
        (2 * ps + 1, full - 1),  # a chunk after cached context
        (1, full),
    ]


def make_inputs(c: Case, seed=0, pad_tokens=5, pad_rows=2):
    rng = np.random.RandomState(seed)
    ps = c.page_size
    seqs = sequences(ps)
    q_lens = np.array([q for q, _ in seqs], np.int32)
    lens = np.array([n for _, n in seqs], np.int32)
    num = len(seqs)
    rows = num + pad_rows
    num_pages = rows * MAX_PAGES + 3
    tables = rng.permutation(num_pages)[: rows * MAX_PAGES].reshape(rows, MAX_PAGES)
    tables = tables.astype(np.int32)
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
    # NaN wherever no sequence has a token: unused pages and slots past each sequence's end.
    poison_k, poison_v = (ks, vs) if c.int8 else (k, v)
    live = np.zeros((num_pages, ps), bool)
    for s in range(num):
        used = tables[s, : -(-lens[s] // ps)]
        live[used] = True
        live[used[-1], (lens[s] - 1) % ps + 1 :] = False
    poison_k[~live] = np.nan
    poison_v[~live] = np.nan
    for s in range(num):  # table entries past each sequence point at garbage
        tables[s, -(-lens[s] // ps) :] = 10**6
    tables[num:] = 10**6
    cu = np.zeros(rows + 1, np.int32)
    cu[1 : num + 1] = np.cumsum(q_lens)
    cu[num + 1 :] = 7  # past num_seqs: ignored whatever it holds
    seq_lens = np.concatenate([lens, np.full(pad_rows, 3, np.int32)])
    total = int(cu[num])
    qs = rng.randn(total + pad_tokens, c.num_kv * c.groups, c.head_dim).astype(np.float32)
    qs[total:] = np.nan
    dt = jnp.dtype(c.dtype)
    pages_dt = jnp.int8 if c.int8 else dt
    scales = dict(
        k_scales=None if ks is None else jnp.asarray(ks),
        v_scales=None if vs is None else jnp.asarray(vs),
    )
    args = (
        jnp.asarray(qs, dt),
        jnp.asarray(k, pages_dt),
        jnp.asarray(v, pages_dt),
        jnp.asarray(tables),
        jnp.asarray(cu),
        jnp.asarray(seq_lens),
        jnp.asarray([num], jnp.int32),
    )
    return args, scales, total


def numpy_attention(args, scales, window):
    """The semantics, spelled out per token in float64."""
    q, k, v, tables, cu, seq_lens, num = (np.asarray(a) for a in args)
    q, k, v = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    if scales["k_scales"] is not None:
        k = k * np.asarray(scales["k_scales"], np.float64)[..., None]
        v = v * np.asarray(scales["v_scales"], np.float64)[..., None]
    num_tokens, heads, head_dim = q.shape
    ps, kv_heads = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    for s in range(int(num[0])):
        q_len, n = cu[s + 1] - cu[s], seq_lens[s]
        pos = np.arange(n)
        keys = k[tables[s, pos // ps], pos % ps, :, :head_dim]  # [n, K, H]
        vals = v[tables[s, pos // ps], pos % ps, :, :head_dim]
        for i in range(q_len):
            p_i = n - q_len + i
            ok = pos <= p_i
            if window is not None:
                ok &= pos > p_i - window
            for h in range(heads):
                kh = h // (heads // kv_heads)
                sc = keys[ok, kh] @ q[cu[s] + i, h] / np.sqrt(head_dim)
                w = np.exp(sc - sc.max())
                out[cu[s] + i, h] = w @ vals[ok, kh] / w.sum()
    return out


def reference(args, scales, window):
    q, k, v, *rest = args
    f32 = (lambda x: x.astype(jnp.float32)) if k.dtype != jnp.int8 else (lambda x: x)
    return ragged_paged_attention_reference(
        q.astype(jnp.float32), f32(k), f32(v), *rest, sliding_window=window, **scales
    )


def check(got, want, total, dtype):
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    assert not got[total:].any()  # padded tokens get zeros
    np.testing.assert_allclose(got[:total], want[:total], atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("case", [Case(groups=3, window=5), Case(int8=True, groups=3)], ids=str)
def test_reference_matches_numpy(case):
    args, scales, total = make_inputs(case)
    want = numpy_attention(args, scales, case.window)
    got = np.asarray(reference(args, scales, case.window))
    np.testing.assert_allclose(got[:total], want[:total], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_xla_matches_reference(case):
    args, scales, total = make_inputs(case)
    f = jax.jit(lambda *a: ragged_paged_attention_xla(*a, sliding_window=case.window, **scales))
    out = f(*args)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    check(out, reference(args, scales, case.window), total, case.dtype)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f(*args)))


def test_xla_reads_the_layer_and_ignores_padding_rows():
    """A layered pool with a traced layer index, more padded tokens and sequence rows."""
    case = Case(groups=3, int8=True)
    args, scales, total = make_inputs(case, pad_tokens=40, pad_rows=6)
    other, other_scales, _ = make_inputs(case, seed=1, pad_tokens=40, pad_rows=6)
    q, k, v, *rest = args
    k2, v2 = jnp.stack([other[1], k]), jnp.stack([other[2], v])
    s2 = {n: jnp.stack([other_scales[n], x]) for n, x in scales.items()}
    f = jax.jit(lambda layer: ragged_paged_attention_xla(q, k2, v2, *rest, layer=layer, **s2))
    check(f(jnp.int32(1)), reference(args, scales, None), total, case.dtype)


def test_dispatch_picks_by_impl():
    case = Case(groups=3)
    args, scales, total = make_inputs(case)
    f = jax.jit(lambda *a: dispatch.ragged_paged_attention(*a, impl="xla"))
    check(f(*args), reference(args, scales, None), total, case.dtype)


class TestRaggedKernel:
    interpret = True

    def run(self, case, args, scales, **kw):
        blocks = BlockSizes(block_rows=16, pages_per_block=2)
        return ragged_paged_attention(
            *args,
            sliding_window=case.window,
            block_sizes=blocks,
            interpret=self.interpret,
            **scales,
            **kw,
        )

    @pytest.mark.parametrize("case", CPU_CASES, ids=str)
    def test_matches_reference(self, case):
        args, scales, total = make_inputs(case)
        out = self.run(case, args, scales)
        assert out.dtype == args[0].dtype and out.shape == args[0].shape
        check(out, reference(args, scales, case.window), total, case.dtype)
        again = self.run(case, args, scales)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(again))

    def test_layered_pool_reads_the_right_layer(self):
        case = Case(groups=3)
        args, scales, total = make_inputs(case)
        other, _, _ = make_inputs(case, seed=1)
        q, k, v, *rest = args
        layered = (q, jnp.stack([other[1], k]), jnp.stack([other[2], v]), *rest)
        check(
            self.run(case, layered, scales, layer=1),
            reference(args, scales, None),
            total,
            "float32",
        )


@pytest.mark.gpu
class TestRaggedKernelGPU(TestRaggedKernel):
    interpret = False


@pytest.mark.parametrize("case", CPU_CASES[:1] + CPU_CASES[-2:] + LOWER_ONLY, ids=str)
def test_lowers_for_cuda(case):
    args, scales, _ = make_inputs(case)
    spec = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)

    def f(*a, ks, vs):
        return ragged_paged_attention(*a, k_scales=ks, v_scales=vs, sliding_window=case.window)

    lowered = lower_for_cuda(
        lambda *a: f(*a[:-2], ks=a[-2], vs=a[-1]),
        *map(spec, args),
        spec(scales["k_scales"]),
        spec(scales["v_scales"]),
    )
    assert lowered.as_text().count("xla.gpu.triton") == 1


def test_bad_inputs():
    args, _, _ = make_inputs(Case())
    q, k, v, tables, cu, lens, num = args
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention_reference(q, k, v, tables, cu[:-1], lens, num)
    with pytest.raises(ValueError, match="num_seqs"):
        ragged_paged_attention_xla(q, k, v, tables, cu, lens, num[0])
    with pytest.raises(ValueError, match="padded to 128"):
        ragged_paged_attention(jnp.pad(q, ((0, 0), (0, 0), (0, 16))), k, v, tables, cu, lens, num)
    with pytest.raises(ValueError, match="need k_scales"):
        ragged_paged_attention(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, cu, lens, num)
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention_xla(q, k, v, tables, cu, lens, num, sliding_window=0)


def _flat_step(rng, seqs, pool, page_size, width, tokens, rows):
    """Flat inputs for sequences (q_len, seq_len, page ids, queries) at fixed T, S and W."""
    q = np.full((tokens, *seqs[0][3].shape[1:]), np.nan, np.float32)
    tables = np.full((rows, width), 10**6, np.int32)
    cu = np.zeros(rows + 1, np.int32)
    lens = np.full(rows, 3, np.int32)
    for s, (q_len, seq_len, pages, qs) in enumerate(seqs):
        q[cu[s] : cu[s] + q_len] = qs
        tables[s, : len(pages)] = pages
        lens[s] = seq_len
        cu[s + 1 :] = cu[s] + q_len
    k, v = pool
    return (jnp.asarray(q), k, v, jnp.asarray(tables), jnp.asarray(cu), jnp.asarray(lens),
            jnp.asarray([len(seqs)], jnp.int32))  # fmt: skip


def test_xla_invariant_order_does_not_depend_on_the_batch():
    """`invariant=True`: a sequence's output is bitwise the same alone and after other sequences
    of the step (other token offsets, other items ahead of its own), in one program shape, and
    still the attention. (The default order merges a chunk's items together, so a sequence's
    grouping, and its last bits, follow what precedes it.)"""
    rng = np.random.RandomState(3)
    ps, width, heads, kv, dim = 4, 64, 6, 2, 32
    num_pages = 8 * width
    shape = kv_cache_shape(num_pages, ps, kv, dim)
    pool = tuple(jnp.asarray(rng.randn(*shape) * 2, jnp.float32) for _ in range(2))
    free = iter(rng.permutation(num_pages).tolist())
    seqs = []
    for q_len, seq_len in [(1, 230), (1, 57), (70, 170), (1, 9), (33, 33), (1, 250), (2, 120)]:
        pages = [next(free) for _ in range(-(-seq_len // ps))]
        seqs.append((q_len, seq_len, pages, rng.randn(q_len, heads, dim).astype(np.float32)))
    f = jax.jit(functools.partial(ragged_paged_attention_xla, invariant=True))
    tokens, rows = 512, 8
    batch = f(*_flat_step(rng, seqs, pool, ps, width, tokens, rows))
    offset = 0
    for q_len, seq_len, pages, qs in seqs:
        alone = f(*_flat_step(rng, [(q_len, seq_len, pages, qs)], pool, ps, width, tokens, rows))
        np.testing.assert_array_equal(
            np.asarray(alone[:q_len]), np.asarray(batch[offset : offset + q_len])
        )
        offset += q_len
    args = _flat_step(rng, seqs, pool, ps, width, tokens, rows)
    check(batch, reference(args, {"k_scales": None, "v_scales": None}, None), offset, "float32")
