"""LLMEngine: the continuous-batching loop. The host scheduler composes a step, this module
packs it into device arrays (shapes padded to buckets), runs one jitted `paged_step`, and hands
the sampled tokens back. `LLM` and the server drive it through `add_request` / `step`.

The loop is overlapped (SGLang's overlap scheduler, vLLM's async scheduling): a dispatched step
stays in flight while the host schedules, packs and dispatches the next one, whose decode rows
read the tokens the first samples straight from the device (`steps.splice_tokens`); only then
does the host read the first step's tokens back and apply them (stops, detokenizing, pages).
A sequence that turns out to have finished costs one wasted row in the next step, never a wrong
token. Steps whose next step needs their tokens on the host first -- speculative verification
and drafting, beam search, penalties, a pipelined mesh -- and steps that could make the next
schedule preempt run synchronously, as does every step with `EngineConfig(overlap=False)`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxgen.cache.block_manager import EVICTION_POLICIES, BlockManager, page_hashes
from jaxgen.cache.mla import PagedMLACache
from jaxgen.cache.mooncake import MooncakeTier, MooncakeUnavailable, mooncake_config
from jaxgen.cache.paged import PagedKVCache
from jaxgen.cache.tiers import DiskTier, HostTier, TieredStore, fingerprint, weights_digest
from jaxgen.cache.transfer import TransferTier, transfer_config
from jaxgen.engine import roofline
from jaxgen.engine.config import EngineConfig
from jaxgen.engine.lora import AdapterSlots
from jaxgen.engine.metrics import HostClock, HostProfile, shape_record
from jaxgen.engine.runner import aot, steps
from jaxgen.engine.runner.packer import (
    StepPacker,
    StepShape,
    empty_step,
    token_spans,
    uses_penalties,
    wants_prompt_logprobs,
)
from jaxgen.engine.sample.sampling import SamplingArrays
from jaxgen.engine.sample.structured import BitmaskFiller
from jaxgen.engine.sched.scheduler import ScheduledStep, Scheduler
from jaxgen.engine.spec_decode.drafters import create_drafter
from jaxgen.engine.spec_decode.speculative import (
    SpecStats,
    SpeculativeConfig,
    ngram_batch,
)
from jaxgen.errors import (
    CapacityError,
    EnginePaused,
    EngineSleeping,
    InvalidSamplingParams,
    JaxgenError,
    LoRAError,
)
from jaxgen.pallas_kernels import dispatch
from jaxgen.sharding.rules import to_host

log = logging.getLogger("jaxgen.engine")

DEFAULT_CPU_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.85


PAUSE_MODES = ("finish", "abort", "keep")


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


def default_kv_budget(weight_bytes: int) -> int:
    """KV pool bytes when none is given: 1 GiB on the CPU; on a GPU, 85% of its memory
    minus the weights (the rest is left for activations and XLA's workspace)."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform == "gpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] * GPU_MEMORY_FRACTION) - weight_bytes
    return DEFAULT_CPU_KV_BYTES


# The background compile's log lines, which `jaxgen bench disagg` counts to wait for them.
BACKGROUND_COMPILE_STARTED = "in the background ("
BACKGROUND_COMPILE_ENDED = ("compiled in the background", "background compile of")


def _compile_logged(shape, args, statics):
    """`compile_in_background`'s work on the compile thread: `shape`'s step program, logged
    as it ends (not when the loop next collects it: an idle engine collects nothing)."""
    try:
        out = aot.compile_or_load(steps.paged_step, "paged_step", args, statics, None)
    except Exception as e:
        log.warning("background compile of %s failed (%s): it compiles on first use",
                    shape.describe(), e)  # fmt: skip
        raise
    log.info("  %s compiled in the background in %.2f s", shape.describe(), out[1]["seconds"])
    return out


@dataclasses.dataclass
class Flight:
    """A dispatched step whose results are still on the device."""

    step: ScheduledStep
    md: object  # the step's host RaggedMetadata (prompt logprob rows)
    info: object  # TokenInfo, rows ordered decode + prefill + samples
    prompt_info: object
    verified: object
    dispatched: float
    parts: list | None = None  # a pipelined step's microbatches
    rows: np.ndarray | None = None  # (microbatch, row) of each row of a pipelined step
    compiled: bool = False  # its program was compiled when it was dispatched
    covered: bool = False  # it ran on a larger program compiled before (`cover_new_shapes`)
    compiling: int = 0  # programs compiling in the background as it was dispatched
    deferred: int = 0  # prefill rows scheduled with it that wait for the next step (frozen)
    shape: StepShape | None = None  # the static shape it ran at (the step log's padded sizes)
    mark: tuple | None = None  # the engine's `HostClock` as it was dispatched (a step log listens)
    host: dict | None = None  # `HostClock.since` over the step's wall time, once landed


class Microbatches(int):
    """The microbatch count of a pipelined step's program key."""

    def describe(self) -> str:
        return f"in {int(self)} microbatches"


class LLMEngine:
    """Paged KV cache + block manager + scheduler + the jitted packed step.

    Args:
      kv_cache_bytes: memory budget for the page pool; pages = budget / bytes_per_page (see
        `PagedKVCache.bytes_per_page`). `num_pages` overrides it.
      kv_quant: None, "int8" or "fp8" pages.
      lora: `engine.lora.LoRAConfig` to serve LoRA adapters (None: the base model only).
    """

    def __init__(
        self,
        cfg,
        params,
        engine_cfg: EngineConfig,
        *,
        dtype,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_quant: str | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 512,
        attn_impl: str | None = None,
        note_program=None,
        placement=None,
        speculative=None,
        lora=None,
        kv_host_cache_bytes: int | None = None,
        kv_disk_cache_dir: str | None = None,
        kv_disk_cache_bytes: int | None = None,
        kv_mooncake=None,
        kv_write_through: bool = False,
        kv_prefetch: bool | None = None,
        kv_eviction_policy: str = "lru",
        kv_transfer=None,
        kv_transfer_bytes: int = 256 << 20,
    ):
        self.cfg, self.params, self.engine_cfg = cfg, params, engine_cfg
        self.dtype = jnp.dtype(dtype)
        self.attn_impl = attn_impl
        # A mesh with stages runs every step as microbatches pipelined over them.
        self.pipeline = None if placement is None else placement.pipeline
        if self.pipeline is not None and speculative is not None:
            raise ValueError(
                "speculative decoding does not run with pipeline parallelism (pp) yet: "
                "drop speculative= or the 'pp' axis of the mesh"
            )
        # On the XLA path decode attention reads only the pages each row uses (page_blocks);
        # the Pallas kernels read block tables and skip pages past each row's end themselves.
        # Microbatches of a pipelined step share one shape, so they read block tables too.
        self.page_blocks = dispatch.resolve(attn_impl) == "xla" and self.pipeline is None
        # MLA models keep one latent entry per token (cache.PagedMLACache), read through block
        # tables by model.mla.ragged_mla_attention.
        mla = cfg.mla is not None
        if mla:
            self._check_mla(kv_quant)
            self.page_blocks = False
        invariant = engine_cfg.batch_invariant
        if invariant:
            self._check_invariant(speculative, max_num_batched_tokens)
            # Cached pages were computed at other offsets or by decode steps: not reused.
            self.page_blocks = enable_prefix_caching = False
        if num_pages is None:
            budget = kv_cache_bytes or default_kv_budget(roofline.param_bytes(params))
            if mla:
                num_pages = PagedMLACache.pages_for_budget(cfg, budget, page_size, self.dtype)
            else:
                num_pages = PagedKVCache.pages_for_budget(
                    cfg, budget, page_size, self.dtype, kv_quant
                )
        if num_pages < 1:
            raise CapacityError(f"the KV cache budget holds no page of {page_size} tokens")
        self.placement = placement
        self.spec = None if speculative is None else SpeculativeConfig.from_dict(speculative)
        self.spec_stats = SpecStats()
        self._note_program = note_program or aot.ProgramLog()
        self.adapters = None if lora is None else self._adapter_slots(lora)
        self.drafter = None
        if self.spec is not None and self.spec.method != "ngram":
            self.drafter = create_drafter(
                self.spec,
                cfg,
                params,
                engine_cfg,
                dtype=dtype,
                page_size=page_size,
                num_pages=num_pages,
                placement=placement,
            )
        self._logq = self._logq_rows = None  # the draft model's last proposals
        if mla:
            self.kv = PagedMLACache.init(cfg, num_pages, page_size, self.dtype)
        else:
            self.kv = PagedKVCache.init(cfg, num_pages, page_size, self.dtype, kv_quant)
        self.kv_itemsize = 1 if kv_quant else self.dtype.itemsize
        if placement is not None:
            self.kv = placement.cache(self.kv)
        sharing = engine_cfg.share_on_fork
        self.kv_store = self._kv_store(
            kv_host_cache_bytes,
            kv_disk_cache_dir,
            kv_disk_cache_bytes,
            kv_mooncake,
            (kv_transfer, kv_transfer_bytes),
            page_size=page_size,
            kv_quant=kv_quant,
            mla=mla,
            prefix_caching=enable_prefix_caching,
        )
        if kv_eviction_policy not in EVICTION_POLICIES:
            raise JaxgenError(
                f"kv_eviction_policy={kv_eviction_policy!r}: use one of {list(EVICTION_POLICIES)}"
            )
        self.bm = BlockManager(
            num_pages, page_size, enable_prefix_caching, sharing, store=self.kv_store,
            eviction_policy=kv_eviction_policy,
        )  # fmt: skip
        if kv_write_through:
            if self.kv_store is None:
                raise JaxgenError(
                    "kv_write_through writes finished prompts' pages to a KV tier: give one "
                    "(kv_transfer=, kv_mooncake=, kv_host_cache_bytes= or kv_disk_cache_dir=)"
                )
            self.bm.write_through = True
        self.scheduler = Scheduler(
            self.bm,
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            token_bucket=engine_cfg.token_bucket,
            adapters=self.adapters,
            max_prefill_rows=max_num_batched_tokens // engine_cfg.invariant_chunk
            if invariant
            else None,
            fixed_chunk=engine_cfg.invariant_chunk if invariant else None,
        )
        if kv_prefetch is None:  # on the CPU the reads would compete with the steps' cores
            kv_prefetch = jax.default_backend() != "cpu"
        self.scheduler.prefetch_tiers = bool(kv_prefetch)
        self.max_pages_per_seq = self.bm.pages_needed(engine_cfg.max_model_len)
        self.packer = StepPacker(
            cfg,
            engine_cfg,
            self.bm,
            page_blocks=self.page_blocks,
            num_speculative_tokens=self.spec.num_tokens if self.spec is not None else 0,
            adapters=self.adapters,
            invariant=(
                max_num_batched_tokens // engine_cfg.invariant_chunk,
                engine_cfg.invariant_chunk,
                self.max_pages_per_seq,
            )
            if invariant
            else None,
        )
        self.executables: dict[StepShape, object] = {}  # ahead-of-time compiled steps
        self.weight_bytes = roofline.param_bytes(params)
        self.peak_pages_used = 0
        self.num_steps = 0
        self.tokens_generated = 0
        self.busy_time = 0.0
        self.last_step: dict = {}
        self._on_step = None  # `on_step`
        self._clock: HostClock | None = None  # the host beside logged steps, while one listens
        self.profile = HostProfile()
        self.last_inputs = None  # (StepShape, StepBatch, SamplingArrays) of the last 1-device step
        self._flight: Flight | None = None  # the dispatched step not handed back yet
        self.bitmasks = BitmaskFiller(cfg.vocab_size)
        self.overlapped_steps = 0  # steps dispatched while the previous one was in flight
        self.covered_steps = 0  # steps run on a larger compiled program (`cover_new_shapes`)
        self.deferred_prefills = 0  # prefill rows a frozen engine moved to the next step
        self._waited: set = set()  # sequences a step deferred that no step has run since
        # False: programs are frozen (`freeze_programs`): a step whose program has not compiled
        # runs on the least-work compiled one covering it, at any padding, or defers prefill
        # rows until one does; it compiles only when even that fails.
        self.compile_new_shapes = True
        self._cover_memo: tuple[int, dict] = (0, {})  # (programs known, {(shape, factor): cover})
        # `compile_in_background`: {shape: Future of (executable, info)} compiling on one worker
        # thread, and the shapes whose background compile failed (they compile inline).
        self._compiling: dict[StepShape, concurrent.futures.Future] = {}
        self._compile_failed: set[StepShape] = set()
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._landing_seconds = 0.0  # a step's landing of the one before it (`_launch`)
        self._last_landed = 0.0
        self._landed_mark = None  # `_clock` as the last step landed (a step log listens)
        # The controls of a training loop (`replace_params`, `pause`, `sleep`). The nonce keeps
        # one process's weights versions apart from another's in a shared or disk KV tier.
        self.weights_version = 0
        self._weights_nonce = os.urandom(8).hex()
        self.paused: str | None = None  # a `PAUSE_MODES` mode while paused
        self._paused_version = 0  # the weights version `pause` saw
        self.sleep_level = 0  # 1: the KV pool is freed; 2: the weights too
        self._kv_alloc = None  # compiled on the first `sleep`: re-allocates the pool

    @property
    def on_step(self):
        """Called with each landed step's `last_step` (`serve --step-log`); None: no step log.
        Setting it starts the engine's `HostClock` (its listeners), clearing it stops it."""
        return self._on_step

    @on_step.setter
    def on_step(self, callback) -> None:
        self._on_step = callback
        if callback is None and self._clock is not None:
            self._clock.close()
            self._clock = self._landed_mark = None
        elif callback is not None and self._clock is None:
            self._clock = HostClock().install()

    def _kv_store(
        self, host_bytes, disk_dir, disk_bytes, mooncake, transfer, *, page_size, kv_quant, mla,
        prefix_caching,
    ):  # fmt: skip
        """The KV tiers below the device pool (None: none asked for); `transfer`: (config,
        bytes) of the transfer engine's tier (`cache.transfer`), first when given."""
        transfer, transfer_bytes = transfer
        self.kv_transfer = None
        if host_bytes is None and disk_dir is None and mooncake is None and transfer is None:
            if disk_bytes is not None:
                raise JaxgenError("kv_disk_cache_bytes needs kv_disk_cache_dir")
            return None
        if mla or self.pipeline is not None or not prefix_caching:
            raise JaxgenError(
                "KV cache tiers (kv_host_cache_bytes / kv_disk_cache_dir / kv_mooncake / "
                "kv_transfer) need "
                "prefix caching "
                "on a non-MLA model without pipeline stages"
            )
        if self.placement is not None and self.placement.mesh.size > 1:
            raise JaxgenError("KV cache tiers are single-device for now: drop mesh=")
        for name, value in (
            ("kv_host_cache_bytes", host_bytes),
            ("kv_disk_cache_bytes", disk_bytes),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise JaxgenError(f"{name} must be an int >= 1, got {value!r}")
        if mooncake is not None:
            try:
                mooncake = mooncake_config(mooncake)  # checked before the store is contacted
            except ValueError as e:
                raise JaxgenError(f"kv_mooncake: {e}") from None
        if transfer is not None:
            try:
                transfer = transfer_config(transfer)
            except ValueError as e:
                raise JaxgenError(f"kv_transfer: {e}") from None
            if not isinstance(transfer_bytes, int) or transfer_bytes < 1:
                raise JaxgenError(f"kv_transfer_bytes must be an int >= 1, got {transfer_bytes!r}")
        fp = fingerprint(
            {
                "arch": self.cfg.arch,
                "layers": self.cfg.num_layers,
                "kv_heads": self.cfg.num_kv_heads,
                "head_dim": self.cfg.head_dim,
                "dtype": str(self.dtype),
                "kv_quant": kv_quant,
                "page_size": page_size,
                "weights": weights_digest(jax.tree.leaves(self.params)),
            }
        )
        tiers = []
        if transfer is not None:
            try:
                self.kv_transfer = TransferTier(transfer, fp, transfer_bytes)
            except (ConnectionError, MooncakeUnavailable) as e:
                raise JaxgenError(f"kv_transfer: {e}") from None
            tiers.append(self.kv_transfer)
        if host_bytes is not None:
            tiers.append(HostTier(host_bytes))
        if disk_dir is not None:
            tiers.append(DiskTier(disk_dir, fp, disk_bytes))
        if mooncake is not None:
            try:
                tiers.append(MooncakeTier(mooncake, fp))
            except (ConnectionError, MooncakeUnavailable) as e:
                raise JaxgenError(f"kv_mooncake: {e}") from None
        return TieredStore(tiers, fp)

    def kv_export(self, prompt_ids: list[int], salt=None) -> dict | None:
        """Where another engine can read this prompt's pages (`cache.transfer`): the
        transfer-engine session and [[chain hash, address, bytes], ...] of its leading full
        pages held in the transfer tier. None without a transfer tier. Thread-safe (the
        server's threads call it; the tier locks its own bookkeeping)."""
        if self.kv_transfer is None:
            return None
        hashes = page_hashes(prompt_ids, self.bm.page_size, self.bm.root(salt))
        return {"session": self.kv_transfer.session, "blocks": self.kv_transfer.locate(hashes)}

    def kv_import(self, params: dict) -> int:
        """Reads the pages `kv_export` described on another engine into this one's tiers, where
        admission finds them as a cached prefix; returns how many passed their checks (the rest
        of the prompt is recomputed). Thread-safe: a server thread calls it before it submits
        the request."""
        if self.kv_transfer is None:
            raise JaxgenError(
                "kv_transfer_params given to an engine without a transfer engine: start it with "
                "kv_transfer= (jaxgen serve --kv-transfer CONFIG.json)"
            )
        blocks = self.kv_transfer.pull(params["session"], params["blocks"])
        for key, block in blocks.items():
            self.kv_store.put(key, block)
        return len(blocks)

    def close(self) -> None:
        """Writes the cached pages down the KV tiers and closes them (a shared store's client);
        stops the background compiler (a compile under way finishes on its thread) and the step
        log's clock."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None
        self.on_step = None
        if self.kv_store is not None:
            self.flush_kv_tiers()
            self.kv_store.close()

    def flush_kv_tiers(self) -> int:
        """Writes every cached page on the device down to the tiers (a disk tier then holds
        them for the next engine). Returns how many pages were written."""
        if self.kv_store is None:
            return 0
        if self._flight is not None:
            jax.block_until_ready(self.kv)
        n = self.bm.offload_cached()
        if self.bm.pending_offload or self.bm.pending_load:
            self._tier_io()
        return n

    def _tier_io(self) -> None:
        """Moves pages between the device pool and the tiers below it, before the next step
        writes the pool: evicted cached pages are read off the device in one batched gather
        (then stored), then blocks found in the tiers are written into their fresh pages in one
        scatter (the pool is donated)."""
        bm, store = self.bm, self.kv_store
        t0 = time.perf_counter()
        if bm.pending_offload:
            offload, bm.pending_offload = bm.pending_offload, []
            pages = [p for p, _ in offload]
            n = _pow2(len(pages))
            idx = np.zeros(n, np.int32)
            idx[: len(pages)] = pages
            blocks = jax.device_get(_gather_pages(self.kv, jnp.asarray(idx)))
            for i, (_, h) in enumerate(offload):
                store.put(h, tuple(np.ascontiguousarray(b[:, i]) for b in blocks))
            store.offloaded_blocks += len(offload)
        if bm.pending_load:
            load, bm.pending_load = bm.pending_load, []
            last = {page: block for page, block in load}  # a page loaded twice: the later one
            n = _pow2(len(last))
            idx = np.full(n, self.bm.num_pages, np.int32)  # out of range: dropped
            idx[: len(last)] = list(last)
            blocks = list(last.values())
            data = []
            for j in range(len(blocks[0])):
                parts = np.stack([b[j] for b in blocks], axis=1)
                pad = np.zeros((parts.shape[0], n - len(blocks), *parts.shape[2:]), parts.dtype)
                data.append(np.concatenate([parts, pad], axis=1))
            self.kv = _scatter_pages(self.kv, jnp.asarray(idx), tuple(data))
            store.loaded_blocks += len(last)
        store.io_seconds += time.perf_counter() - t0  # part of "schedule" in the profile

    def _check_mla(self, kv_quant) -> None:
        if kv_quant is not None or self.pipeline is not None:
            raise ValueError(
                f"{self.cfg.arch} (Multi-head Latent Attention) runs with unquantized latent pages "
                f"and without pipeline stages: drop kv_quant={kv_quant!r} or the 'pp' axis"
            )

    def _check_invariant(self, speculative, max_num_batched_tokens: int) -> None:
        chunk = self.engine_cfg.invariant_chunk
        if speculative is not None or self.pipeline is not None:
            raise ValueError(
                "batch_invariant=True runs without speculative decoding and pipeline stages "
                "(their steps change shape with the batch): drop one or the other"
            )
        if chunk > max_num_batched_tokens:
            raise ValueError(
                f"batch-invariant prefill chunks of {chunk} tokens exceed "
                f"max_num_batched_tokens={max_num_batched_tokens}: raise the budget"
            )

    def _adapter_slots(self, lora) -> AdapterSlots:
        """The LoRA adapter stack of this engine, replicated over its mesh if it has one."""
        if self.pipeline is not None:
            raise LoRAError(
                "LoRA adapters do not run with pipeline parallelism (pp) yet: drop enable_lora "
                "or the 'pp' axis of the mesh"
            )
        if self.spec is not None:
            raise LoRAError(
                "LoRA adapters do not run with speculative decoding yet (the drafter has no "
                "adapters): drop enable_lora or speculative="
            )
        sharding = None
        if self.placement is not None:
            sharding = NamedSharding(self.placement.mesh, PartitionSpec())
        return AdapterSlots(
            self.cfg, lora, self.dtype, sharding=sharding, note_program=self._note_program
        )

    @property
    def lora_weights(self):
        """The adapter stack a step takes (None without LoRA)."""
        return None if self.adapters is None else self.adapters.weights

    # ------------------------------------------------------------------------------------------
    def bucket_shape(self, bucket, num_stop_ids: int) -> StepShape:
        """The step shape a declared `engine.runner.aot.Bucket` runs as (see `StepPacker`)."""
        return self.packer.bucket_shape(bucket, num_stop_ids, self.scheduler.max_num_batched_tokens)

    def precompile(self, buckets, num_stop_ids: int, directory: str | None = None) -> list[dict]:
        """Compiles the step of each declared bucket now (or loads it from `directory`, where
        it is also saved). Returns [{"program", "seconds", "source"}], one per program."""
        if self.placement is not None:
            raise ValueError(
                "ahead-of-time compile buckets run on one device; on a mesh the steps "
                "compile on first use (pass compile_buckets=[])"
            )
        shapes = list(dict.fromkeys(self.bucket_shape(b, num_stop_ids) for b in buckets))
        shapes = [s for s in shapes if s not in self.executables]
        report = []
        for i, shape in enumerate(shapes):
            log.info(
                "ahead of time (%d of %d): %s, %s",
                i + 1,
                len(shapes),
                shape.describe(),
                self._note_program.expected(),
            )
            self.executables[shape], info = aot.compile_or_load(
                steps.paged_step, "paged_step", *self._step_program(shape), directory
            )
            report.append({"program": shape.describe(), **info})
            compiled = info["source"] == "compiled"
            self._note_program.known(("paged_step", shape), info["seconds"] if compiled else None)
            log.info("  %s in %.2f s", info["source"], info["seconds"])
        return report

    def _step_program(self, shape: StepShape, abstract: bool = False) -> tuple[tuple, dict]:
        """The arguments and static options of the plain step program of `shape` (`abstract`:
        the engine's arrays as shapes and shardings, for a compile on another thread while
        the loop donates and replaces the arrays themselves)."""
        batch, sa = empty_step(shape, self.cfg.vocab_size, lora=self.adapters is not None)
        arrays = (self.params, self.kv)
        lora = self.lora_weights
        if abstract:
            arrays, lora = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=getattr(x, "sharding", None)
                ),
                (arrays, lora),
            )
        statics = dict(
            cfg=self.cfg,
            num_logprobs=shape.num_logprobs,
            prompt_logprobs=shape.prompt_logprobs,
            attn_impl=self.attn_impl,
            return_hidden=self.drafter is not None and self.drafter.handoff,
        )
        return (*arrays, batch, sa, lora), statics

    def _compile_later(self, shape: StepShape) -> None:
        """Starts compiling `shape`'s step program on the background thread."""
        if shape in self._compiling:
            return
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxgen-compile")
        log.info(
            "compiling %s in the background (%s); its steps run on a covering program until then",
            shape.describe(),
            self._note_program.expected(),
        )
        args, statics = self._step_program(shape, abstract=True)
        self._compiling[shape] = self._compiler.submit(_compile_logged, shape, args, statics)

    def _collect_compiled(self, wait: bool = False) -> None:
        """Puts the programs the background thread has compiled into use (`wait`: all of them,
        waiting for those still compiling)."""
        for shape, future in list(self._compiling.items()):
            if not (wait or future.done()):
                continue
            del self._compiling[shape]
            try:
                self.executables[shape], info = future.result()
            except Exception:  # noqa: BLE001 - the step compiles inline instead (logged)
                self._compile_failed.add(shape)
                continue
            self._note_program.known(("paged_step", shape), info["seconds"])

    def wait_for_compiles(self) -> None:
        """Returns once every background compile has finished, its program in use."""
        self._collect_compiled(wait=True)

    def check_request(self, request) -> None:
        """Raises CapacityError if the request can never be served by this engine."""
        n = request.params.num_samples
        if n > self.engine_cfg.max_num_seqs:
            raise CapacityError(
                f"n/best_of={n} exceeds max_num_seqs={self.engine_cfg.max_num_seqs}"
            )
        self.scheduler.check_fits(len(request.prompt_ids), request.params.max_tokens)
        if request.params.structured is not None and self.pipeline is not None:
            raise InvalidSamplingParams(
                "structured outputs do not run with pipeline parallelism (pp) yet: drop the "
                "constraint or the 'pp' axis of the mesh"
            )

    def add_request(self, request) -> None:
        """Queues a request; raises CapacityError (queueing nothing) if it can never fit."""
        self.add_requests([request])

    def add_requests(self, requests) -> None:
        """Queues requests, each checked once; if one can never fit, none is queued. While
        paused or asleep they wait for `resume` / `wake_up` (refused when paused to abort)."""
        if self.paused == "abort":
            raise EnginePaused(
                "the engine is paused with mode='abort' and takes no requests: resume() first"
            )
        for r in requests:
            self.check_request(r)
        for r in requests:
            self.scheduler.add(r)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def reset_prefix_cache(self) -> int:
        return self.bm.reset_prefix_cache()

    @property
    def has_work(self) -> bool:
        if self._flight is not None:
            return True
        if self.paused == "keep" or self.sleep_level:
            return False
        return bool(self.scheduler.running) if self.paused else self.scheduler.has_work

    # ------------------------------------------------------------------------------------------
    # Weights, pause and sleep: the controls of a training loop (`LLM.update_weights`, ...)
    # ------------------------------------------------------------------------------------------
    def replace_params(self, params) -> int:
        """Takes `params` in place of the weights: the same leaves, shapes, dtypes and
        shardings (the compiled steps take params as an argument, so nothing recompiles).
        Cached prefixes of older weights are never reused, on the device or in the tiers;
        sequences running keep their K/V (`pause("keep")` first has `resume` recompute them).
        Returns the new weights version."""
        self.params = params
        self.weights_version += 1
        self.bm.set_weights_key((self._weights_nonce, self.weights_version))
        return self.weights_version

    def pause(self, mode: str = "finish") -> list[str]:
        """Stops admitting requests. "finish": running sequences go on to their end; "abort":
        every request is aborted (finish reason "abort") and new ones are refused; "keep":
        no step runs, running sequences keep their pages (recomputed on `resume` when the
        weights changed meanwhile). Other requests wait for `resume`. Returns the ids of the
        requests aborted."""
        if mode not in PAUSE_MODES:
            raise JaxgenError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        aborted = []
        if mode == "abort":
            if self._flight is not None:  # its tokens belong to requests about to be aborted
                flight, self._flight = self._flight, None
                self._land(flight)
            aborted = list(self.scheduler.requests)
            for request_id in aborted:
                self.scheduler.abort(request_id)
        if self.paused is None:
            self._paused_version = self.weights_version
        self.paused = mode
        self.scheduler.admitting = False
        return aborted

    def resume(self) -> None:
        """Steps again after `pause`; sequences kept through a weight update recompute."""
        if self.paused == "keep" and self.weights_version != self._paused_version:
            if self._flight is not None:
                raise RuntimeError("a step flew while paused")  # `step` lands it when paused
            self.scheduler.preempt_running()
        self.paused = None
        self.scheduler.admitting = not self.sleep_level

    def sleep(self, level: int = 1) -> None:
        """Frees the KV page pool's device memory (level 2: drops the weights too; they come
        back by `replace_params`); the compiled step programs stay. Needs no sequence running;
        requests added meanwhile wait for `wake_up`."""
        if level not in (1, 2):
            raise JaxgenError(
                f"sleep level must be 1 (KV pool) or 2 (KV pool and weights), got {level!r}"
            )
        if self.scheduler.running or self._flight is not None:
            raise JaxgenError(
                "sleep frees the KV pool under running requests: pause(mode='finish' or "
                "'abort') and let them end first"
            )
        if self.drafter is not None:
            raise JaxgenError("sleep does not free a draft model's pool yet: drop speculative=")
        if self.sleep_level:
            if level == 2:
                self.params = None
            self.sleep_level = max(self.sleep_level, level)
            return
        if self._kv_alloc is None:  # compiled while the pool exists, reused by every wake_up
            spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.kv)
            self._kv_alloc = (
                jax.jit(
                    lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec),
                    out_shardings=jax.tree.map(lambda a: a.sharding, self.kv),
                )
                .lower()
                .compile()
            )
        self.flush_kv_tiers()
        self.bm.reset_prefix_cache()  # the pages' contents go with the pool
        for leaf in jax.tree.leaves(self.kv):
            leaf.delete()
        self.kv = self.last_inputs = None
        if level == 2:
            self.params = None
        self.sleep_level = level
        self.scheduler.admitting = False

    def wake_up(self) -> None:
        """Re-allocates the KV pool (no compile: its program was compiled by `sleep`)."""
        if not self.sleep_level:
            return
        if self.params is None:
            raise EngineSleeping(
                "the engine slept at level 2 and holds no weights: update_weights(params) "
                "before wake_up()"
            )
        self.kv = self._kv_alloc()
        self.sleep_level = 0
        self.scheduler.admitting = self.paused is None

    def step(self) -> list:
        """Runs one scheduling iteration; returns [(Sequence, text delta)] for the tokens handed
        back. With overlap, the step dispatched here stays in flight while the previous one is
        handed back: its tokens come with the next call (`has_work` holds until then)."""
        t0 = time.perf_counter()
        events = []
        flight, self._flight = self._flight, None
        if self.paused == "keep":  # only the step still in flight lands
            return [] if flight is None else self._land(flight)
        if flight is not None and not self.scheduler.decodes_fit():
            events += self._land(flight)  # the schedule may preempt: no pending tokens then
            flight = None
            t0 = time.perf_counter()
        drafts = self._propose() if self.spec is not None else None
        step = self.scheduler.schedule(drafts)
        if self.bm.pending_offload or self.bm.pending_load:
            self._tier_io()
        if self.adapters is not None:
            self.adapters.commit()  # adapters the schedule gave slots, before the step reads them
        self.peak_pages_used = max(self.peak_pages_used, self.bm.num_used_pages)
        self.profile.add("schedule", time.perf_counter() - t0)
        launched = None
        if not step.empty:
            with self.placement.context() if self.placement else contextlib.nullcontext():
                launched, landed = self._launch(step, flight)
            self.profile.steps += 1
            self.overlapped_steps += flight is not None
            if landed is not None:  # a constrained step landed `flight` before its masks
                events += landed
                flight = None
        elif flight is None and self.scheduler.has_work and not self.scheduler.running:
            raise RuntimeError("scheduler made no progress with free pages")  # a bug
        if flight is not None:
            events += self._land(flight)
        if launched is not None:
            if self._may_fly(step):
                self._flight = launched
            else:
                events += self._land(launched)
        if self.bm.write_through and self.bm.pending_offload:
            # Finished sequences' pages are in the tiers before their outputs are handed back
            # (a decode instance asked next finds them).
            self._tier_io()
        return events

    def _may_fly(self, step: ScheduledStep) -> bool:
        """Whether the next step may be scheduled before this one's tokens are on the host."""
        if not self.engine_cfg.overlap or self.spec is not None or self.pipeline is not None:
            return False
        return not any(
            r.state.request.beam is not None or uses_penalties(r.state.seq.params)
            for r in step.decode + step.prefill + step.samples
        )

    def _launch(self, step: ScheduledStep, prev: Flight | None) -> tuple[Flight, list | None]:
        """Packs and dispatches one step (the device runs it asynchronously); `prev`: the step
        still in flight, whose sampled tokens this one's pending decode rows read. Returns the
        new flight, and `prev`'s events when the step had to land it (structured outputs, or
        a program to compile first)."""
        statics = dict(cfg=self.cfg, attn_impl=self.attn_impl)
        mark = self._clock.mark() if self._clock is not None else None
        t_pack = time.perf_counter()
        landed = None
        covered = False
        deferred = 0
        if self.pipeline is None:
            rows = step.decode + step.prefill + step.samples + step.verify
            masked = any(r.state.seq.grammar is not None for r in rows)
            shape = self.packer.shape_of(step)
            background = self.engine_cfg.compile_in_background
            frozen = not self.compile_new_shapes
            if not masked and (self.engine_cfg.cover_new_shapes or background or frozen):
                if self._compiling:
                    self._collect_compiled()
                cover = self._cover(shape, math.inf if frozen else self.engine_cfg.cover_new_shapes)
                own = ("paged_step", shape) in self._note_program.keys
                if frozen and cover is None and not own:
                    shape, cover, deferred = self._defer_prefills(step, shape)
                if cover is None and background and shape not in self._compile_failed:
                    cover = self._cover(shape, math.inf)  # any padding, for a while
                    if cover is not None:
                        self._compile_later(shape)
                covered = cover is not None
                shape = cover or shape
            if self._waited:  # deferred sequences that run now, or ended, leave it
                ran = {r.state.id for r in step.decode + step.prefill + step.verify}
                alive = {s.id for s in self.scheduler.running}
                self._waited = {i for i in self._waited if i in alive and i not in ran}
            batch, sa, shape = self.packer.pack(step, self._logq, self._logq_rows, shape=shape)
            self.last_inputs = (shape, batch, sa)
            batch = self._splice(step, batch, prev)
            handoff = self.drafter is not None and self.drafter.handoff
            hidden = None  # the MTP drafter's hand-over (none from a constrained step)
            if masked:
                new = self._note_program("paged_step", shape, "with a token bitmask")
                t0 = time.perf_counter()
                info, prompt_info, verified, landed = self._run_masked(step, batch, sa, shape, prev)
            else:
                new = self._note_program("paged_step", shape)
                t0 = time.perf_counter()
                if new and prev is not None:
                    # The compile (or load) holds the host for 0.1-5 s here: the step in
                    # flight lands first, so its tokens are not held back behind it (and the
                    # step log charges the compile to this step, which needs it).
                    self.scheduler.launch(step)
                    landed = self._land(prev)
                    self._landing_seconds = time.perf_counter() - t0
                run = self.executables.get(shape)
                args = (self.params, self.kv, batch, sa, self.lora_weights)
                options = None if run is not None else dict(
                    num_logprobs=shape.num_logprobs,
                    prompt_logprobs=shape.prompt_logprobs,
                    return_hidden=handoff,
                    **statics,
                )  # fmt: skip
                if run is None and self.placement is None:
                    # Compiled ahead of time (from this step's arguments) even when the step
                    # needs it now: a jitted call compiles a program again for each kind of
                    # token input it meets (host tokens, or the device array a pending decode
                    # row's token is spliced into: `_splice`, committed to the device), a
                    # second compile of 3-7 s on XLA:CPU that no step log would flag. An
                    # executable takes either and never compiles again.
                    run, _ = aot.compile_or_load(steps.paged_step, "paged_step", args, options,
                                                 None)  # fmt: skip
                    self.executables[shape] = run
                run = run or functools.partial(steps.paged_step, **options)
                info, prompt_info, verified, self.kv, *hidden = run(*args)
                hidden = hidden[0] if hidden else None
            if handoff:
                self.drafter.hand_over(hidden, token_spans(step, shape))
            flight = Flight(step, batch.md, info, prompt_info, verified, t0)
        else:
            batch, sa, shape, parts, rows = self.packer.pack_microbatches(
                step, self.pipeline.microbatches
            )
            new = self._note_program("pipelined_paged_step", shape, Microbatches(len(parts)))
            t0 = time.perf_counter()
            info, prompt_info, _, self.kv = steps.pipelined_paged_step(
                self.params,
                self.kv,
                batch,
                sa,
                pipeline=self.pipeline,
                num_logprobs=shape.num_logprobs,
                prompt_logprobs=shape.prompt_logprobs,
                **statics,
            )
            flight = Flight(step, batch.md, info, prompt_info, None, t0, parts, rows)
        if landed is None:  # a step that landed `prev` first (constrained, compiling) launched
            self.scheduler.launch(step)
        flight.compiled, flight.shape, flight.covered = bool(new), shape, covered
        flight.compiling, flight.deferred, flight.mark = len(self._compiling), deferred, mark
        self.covered_steps += covered
        self.deferred_prefills += deferred
        t1 = time.perf_counter()
        self.profile.add("pack", t0 - t_pack)
        # A step that landed `prev` in between: _land counted its wait and update.
        self.profile.add("dispatch", t1 - t0 - self._landing_seconds)
        self._landing_seconds = 0.0
        if new:
            self._note_program.compiled(t1 - t0)
        return flight, landed

    def program_shapes(self) -> list[dict]:
        """The compiled plain step programs, each as the step log records a step's `shape`."""
        return [
            shape_record(key[1])
            for key in self._note_program.keys
            if len(key) == 2 and key[0] == "paged_step"
        ]

    def freeze_programs(self, frozen: bool = True) -> int:
        """Stops (or, `frozen=False`, resumes) compiling step programs for new shapes: once a
        warm-up has compiled the shapes a load makes, a step whose own program has not compiled
        runs on the least-work compiled program that covers it (padding), as a CUDA-graph
        engine pads a batch to a captured size; a step that nothing compiled covers leaves its
        last prefill rows to the next step until one does (`_defer_prefills`), and only a step
        that still has none compiles (inline). Background compiles under way finish. Returns
        the programs compiled."""
        self.compile_new_shapes = not frozen
        return len(self._note_program.keys)

    def _defer_prefills(
        self, step: ScheduledStep, shape: StepShape
    ) -> tuple[StepShape, StepShape | None, int]:
        """Frozen programs, a step that none compiled covers: rather than compile it inline
        (seconds, with every running request held), its last prefill rows wait for the next
        step, one at a time, until what is left has a compiled program of its own or one that
        covers it. A deferred row's sequence keeps its pages and its place (the scheduler
        gives chunks under way their rows first), and is deferred once at most: its next row
        stays (`_waited` holds it until a step runs one), as do a row whose n > 1 siblings
        sample from it and the first prefill row of a step without decode rows.
        Shortens `step.prefill` in place; returns (shape, cover or None, rows deferred), the
        step unchanged (0) when no shorter step runs on a compiled program."""
        floor = 0 if step.decode or step.verify else 1
        stays = {id(r.sample_of) for r in step.samples}
        keep = len(step.prefill)
        while keep > floor:
            row = step.prefill[keep - 1]
            if id(row) in stays or row.state.id in self._waited:
                break
            keep -= 1
            trial = dataclasses.replace(step, prefill=step.prefill[:keep])
            fits = self.packer.shape_of(trial)
            cover = self._cover(fits, math.inf)
            if cover is not None or ("paged_step", fits) in self._note_program.keys:
                self._waited.update(r.state.id for r in step.prefill[keep:])
                deferred = len(step.prefill) - keep
                del step.prefill[keep:]
                return fits, cover, deferred
        return shape, None, 0

    def _cover(self, shape: StepShape, factor: float) -> StepShape | None:
        """A compiled plain step program that covers `shape` (`StepShape.covers`, within
        `factor` x its work: `cover_new_shapes`), the least work first; None when `shape`'s
        own program has compiled (it runs as it is) or no compiled one covers it."""
        known = self._note_program.keys
        if not factor or ("paged_step", shape) in known:
            return None
        # A shape's cover is looked up once per set of compiled programs (it only grows), not
        # at every step that meets the shape.
        if self._cover_memo[0] != len(known):
            self._cover_memo = (len(known), {})
        memo = self._cover_memo[1]
        if (shape, factor) not in memo:
            page = self.bm.page_size
            found = [
                key[1]
                for key in known
                if len(key) == 2 and key[0] == "paged_step" and key[1].covers(shape, factor, page)
            ]
            memo[shape, factor] = min(
                found, key=lambda s: (s.work(page), s.describe()), default=None
            )
        return memo[shape, factor]

    def _run_masked(self, step: ScheduledStep, batch, sa, shape: StepShape, prev: Flight | None):
        """A step under structured outputs. Its masks need every row's newest token on the host,
        so the forward pass is dispatched first; while the device runs it, the host lands `prev`
        (the step still in flight: its tokens advance the grammars) and fills the step's token
        bitmask (llguidance); sampling is dispatched last, with the mask. Returns
        (info, prompt_info, verified, prev's events: [] when nothing was in flight)."""
        logits, self.kv = steps.paged_logits(
            self.params,
            self.kv,
            batch,
            self.lora_weights,
            cfg=self.cfg,
            prompt_logprobs=shape.prompt_logprobs,
            attn_impl=self.attn_impl,
        )
        self.scheduler.launch(step)
        t_land = time.perf_counter()
        landed = [] if prev is None else self._land(prev)
        self._landing_seconds = time.perf_counter() - t_land
        rows = step.decode + step.prefill + step.samples
        grammars = [
            (i, r.state.seq.output_ids, r.state.seq.grammar)
            for i, r in enumerate(rows)
            if r.state.seq.grammar is not None and not r.state.seq.finished  # else: dropped
        ]
        sa = sa.replace(allowed=self.bitmasks.fill(grammars, shape.num_rows))
        if any(r.state.seq.grammar is not None for r in step.verify):
            # Position j of a verify row: the grammar advanced by the row's first j drafts.
            kp1 = shape.verify_len
            drafted = [
                (v * kp1, r.state.seq.output_ids, r.state.seq.grammar, r.draft)
                for v, r in enumerate(step.verify)
                if r.state.seq.grammar is not None
            ]
            vmask = self.bitmasks.fill(drafted, shape.verify_rows * kp1)
            batch = batch.replace(verify_allowed=vmask.reshape(shape.verify_rows, kp1, -1))
        outputs = steps.packed_outputs(
            logits,
            batch,
            sa,
            num_logprobs=shape.num_logprobs,
            prompt_logprobs=shape.prompt_logprobs,
        )
        return (*outputs, landed)

    @staticmethod
    def _splice(step: ScheduledStep, batch, prev: Flight | None):
        """Decode rows whose input token is still pending read it from `prev`'s device output."""
        pending = [(i, r.state.pending_row) for i, r in enumerate(step.decode) if r.state.pending]
        if not pending:
            return batch
        if prev is None:
            raise AssertionError("a pending token without a step in flight")  # a bug
        source = np.full(batch.tokens.shape, -1, np.int32)
        index, rows = zip(*pending, strict=True)
        source[list(index)] = rows
        return batch.replace(tokens=steps.splice_tokens(batch.tokens, source, prev.info.tokens))

    def _land(self, flight: Flight) -> list:
        """Reads a dispatched step's results back (waiting for the device) and applies them:
        prompt logprobs, tokens into sequences, stops, pages. Returns its events."""
        step = flight.step
        t0 = time.perf_counter()
        host = to_host(flight.info)
        if flight.rows is not None:
            rows = flight.rows
            host = jax.tree.map(lambda a: a[rows[:, 0], rows[:, 1]], host)
        verified = None if flight.verified is None else to_host(flight.verified)
        prompt = None if flight.prompt_info is None else to_host(flight.prompt_info)
        t1 = time.perf_counter()
        self.profile.add("wait", t1 - t0)
        if flight.mark is not None and self._clock is not None:  # the host over the step's span
            later = flight.dispatched < self._last_landed and self._landed_mark is not None
            flight.host = self._clock.since(self._landed_mark if later else flight.mark)
            self._landed_mark = self._clock.mark()
        self._account(step, t1 - max(flight.dispatched, self._last_landed), flight)
        self._last_landed = t1
        if prompt is not None:
            if flight.parts is None:
                self._record_prompt_logprobs(step, prompt, flight.md)
            else:
                for m, part in enumerate(flight.parts):
                    part_info = jax.tree.map(lambda a, m=m: a[m], prompt)
                    self._record_prompt_logprobs(part, part_info, flight.md)

        rows = step.decode + step.prefill + step.samples
        logprobs, ranks = host.logprobs.tolist(), host.ranks.tolist()

        def row_info(r):
            n = rows[r].state.seq.params.logprobs or 0
            if not n:
                return logprobs[r], ranks[r], []
            ids, values = host.top_ids[r, :n].tolist(), host.top_logprobs[r, :n].tolist()
            return logprobs[r], ranks[r], list(zip(ids, values, strict=True))

        events = list(self.scheduler.update(step, host.tokens.tolist(), row_info, verified))
        if step.verify:
            self._after_verify(step, verified)
        self.tokens_generated += len(events)
        self.profile.add("update", time.perf_counter() - t1)
        return events

    # ------------------------------------------------------------------------------------------
    # Speculative decoding
    # ------------------------------------------------------------------------------------------
    def _propose(self) -> dict:
        """Drafts for every decoding sequence (n-gram on the host, or the draft model)."""
        # Rows whose plain sampling does more than the verifier reproduces (penalties, logit
        # bias, min_tokens blocking, logprob ranks) decode without drafts.
        states = [
            s
            for s in self.scheduler.decoding()
            if not uses_penalties(s.seq.params)
            and not s.seq.params.logit_bias
            and s.seq.params.logprobs is None
            and len(s.seq.output_ids) >= s.seq.params.min_tokens
        ]
        self._logq = None
        if not states:
            return {}
        k = self.spec.num_tokens
        if self.drafter is None:
            return ngram_batch(states, k, self.spec)
        sa = SamplingArrays.build(
            [s.seq.params for s in states], np.stack([s.seq.key for s in states])
        )
        drafts, self._logq, self._logq_rows = self.drafter.propose(states, k, sa)
        return drafts

    def _after_verify(self, step, verified) -> None:
        for v, row in enumerate(step.verify):
            self.spec_stats.drafted += len(row.draft)
            self.spec_stats.accepted += int(verified[0][v])
            self.spec_stats.steps += 1
        if self.drafter is not None:
            running = {s.id: s for s in self.scheduler.running}
            for sid in list(self.drafter.bm.tables):
                if sid not in running:
                    self.drafter.release(sid)
                else:
                    self.drafter.rollback(sid, len(running[sid].tokens) - 1)

    # ------------------------------------------------------------------------------------------
    def _record_prompt_logprobs(self, step, info, md) -> None:
        from jaxgen.engine.outputs import Logprob

        for p, row in enumerate(step.prefill):
            if not wants_prompt_logprobs(row):
                continue
            request = row.state.request
            k = request.params.prompt_logprobs
            entries = request.prompt_logprobs or [None]
            base = md.num_decode + md.verify_rows * md.verify_len + p * md.prefill_len
            prompt_len = len(row.state.seq.prompt_ids)
            for i in range(row.start, min(row.end, prompt_len - 1)):
                j = base + i - row.start
                entry = {
                    int(t): Logprob(float(lp), r + 1)
                    for r, (t, lp) in enumerate(
                        zip(info.top_ids[j, :k], info.top_logprobs[j, :k], strict=True)
                    )
                }
                entry[int(info.tokens[j])] = Logprob(float(info.logprobs[j]), int(info.ranks[j]))
                entries.append(entry)
            request.prompt_logprobs = entries

    # ------------------------------------------------------------------------------------------
    def _account(self, step: ScheduledStep, elapsed: float, flight: Flight) -> None:
        """Per-step roofline numerators (bytes, FLOPs) for the live MBU / MFU in `stats()`; with
        `on_step` set, also the step's shape, handed to it (what a latency model is fitted to:
        `serve --step-log`). `elapsed`: from the later of its dispatch and the previous step's
        landing to its own landing, so back-to-back steps' records add up to the busy wall
        time."""
        self.num_steps += 1
        self.busy_time += elapsed
        rows = step.decode + step.verify + step.prefill
        context = sum(r.end for r in rows)
        pairs = sum((r.end - r.start) * (r.start + r.end + 1) // 2 for r in rows)
        cost = roofline.step_cost(
            self.cfg,
            self.weight_bytes,
            new_tokens=step.num_tokens,
            context_tokens=context,
            kv_itemsize=self.kv_itemsize,
            attended_pairs=pairs,
        )
        self.last_step = {
            "seconds": elapsed,
            "tokens": step.num_tokens,
            "decode_rows": len(step.decode),
            "prefill_rows": len(step.prefill),
            **cost,
        }
        if self.on_step is not None:  # the shape a latency model is fitted to, when one listens
            self.last_step.update(
                # decode rows' KV tokens read, and each prefill chunk as (tokens, cached before)
                decode_context=sum(r.end for r in step.decode),
                chunks=[(r.end - r.start, r.start) for r in step.prefill],
                # what decides the step's program (`planner.Padding.program`): each decode
                # row's tokens once this step's is written, each prefill row's prompt length
                decode_lens=[r.end for r in step.decode],
                prompt_lens=[len(r.state.seq.prompt_ids) for r in step.prefill],
                compiled=flight.compiled,
                covered=flight.covered,  # `shape` is the larger program's it ran on
                compiling=flight.compiling,  # background compiles sharing the host meanwhile
                deferred=flight.deferred,  # prefill rows left to the next step (frozen)
                **(flight.host or {}),  # `HostClock.since`: CPU, GC, traces and compiles
            )
            shape = flight.shape
            if shape is not None:  # what the program computed: the rows padded to buckets
                self.last_step["shape"] = shape_record(shape)
            self.on_step(self.last_step)

    def stats(self, limits: dict | None = None) -> dict:
        """Engine-wide counters, plus the last step's achieved bandwidth and FLOP rate as
        fractions of the machine's roofline (`limits`: read_gbps and peak GFLOP/s)."""
        out = self.scheduler.stats()
        if self.spec is not None:
            out["speculative"] = {
                "method": self.spec.method,
                "num_tokens": self.spec.num_tokens,
                **self.spec_stats.to_dict(),
            }
        if self.adapters is not None:
            out.update(self.adapters.stats())
        if self.kv_store is not None:
            out["kv_tiers"] = self.kv_store.stats()
        out.update(
            steps=self.num_steps,
            programs=len(self._note_program.keys),  # step programs compiled or loaded
            overlapped_steps=self.overlapped_steps,
            covered_steps=self.covered_steps,
            deferred_prefills=self.deferred_prefills,
            tokens_generated=self.tokens_generated,
            peak_pages_used=self.peak_pages_used,
            tokens_per_s=self.tokens_generated / self.busy_time if self.busy_time else 0.0,
            kv_cache_bytes=0 if self.kv is None else self.kv.nbytes,  # None asleep
            weights_version=self.weights_version,
            paused=self.paused,
            sleep_level=self.sleep_level,
        )
        last = self.last_step
        if last:
            gbps = last["bytes"] / last["seconds"] / 1e9
            gflops = last["flops"] / last["seconds"] / 1e9
            out.update(step_gbps=gbps, step_gflops=gflops)
            if limits:
                peak = limits["bf16_gflops"] if self.dtype == jnp.bfloat16 else limits["f32_gflops"]
                out.update(mbu=gbps / limits["read_gbps"], mfu=gflops / peak)
        return out
