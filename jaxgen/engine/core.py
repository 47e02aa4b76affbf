"""LLMEngine: the continuous-batching engine, assembled from rooms of its own. Here: its parts
built from the options (block manager and KV pool, KV tiers, scheduler, drafter, LoRA slots,
model runner) and the request API (`add_request`, `abort`, `has_work`, `stats`). `LLM` and the
server drive it through `add_request` / `step`.

  engine/loop.py                 the step loop: schedule -> dispatch -> land, overlapped
  engine/runner/model_runner.py  pack, dispatch and read back one step (cache in, cache out)
  engine/runner/programs.py      the compiled step programs: the ladder, warm-up, page copies
  engine/kv_tiers.py             the KV tiers below the pool, and page moves between steps
  engine/controls.py             a training loop's controls: new weights, pause, sleep
  engine/metrics.py              step records, the host clock, compile counting
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxgen.cache.block_manager import BlockManager, page_hashes
from jaxgen.cache.mla import PagedMLACache
from jaxgen.cache.paged import PagedKVCache
from jaxgen.engine import kv_tiers, roofline
from jaxgen.engine.config import EngineConfig, JaxgenConfig, check_engine_features
from jaxgen.engine.controls import EngineControls
from jaxgen.engine.loop import StepLoop
from jaxgen.engine.lora import AdapterSlots
from jaxgen.engine.runner import aot
from jaxgen.engine.runner.model_runner import ModelRunner
from jaxgen.engine.sched.scheduler import Scheduler
from jaxgen.engine.spec_decode.drafters import create_drafter
from jaxgen.engine.spec_decode.speculative import SpecStats
from jaxgen.errors import (
    CapacityError,
    EnginePaused,
    InvalidSamplingParams,
    JaxgenError,
)

log = logging.getLogger("jaxgen.engine")


class LLMEngine(StepLoop, EngineControls):
    """Paged KV cache + block manager + scheduler + the jitted packed step.

    Args:
      cfg, params: the model's config and weights (their dtype is the engine's).
      config: every engine option (`engine.config.JaxgenConfig`), validated here against the
        model and the placement before any device work.
      placement: the mesh placement (`sharding.placement.Placement`; None: one device).
      note_program: the `aot.ProgramLog` the engine records its compiled programs in.
      executable_dir: where compiled step programs are saved and loaded (None: nowhere).
    """

    def __init__(
        self,
        cfg,
        params,
        config: JaxgenConfig,
        *,
        placement=None,
        note_program=None,
        executable_dir: str | None = None,
    ):
        self.cfg, self.params, self.config = cfg, params, config
        self.engine_cfg = engine_cfg = EngineConfig.of(config, cfg)
        self.dtype = jnp.dtype(params["embed"].dtype)
        self.attn_impl = config.load.attn_impl
        self.placement = placement
        # A mesh with stages runs every step as microbatches pipelined over them.
        self.pipeline = None if placement is None else placement.pipeline
        config.validate(cfg)
        check_engine_features(config, cfg, pipeline=self.pipeline is not None)
        self.spec = config.speculative
        self.spec_stats = SpecStats()
        self._note_program = note_program or aot.ProgramLog()
        self.adapters = self._adapter_slots(config.lora) if config.lora.enable_lora else None
        pool, num_pages = self._pool_size()
        self.drafter = None
        if self.spec is not None and self.spec.method != "ngram":
            self.drafter = create_drafter(
                self.spec,
                cfg,
                params,
                engine_cfg,
                dtype=self.dtype,
                page_size=config.cache.page_size,
                num_pages=num_pages,
                placement=placement,
            )
        self._logq = self._logq_rows = None  # the draft model's last proposals
        # The pool is allocated once the drafter is built: a drafter that cannot be built
        # fails before the pool (most of the device's memory) exists.
        self._init_pool(pool, num_pages)
        self._init_blocks(num_pages)
        self.weight_bytes = roofline.param_bytes(params)
        self.runner = ModelRunner(
            cfg,
            config,
            engine_cfg,
            self.bm,
            self._note_program,
            placement=placement,
            drafter=self.drafter,
            adapters=self.adapters,
            executable_dir=executable_dir,
        )
        self.flat, self.profile = self.runner.flat, self.runner.profile
        self.packer, self.programs = self.runner.packer, self.runner.programs
        self._init_loop()
        self._init_controls()

    def _pool_size(self) -> tuple[type, int]:
        """The device page pool's class and page count (the budget's unless the count is
        given)."""
        cache, cfg = self.config.cache, self.cfg
        # MLA models keep one latent entry per token (cache.PagedMLACache), read through block
        # tables by model.mla.ragged_mla_attention.
        pool = PagedMLACache if cfg.mla is not None else PagedKVCache
        num_pages = cache.num_kv_pages
        if num_pages is None:
            budget = cache.kv_cache_bytes or roofline.default_kv_budget(
                roofline.param_bytes(self.params)
            )
            num_pages = pool.pages_for_budget(
                cfg, budget, cache.page_size, self.dtype, **self._quant(pool)
            )
        if num_pages < 1:
            raise CapacityError(f"the KV cache budget holds no page of {cache.page_size} tokens")
        return pool, num_pages

    def _quant(self, pool) -> dict:
        return {} if pool is PagedMLACache else {"kv_quant": self.config.cache.kv_cache_dtype}

    def _init_pool(self, pool, num_pages: int) -> None:
        """The device page pool (`self.kv`), placed on the mesh if there is one."""
        kv_quant = self.config.cache.kv_cache_dtype
        self.kv = pool.init(
            self.cfg, num_pages, self.config.cache.page_size, self.dtype, **self._quant(pool)
        )
        self.kv_itemsize = 1 if kv_quant else self.dtype.itemsize
        if self.placement is not None:
            self.kv = self.placement.cache(self.kv)

    def _init_blocks(self, num_pages: int) -> None:
        """The KV tiers below the pool, the block manager over the pool and the scheduler."""
        config, cache, sched = self.config, self.config.cache, self.config.scheduler
        invariant = sched.batch_invariant
        # Cached pages were computed at other offsets or by decode steps: not reused.
        prefix_caching = cache.enable_prefix_caching and not invariant
        tiers_need = None
        if self.cfg.mla is not None or self.pipeline is not None or not prefix_caching:
            tiers_need = "prefix caching on a non-MLA model without pipeline stages"
        elif self.placement is not None and self.placement.mesh.size > 1:
            tiers_need = "one device for now: drop mesh="
        self.kv_store, self.kv_transfer = kv_tiers.build(
            config.tiers, self.cfg, self.params, self.dtype, cache.kv_cache_dtype,
            cache.page_size, tiers_need,
        )  # fmt: skip
        self.bm = BlockManager(
            num_pages, cache.page_size, prefix_caching, cache.share_on_fork, store=self.kv_store,
            eviction_policy=cache.kv_eviction_policy,
        )  # fmt: skip
        if config.tiers.kv_write_through:
            if self.kv_store is None:
                raise JaxgenError(
                    "kv_write_through writes finished prompts' pages to a KV tier: give one "
                    "(kv_transfer=, kv_mooncake=, kv_host_cache_bytes= or kv_disk_cache_dir=)"
                )
            self.bm.write_through = True
        chunk = sched.invariant_chunk
        self.scheduler = Scheduler(
            self.bm,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            token_bucket=self.engine_cfg.token_bucket,
            adapters=self.adapters,
            max_prefill_rows=sched.max_num_batched_tokens // chunk if invariant else None,
            fixed_chunk=chunk if invariant else None,
        )
        prefetch = config.tiers.kv_prefetch
        if prefetch is None:  # on the CPU the reads would compete with the steps' cores
            prefetch = jax.default_backend() != "cpu"
        self.scheduler.prefetch_tiers = bool(prefetch)

    @property
    def last_inputs(self):
        """(shape, StepBatch, SamplingArrays) of the last one-device step (`ModelRunner`)."""
        return self.runner.last_inputs

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
        self.programs.close()
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
            self.kv = kv_tiers.move_pages(self.bm, self.kv_store, self.kv)
        return n

    def _adapter_slots(self, lora) -> AdapterSlots:
        """The LoRA adapter stack of this engine, replicated over its mesh if it has one."""
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
    def precompile(self, buckets, num_stop_ids: int, directory: str | None = None) -> list[dict]:
        """Compiles (or loads from `directory`) the step programs before serving: a ragged
        engine its whole ladder, a row-shaped one the declared buckets' (`StepPrograms`)."""
        return self.programs.precompile(self._arrays(), buckets, num_stop_ids, directory)

    def wait_for_compiles(self) -> None:
        """Returns once every background compile has finished, its program in use."""
        self.programs.collect(wait=True)

    def _arrays(self) -> tuple:
        """What every step program takes besides its batch: (params, kv, LoRA weights)."""
        return self.params, self.kv, self.lora_weights

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

    def program_shapes(self) -> list[dict]:
        """The compiled plain step programs, each as the step log records a step's `shape`."""
        return self.programs.shapes()

    def freeze_programs(self, frozen: bool = True) -> int:
        """Stops (or, `frozen=False`, resumes) compiling step programs for new shapes: once a
        warm-up has compiled the shapes a load makes, a step whose own program has not compiled
        runs on the least-work compiled program that covers it (padding), as a CUDA-graph
        engine pads a batch to a captured size; a step that nothing compiled covers leaves its
        last prefill rows to the next step until one does (`_defer_prefills`), and only a step
        that still has none compiles (inline). Background compiles under way finish. A ragged
        engine has nothing to cover with: freezing compiles what its ladder still lacks (one
        started without warm-up). Returns the programs compiled."""
        return self.programs.freeze(frozen, self._arrays())

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
            # step programs compiled or loaded (a ragged step's page copies apart)
            programs=sum(key[0] != "copy_pages" for key in self._note_program.keys),
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
