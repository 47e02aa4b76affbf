"""The KV tiers below an engine's device page pool (vLLM's KV connector): host memory, a disk
directory, a Mooncake store and a transfer engine's pages, built from the engine's options, and
the batched moves of pages between them and the pool that run between steps."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.mooncake import MooncakeTier, MooncakeUnavailable, mooncake_config
from jaxgen.cache.paged import PagedKVCache
from jaxgen.cache.tiers import DiskTier, HostTier, TieredStore, fingerprint, weights_digest
from jaxgen.cache.transfer import TransferTier, transfer_config
from jaxgen.engine.config import TierConfig
from jaxgen.errors import JaxgenError


def build(
    options: TierConfig, cfg, params, dtype, kv_quant, page_size: int, unsupported: str | None
) -> tuple[TieredStore | None, TransferTier | None]:
    """The tiers the options ask for, the transfer engine's first: (store, its transfer tier);
    (None, None) when none is asked for. `unsupported`: what the engine lacks that tiers need
    (None: nothing); asking for one then is a typed error, as is every bad option, before any
    store is contacted."""
    host_bytes, disk_dir, disk_bytes = (
        options.kv_host_cache_bytes, options.kv_disk_cache_dir, options.kv_disk_cache_bytes
    )  # fmt: skip
    mooncake, transfer, transfer_bytes = (
        options.kv_mooncake, options.kv_transfer, options.kv_transfer_bytes
    )  # fmt: skip
    if not options.asked:
        if disk_bytes is not None:
            raise JaxgenError("kv_disk_cache_bytes needs kv_disk_cache_dir")
        return None, None
    if unsupported is not None:
        raise JaxgenError(
            "KV cache tiers (kv_host_cache_bytes / kv_disk_cache_dir / kv_mooncake / "
            f"kv_transfer) need {unsupported}"
        )
    for name, value in (("kv_host_cache_bytes", host_bytes), ("kv_disk_cache_bytes", disk_bytes)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise JaxgenError(f"{name} must be an int >= 1, got {value!r}")
    if mooncake is not None:
        try:
            mooncake = mooncake_config(mooncake)
        except ValueError as e:
            raise JaxgenError(f"kv_mooncake: {e}") from None
    if transfer is not None:
        try:
            transfer = transfer_config(transfer)
        except ValueError as e:
            raise JaxgenError(f"kv_transfer: {e}") from None
        if not isinstance(transfer_bytes, int) or transfer_bytes < 1:
            raise JaxgenError(f"kv_transfer_bytes must be an int >= 1, got {transfer_bytes!r}")
    # Pages are shared only between engines whose pages mean the same: model, layout, weights.
    fp = fingerprint(
        {
            "arch": cfg.arch,
            "layers": cfg.num_layers,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "dtype": str(dtype),
            "kv_quant": kv_quant,
            "page_size": page_size,
            "weights": weights_digest(jax.tree.leaves(params)),
        }
    )
    tiers, transfer_tier = [], None
    if transfer is not None:
        try:
            transfer_tier = TransferTier(transfer, fp, transfer_bytes)
        except (ConnectionError, MooncakeUnavailable) as e:
            raise JaxgenError(f"kv_transfer: {e}") from None
        tiers.append(transfer_tier)
    if host_bytes is not None:
        tiers.append(HostTier(host_bytes))
    if disk_dir is not None:
        tiers.append(DiskTier(disk_dir, fp, disk_bytes))
    if mooncake is not None:
        try:
            tiers.append(MooncakeTier(mooncake, fp))
        except (ConnectionError, MooncakeUnavailable) as e:
            raise JaxgenError(f"kv_mooncake: {e}") from None
    return TieredStore(tiers, fp), transfer_tier


def move_pages(bm, store: TieredStore, kv: PagedKVCache) -> PagedKVCache:
    """Moves pages between the device pool and the tiers below it, before the next step
    writes the pool: evicted cached pages are read off the device in one batched gather
    (then stored), then blocks found in the tiers are written into their fresh pages in one
    scatter (the pool is donated). Returns the pool."""
    t0 = time.perf_counter()
    if bm.pending_offload:
        offload, bm.pending_offload = bm.pending_offload, []
        pages = [p for p, _ in offload]
        n = _pow2(len(pages))
        idx = np.zeros(n, np.int32)
        idx[: len(pages)] = pages
        blocks = jax.device_get(_gather_pages(kv, jnp.asarray(idx)))
        for i, (_, h) in enumerate(offload):
            store.put(h, tuple(np.ascontiguousarray(b[:, i]) for b in blocks))
        store.offloaded_blocks += len(offload)
    if bm.pending_load:
        load, bm.pending_load = bm.pending_load, []
        last = {page: block for page, block in load}  # a page loaded twice: the later one
        n = _pow2(len(last))
        idx = np.full(n, bm.num_pages, np.int32)  # out of range: dropped
        idx[: len(last)] = list(last)
        blocks = list(last.values())
        data = []
        for j in range(len(blocks[0])):
            parts = np.stack([b[j] for b in blocks], axis=1)
            pad = np.zeros((parts.shape[0], n - len(blocks), *parts.shape[2:]), parts.dtype)
            data.append(np.concatenate([parts, pad], axis=1))
        kv = _scatter_pages(kv, jnp.asarray(idx), tuple(data))
        store.loaded_blocks += len(last)
    store.io_seconds += time.perf_counter() - t0  # part of "schedule" in the profile
    return kv


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pool_leaves(kv: PagedKVCache) -> tuple:
    return tuple(a for a in (kv.k, kv.v, kv.k_scales, kv.v_scales) if a is not None)


@jax.jit
def _gather_pages(kv: PagedKVCache, pages):
    """The pages' contents, every layer: one array per pool leaf, [L, n, ...]."""
    return tuple(a[:, pages] for a in _pool_leaves(kv))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_pages(kv: PagedKVCache, pages, data):
    """Writes blocks into pages (an out-of-range page index is a padding row, dropped)."""
    leaves = [
        a.at[:, pages].set(d, mode="drop") for a, d in zip(_pool_leaves(kv), data, strict=True)
    ]
    names = [f for f in ("k", "v", "k_scales", "v_scales") if getattr(kv, f) is not None]
    return kv.replace(**dict(zip(names, leaves, strict=True)))
