"""One entry point per attention operation; picks the Pallas kernel on GPU, XLA elsewhere.

``impl`` overrides the choice: ``"pallas"`` (compiled Pallas kernels; prefill attention takes
the fastest kernel for the GPU and shape from `prefill_table`, the Triton kernel where it has no
entry), ``"interpret"`` (the Triton kernels in Pallas interpret mode, for CPU tests), ``"xla"``
(the pure-jnp reference), ``"flash"`` (as ``"pallas"``, but decode over a contiguous cache runs
the FlashAttention kernel on the layer's slice instead of the paged decode kernel: kept to
measure the difference), ``"mosaic"`` (prefill attention on the Hopper kernel of
`flash_attention_mgpu` wherever it takes the inputs, the Triton kernels elsewhere) and
``"mosaic_interpret"`` (the same in JAX's Mosaic GPU interpreter and Pallas interpret mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.pallas_kernels import flash_attention as _flash
from jaxgen.pallas_kernels import page_blocks as _blocks
from jaxgen.pallas_kernels import paged_attention as _paged
from jaxgen.pallas_kernels import paged_mla as _mla
from jaxgen.pallas_kernels import paged_prefill as _prefill
from jaxgen.pallas_kernels import prefill_table as _table
from jaxgen.pallas_kernels import ragged_paged_attention as _ragged
from jaxgen.pallas_kernels import ragged_xla as _ragged_xla

IMPLS = ("pallas", "interpret", "xla", "flash", "mosaic", "mosaic_interpret")
_TRITON = {"mosaic": "pallas", "mosaic_interpret": "interpret"}


def target_device() -> tuple[str, str | None]:
    """(platform, device kind) the program being traced is compiled for: the abstract mesh's
    device when tracing under one (`jax.sharding.use_abstract_mesh`, as a deviceless compile for
    a GPU target does on a CPU-only machine: `bench.gpu_compile`), else the default backend's.
    Without this, a GPU program compiled where the CPU is the runtime backend got the CPU's
    attention path (the XLA reference, which transposes the whole cache at B=64)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None and getattr(device, "platform", None):
        return device.platform, getattr(device, "device_kind", None)
    backend = jax.default_backend()
    return backend, (jax.devices()[0].device_kind if backend == "gpu" else None)


def default_impl() -> str:
    return "pallas" if target_device()[0] == "gpu" else "xla"


def resolve(impl: str | None) -> str:
    """The implementation `impl` (None: the backend's default) selects."""
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _hopper():
    """The Hopper kernel's module, imported on first use (Mosaic GPU's Pallas costs ~0.2 s to
    import; CPU runs never need it)."""
    from jaxgen.pallas_kernels import flash_attention_mgpu

    return flash_attention_mgpu


def shape_class(q: jax.Array, k: jax.Array, causal: bool) -> str:
    """The key of a prefill attention call in `prefill_table`: dtype, head dim, GQA group,
    causality and the key length's bucket."""
    seq = k.shape[1]
    bucket = "s<=1k" if seq <= 1024 else "s<=4k" if seq <= 4096 else "s>4k"
    groups = q.shape[2] // k.shape[2]
    mode = "causal" if causal else "full"
    return f"{jnp.dtype(q.dtype).name}/h{q.shape[-1]}/g{groups}/{mode}/{bucket}"


def prefill_kernel(q, k, v, causal: bool, device_kind: str | None = None) -> str:
    """ "mosaic" where `prefill_table` measured the Hopper kernel fastest for this GPU and shape
    (and it takes the inputs), else "triton"."""
    if device_kind is None:
        platform, device_kind = target_device()
        if platform != "gpu":
            return "triton"
    choice = _table.TABLE.get(device_kind, {}).get(shape_class(q, k, causal), "triton")
    if choice == "mosaic" and _hopper().supports(q, k, v) is None:
        return "mosaic"
    return "triton"


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    kv_lens: jax.Array | None = None,
    q_offsets: jax.Array | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Attention of q [B, T, N, H] over contiguous k/v [B, S, K, H] -> [B, T, N, H].

    See `pallas_kernels.flash_attention` for the masking semantics.
    """
    impl = resolve(impl)
    kwargs = dict(
        causal=causal,
        kv_lens=kv_lens,
        q_offsets=q_offsets,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    if impl == "xla":
        return _flash.flash_attention_reference(q, k, v, **kwargs)
    if impl == "pallas":  # the table's choice (it only names the Hopper kernel where it fits)
        hopper = prefill_kernel(q, k, v, causal) == "mosaic"
    else:
        hopper = impl in _TRITON and _hopper().supports(q, k, v) is None
    if hopper:
        return _hopper().attention(q, k, v, interpret=impl == "mosaic_interpret", **kwargs)
    impl = _TRITON.get(impl, impl)
    return _flash.flash_attention(q, k, v, interpret=impl == "interpret", **kwargs)


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    *,
    kv_lens: jax.Array,
    q_offsets: jax.Array,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Attention of q [B, T, N, H] over layer `layer` of a contiguous cache [L, B, S, K, H]
    whose rows hold kv_lens[b] tokens, the new ones (at q_offsets[b]...) already written.

    Decode (T == 1) with a static `layer` (a Python int: the unrolled layers of
    `model.unroll_layers`) on the Pallas path reads the cache in place through the paged kernel:
    the cache is viewed as a layered page pool ([L, B * S / page, page, K, H], a free reshape)
    with an identity block table, so neither the layer's slice nor the context is copied, and
    long contexts are split across programs (flash-decoding). Other cases (a traced layer index
    inside a layer scan among them) slice the layer out and run `attention`. A T == 1 row whose
    token is inactive (kv_lens == q_offsets) gets a finite, meaningless output on the paged
    path; callers ignore inactive rows.
    """
    impl = resolve(impl)
    num_layers, batch, seq, kv_heads, head_dim = k_cache.shape
    page = _paged.contiguous_page_size(seq)
    if (
        _TRITON.get(impl, impl) in ("pallas", "interpret")
        and isinstance(layer, int)
        and q.shape[1] == 1
        and page is not None
        and head_dim == _paged.padded_head_dim(q.shape[-1])
    ):
        pages_per_row = seq // page

        def pool(c):
            return c.reshape(num_layers, batch * pages_per_row, page, kv_heads, head_dim)

        tables = jnp.arange(batch, dtype=jnp.int32)[:, None] * pages_per_row + jnp.arange(
            pages_per_row, dtype=jnp.int32
        )
        return _paged.paged_attention_multi(
            q,
            pool(k_cache),
            pool(v_cache),
            tables,
            kv_lens,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            layer=layer,
            interpret=_TRITON.get(impl, impl) == "interpret",
        )
    return attention(
        q,
        k_cache[layer].astype(q.dtype),
        v_cache[layer].astype(q.dtype),
        kv_lens=kv_lens,
        q_offsets=q_offsets,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        impl=impl,
    )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    blocks: _blocks.PageBlocks | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Attention of T <= 16 new tokens per sequence, q [B, T, N, H], over paged K/V.

    See `pallas_kernels.paged_attention` for layouts and semantics. `blocks` (optional) lists
    the pages the rows use (`pallas_kernels.page_blocks`); the XLA path then reads only those.
    """
    impl = _TRITON.get(resolve(impl), resolve(impl))
    kwargs = dict(
        sm_scale=sm_scale,
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=sliding_window,
        layer=layer,
    )
    if impl == "xla" and blocks is not None:
        return _blocks.paged_attention_blocks(q, k_pages, v_pages, blocks, seq_lens, **kwargs)
    if impl == "xla":
        return _paged.paged_attention_reference(
            q, k_pages, v_pages, block_tables, seq_lens, **kwargs
        )
    return _paged.paged_attention_multi(
        q, k_pages, v_pages, block_tables, seq_lens, interpret=impl == "interpret", **kwargs
    )


def paged_prefill(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    num_new: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    impl: str | None = None,
) -> jax.Array:
    """A chunk q [B, T, N, H] with its own k_new/v_new [B, T, K, H] after each row's cached
    prefix of context_lens[b] tokens in the pages (see `pallas_kernels.paged_prefill`): the
    kernel reads the prefix from the pages in place; the reference gathers it."""
    impl = _TRITON.get(resolve(impl), resolve(impl))
    kwargs = dict(
        sm_scale=sm_scale,
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=sliding_window,
        layer=layer,
    )
    args = (q, k_new, v_new, k_pages, v_pages, block_tables, context_lens, num_new)
    if impl == "xla":
        return _prefill.paged_prefill_reference(*args, **kwargs)
    return _prefill.paged_prefill_attention(*args, interpret=impl == "interpret", **kwargs)


def paged_mla_attention(
    q: jax.Array,
    pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    latent_dim: int,
    sm_scale: float,
    layer: jax.Array | int | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Absorbed Multi-head Latent Attention of q [B, T, N, R + Hr] over latent pages ->
    [B, T, N, R] (see `pallas_kernels.paged_mla`). The Pallas kernel takes T <= 16 new tokens
    per row and power-of-two R and Hr; other steps (long prefill chunks) use the reference."""
    impl = _TRITON.get(resolve(impl), resolve(impl))
    kwargs = dict(latent_dim=latent_dim, sm_scale=sm_scale, layer=layer)
    hr = q.shape[-1] - latent_dim
    fits = q.shape[1] <= _paged.MAX_QUERY_TOKENS and not (
        latent_dim & (latent_dim - 1) or hr & (hr - 1)
    )
    if impl == "xla" or not fits:
        return _mla.paged_mla_attention_reference(q, pages, block_tables, seq_lens, **kwargs)
    return _mla.paged_mla_attention(
        q, pages, block_tables, seq_lens, interpret=impl == "interpret", **kwargs
    )


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    seq_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    impl: str | None = None,
    return_pages: bool = False,
    invariant: bool = False,
):
    """Attention of one ragged step, q [T, N, H] over paged K/V -> [T, N, H]: every sequence
    (decode, verify, prefill chunk) with its own query offsets, lengths and page table (see
    `pallas_kernels.ragged_paged_attention`). ``"xla"`` runs the formulation of
    `pallas_kernels.ragged_xla`, whose cost follows the real tokens and context.
    `return_pages`: (out, (k_pages, v_pages, k_scales, v_scales)), the pool to use from here on
    (see `ragged_paged_attention_xla`). `invariant`: the XLA formulation's batch-invariant
    order; the kernels have none (a batch-invariant engine runs them on its row-shaped step)."""
    impl = _TRITON.get(resolve(impl), resolve(impl))
    args = (q, k_pages, v_pages, page_tables, cu_q_lens, seq_lens, num_seqs)
    kwargs = dict(
        sm_scale=sm_scale,
        k_scales=k_scales,
        v_scales=v_scales,
        sliding_window=sliding_window,
        layer=layer,
    )
    if impl == "xla":
        return _ragged_xla.ragged_paged_attention_xla(
            *args, return_pages=return_pages, invariant=invariant, **kwargs
        )
    if invariant:
        raise ValueError(f"no batch-invariant order in the {impl!r} ragged attention: use 'xla'")
    out = _ragged.ragged_paged_attention(*args, interpret=impl == "interpret", **kwargs)
    return (out, (k_pages, v_pages, k_scales, v_scales)) if return_pages else out
