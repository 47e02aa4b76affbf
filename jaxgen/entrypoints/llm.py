"""`LLM`: the user-facing entry point, with vLLM's names.

    llm = LLM()                                        # embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].outputs[0].text

Every request is validated on the host before any device work; a bad request raises a typed
`jaxgen.errors` exception and leaves the engine usable.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxgen.engine import roofline
from jaxgen.engine.config import EngineConfig, check_cover_factor
from jaxgen.engine.core import LLMEngine
from jaxgen.engine.lora import LoRAConfig, LoRARegistry
from jaxgen.engine.outputs import RequestOutput
from jaxgen.engine.params import SamplingParams
from jaxgen.engine.processor import Processor
from jaxgen.engine.replicas import EngineReplicas
from jaxgen.engine.request import Request
from jaxgen.engine.runner import aot
from jaxgen.engine.sched.beam import BeamController, BeamSearchOutput
from jaxgen.engine.sched.sequence import Sequence
from jaxgen.engine.static import StaticBatchEngine
from jaxgen.entrypoints import weights
from jaxgen.errors import (
    EnginePaused,
    EngineSleeping,
    InvalidSamplingParams,
    JaxgenError,
    LoRAError,
    LoRANotLoaded,
)
from jaxgen.model import load_model, load_tokenizer
from jaxgen.model.loading import cache_dir, resolve_source

log = logging.getLogger("jaxgen.engine")


def live_device_bytes() -> int:
    """Bytes of every live JAX array on its devices (each shard counted where it lives)."""
    total = 0
    for a in jax.live_arrays():
        shard = a.sharding.shard_shape(a.shape)
        total += math.prod(shard) * a.dtype.itemsize * len(a.sharding.device_set)
    return total


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turns on JAX's persistent compilation cache (default: <jaxgen cache>/xla).

    This sets `jax.config` for the whole process, so it happens only where the user asks:
    `LLM(compilation_cache=True)` or the `jaxgen` command line (which owns its process)."""
    directory = directory or os.path.join(cache_dir(), "xla")
    os.makedirs(directory, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


class LLM:
    """An offline inference engine over one model.

    Args:
      model: HF directory, ``.gguf`` file or jaxgen checkpoint; None = the embedded default.
      dtype: "float32" (CPU default) or "bfloat16" / "float16" (GPU).
      quantization: None, or "int8" / "int4" / "nf4" / "fp8" RTN weights made on load
        (per-channel for 8-bit, group 128 for int4 and 64 for nf4 unless
        `quantization_group_size`). A checkpoint from `jaxgen quantize` loads as is.
      max_model_len: longest prompt + output (default: the model's, at most 8192).
      max_num_seqs: sequences decoded together in one batch.
      seed: seeds the draws of requests that give no `seed` of their own.
      kv_cache: "paged" (continuous batching over a page pool, prefix caching, n > 1 by
        copy-on-write) or "contiguous" (static batches over one slab per sequence).
      page_size, kv_cache_bytes, num_kv_pages, kv_cache_dtype: the page pool (tokens per page,
        memory budget or explicit page count, None / "int8" / "fp8" pages).
      max_num_batched_tokens: token budget of one continuous-batching step.
      kv_host_cache_bytes, kv_disk_cache_dir, kv_disk_cache_bytes: KV cache tiers below the
        device pool (`cache.tiers`; LMCache's local CPU / local disk backends): cached prefix
        pages evicted from the pool are kept in host RAM (LRU, at most kv_host_cache_bytes)
        and/or as files in kv_disk_cache_dir (found again by a later engine on the same model),
        and a prompt's prefix found there is loaded instead of recomputed. None: off.
      kv_mooncake: a shared KV tier in a Mooncake Store (`cache.mooncake`; the `mooncake`
        extra): Mooncake's client configuration as a dict or the path of its JSON file
        (master_server_address, metadata_server, local_hostname, global_segment_size, ...).
        Every engine pointed at the same master finds the prefixes the others wrote; a store
        that is down or returns a bad block makes the engine recompute, with a warning.
      kv_transfer, kv_transfer_bytes: KV pages moved between engines by Mooncake's transfer
        engine (`cache.transfer`; the `mooncake` extra): the config (a dict or Mooncake's JSON
        file: metadata_server, local_hostname, protocol) and the bytes of host memory this
        engine registers for pages others read (`kv_export`) and it reads (`kv_import`): a
        disaggregated prefill / decode pair (`jaxgen serve --role prefill|decode
        --kv-transfer`) without a store between them.
      kv_write_through: a finished request's full pages are written down the tiers at once,
        before its output is handed back (a disaggregated prefill instance: `jaxgen serve
        --role prefill`), instead of when the pool evicts them.
      kv_prefetch: read prefixes found in the disk / shared tiers on a background thread
        while other requests' steps run (the request waits in the queue meanwhile), instead
        of at admission inside a step. None (default): on GPU/TPU backends; off on the CPU
        backend, where the reads and the "device" share the same cores (measured in
        `jaxgen bench kvstore`).
      kv_eviction_policy: which cached page the device pool displaces (and writes down the
        tiers) when it needs one: "lru" (default) or "lfu" (reused least often, least recent
        among equals).
      overlap: the paged engine dispatches each step before the previous one's tokens are
        read back, so the host's scheduling, packing and detokenizing overlap the device's
        work (identical tokens; steps with beam search, penalties, speculative decoding or a
        pp mesh run synchronously). False: every step is dispatched, then read back.
      mesh: e.g. "tp=4" or "dp=2,tp=2,pp=2" (see `sharding.mesh`). Every mesh runs the
        paged continuous-batching engine; with pipeline stages (pp) each step is cut into
        `pipeline_microbatches` microbatches of disjoint sequences (default: one per stage)
        that are in flight across the stages at once (GPipe). Speculative decoding does not
        run with pp yet.
      pipeline_microbatches: see `mesh`; with kv_cache="contiguous", the static batch is cut
        into this many microbatches.
      speculative: e.g. {"method": "ngram" | "draft" | "self", "num_tokens": k, ...} (see
        `engine.spec_decode.speculative.SpeculativeConfig`).
      compilation_cache: turn on JAX's persistent compilation cache for the process (True: in
        the jaxgen cache dir; or a directory), so shapes that were not declared in
        `compile_buckets` load from disk on later starts. Off by default: it changes
        `jax.config` process-wide. Declared buckets need it not (`executable_cache`). Not used
        with a device mesh on the CPU (XLA:CPU has aborted serializing multi-device programs).
      warmup: compile the programs of `compile_buckets` now (ahead of time), so the first
        request of those shapes starts at once and start-up is measured (`LLM.startup`).
      compile_buckets: the declared step shapes, e.g. ["prefill:128", "decode:8@1024"] (see
        `engine.runner.aot`); default `engine.runner.aot.DEFAULT_BUCKETS`. The static-batch
        (contiguous) and mesh engines warm up by generating two tokens instead.
      executable_cache: serialize the step programs into the jaxgen cache as they compile (at
        warm-up, or on first use without it) and load them on later starts (no tracing,
        lowering or compiling).
      enable_lora: serve PEFT LoRA adapters on this base model (`load_lora`, then
        `generate(..., lora_request=name)`), with `max_loras` adapters mixed per step at most
        (a device slot each; others wait or are swapped in), each of rank <= `max_lora_rank`
        over `lora_target_modules` (None: every projection). See `engine.lora`.
      batch_invariant: each request's tokens and logprobs are bitwise the same whatever other
        requests share its steps (decode and prefill steps each run at one fixed shape, prompts
        are chunked alone, no prefix caching; see `EngineConfig.batch_invariant`). Paged
        engine on one device, without speculative decoding. A preempted sequence recomputes
        its generated tokens as a prefill, which can change its later tokens.
      cover_new_shapes: a step whose program has not compiled yet runs on a compiled one that
        covers it (padded further) when that costs at most this many times its own work, so a
        serving engine does not stall to compile (`EngineConfig.cover_new_shapes`); 0: off.
      compile_in_background: a step that no compiled program covers within
        `cover_new_shapes` runs on one that covers it with more padding while its own
        program compiles on a background thread; only a step nothing covers stalls to
        compile (`EngineConfig.compile_in_background`). Paged engine on one device.
      ragged_step: every step on one flat token axis, the whole program ladder compiled at
        start-up (`EngineConfig.ragged_step`); False: the older step shaped by its rows.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        seed: int | None = None,
        decode_steps: int = 32,
        overlap: bool = True,
        quantization: str | None = None,
        quantization_group_size: int | None = None,
        kv_cache: str = "paged",
        page_size: int = 16,
        kv_cache_bytes: int | None = None,
        num_kv_pages: int | None = None,
        kv_cache_dtype: str | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 512,
        attn_impl: str | None = None,
        mesh: str | None = None,
        pipeline_microbatches: int | None = None,
        speculative: dict | None = None,
        compilation_cache: bool | str = False,
        warmup: bool = True,
        compile_buckets=None,
        executable_cache: bool = True,
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        lora_target_modules=None,
        batch_invariant: bool = False,
        cover_new_shapes: float = 0.0,
        compile_in_background: bool = False,
        ragged_step: bool = True,
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
        if kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache must be 'paged' or 'contiguous', got {kv_cache!r}")
        if compile_buckets is not None:
            aot.parse_buckets(compile_buckets)  # a bad spec fails before the model loads
        check_cover_factor(cover_new_shapes)
        t0 = time.perf_counter()
        if compilation_cache:
            if mesh is not None and jax.default_backend() == "cpu":
                log.warning("JAX's persistent compilation cache is not used with a CPU mesh")
            else:
                enable_compilation_cache(None if compilation_cache is True else compilation_cache)
        path = resolve_source(model)  # converts the default model on first use
        # The tokenizer builds in a thread while the weights restore (~0.7 s of start-up).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, path)
            cfg, params = load_model(path, dtype=dtype)
            tokenizer = tokenizer.result()
        # What `update_weights` takes: load_model's layout, quantized here like these weights.
        self._weights_layout = weights.layout(params)
        self._quantization = (
            None if quantization is None else (quantization, quantization_group_size)
        )
        if quantization is not None:
            from jaxgen.model.quantize import on_the_fly

            params = on_the_fly(params, quantization, quantization_group_size)
        self._setup(
            cfg,
            params,
            tokenizer,
            t0,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            decode_steps=decode_steps,
            overlap=overlap,
            kv_cache=kv_cache,
            page_size=page_size,
            kv_cache_bytes=kv_cache_bytes,
            num_kv_pages=num_kv_pages,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            attn_impl=attn_impl,
            mesh=mesh,
            pipeline_microbatches=pipeline_microbatches,
            speculative=speculative,
            warmup=warmup,
            compile_buckets=compile_buckets,
            executable_cache=executable_cache,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            lora_target_modules=lora_target_modules,
            batch_invariant=batch_invariant,
            cover_new_shapes=cover_new_shapes,
            compile_in_background=compile_in_background,
            ragged_step=ragged_step,
            kv_host_cache_bytes=kv_host_cache_bytes,
            kv_disk_cache_dir=kv_disk_cache_dir,
            kv_disk_cache_bytes=kv_disk_cache_bytes,
            kv_mooncake=kv_mooncake,
            kv_write_through=kv_write_through,
            kv_prefetch=kv_prefetch,
            kv_eviction_policy=kv_eviction_policy,
            kv_transfer=kv_transfer,
            kv_transfer_bytes=kv_transfer_bytes,
        )

    @classmethod
    def from_parts(cls, cfg, params, tokenizer, **kwargs) -> LLM:
        """An engine over an already-built model (e.g. a tiny random one in a notebook or test).

        kwargs: the engine options of `LLM(...)` (not model/dtype/compilation_cache)."""
        llm = cls.__new__(cls)
        llm._weights_layout, llm._quantization = weights.layout(params), None
        kwargs.setdefault("kv_cache", "paged")
        if kwargs["kv_cache"] not in ("paged", "contiguous"):
            raise ValueError(
                f"kv_cache must be 'paged' or 'contiguous', got {kwargs['kv_cache']!r}"
            )
        llm._setup(cfg, params, tokenizer, time.perf_counter(), **kwargs)
        return llm

    def _setup(
        self,
        cfg,
        params,
        tokenizer,
        t0,
        *,
        max_model_len=None,
        max_num_seqs=32,
        seed=None,
        decode_steps=32,
        overlap=True,
        kv_cache="paged",
        page_size=16,
        kv_cache_bytes=None,
        num_kv_pages=None,
        kv_cache_dtype=None,
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        attn_impl=None,
        mesh=None,
        pipeline_microbatches=None,
        speculative=None,
        warmup=True,
        compile_buckets=None,
        executable_cache=False,
        enable_lora=False,
        max_loras=4,
        max_lora_rank=16,
        lora_target_modules=None,
        batch_invariant=False,
        cover_new_shapes=0.0,
        compile_in_background=False,
        ragged_step=True,
        kv_host_cache_bytes=None,
        kv_disk_cache_dir=None,
        kv_disk_cache_bytes=None,
        kv_mooncake=None,
        kv_write_through: bool = False,
        kv_prefetch: bool | None = None,
        kv_eviction_policy: str = "lru",
        kv_transfer=None,
        kv_transfer_bytes: int = 256 << 20,
    ):
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        tiers = (kv_host_cache_bytes, kv_disk_cache_dir, kv_disk_cache_bytes, kv_mooncake,
                 kv_transfer)  # fmt: skip
        if kv_cache != "paged" and any(t is not None for t in tiers):
            raise JaxgenError(
                "KV cache tiers (kv_host_cache_bytes, kv_disk_cache_dir, kv_mooncake, kv_transfer) "
                "need "
                "kv_cache='paged'"
            )
        self.placement = None
        self._static_replicas = [(None, params)]
        if mesh is not None:
            from jaxgen.sharding.placement import Placement

            self.placement = Placement.from_spec(cfg, mesh, pipeline_microbatches)
        self.dtype = jnp.dtype(self.params["embed"].dtype)
        limit = self.cfg.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} positions")
        self.engine_cfg = EngineConfig(
            max_model_len=max_model_len or min(limit, 8192),
            max_num_seqs=max_num_seqs,
            decode_steps=decode_steps,
            overlap=overlap,
            batch_invariant=batch_invariant,
            cover_new_shapes=cover_new_shapes,
            compile_in_background=compile_in_background,
            ragged_step=ragged_step,
        )
        if batch_invariant and (kv_cache != "paged" or mesh is not None):
            raise ValueError(
                "batch_invariant=True runs in the paged engine on one device: use "
                "kv_cache='paged' and no mesh"
            )
        if compile_in_background and (kv_cache != "paged" or mesh is not None):
            raise ValueError(
                "compile_in_background=True compiles the paged engine's one-device step "
                "programs: use kv_cache='paged' and no mesh"
            )
        self.attn_impl = attn_impl
        eos_ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        lora = None
        self.loras = None  # the loaded LoRA adapters (enable_lora)
        if enable_lora:
            if kv_cache != "paged":
                raise LoRAError("LoRA adapters run in the paged engine: use kv_cache='paged'")
            lora = LoRAConfig(max_loras, max_lora_rank, lora_target_modules)
            self.loras = LoRARegistry(cfg, lora)
        # Every request is built and validated there, once (the server and batch jobs too).
        self.processor = Processor(
            tokenizer, cfg.vocab_size, self.engine_cfg.max_model_len, eos_ids, seed, self.loras
        )
        # The engine keeps the log (not `self`: a cycle LLM -> engine -> LLM would hold the KV
        # pool, 1 GiB by default, until Python's next full collection).
        self._note_program = aot.ProgramLog()
        self.compiled: set[tuple] = self._note_program.keys
        self.kv_cache = kv_cache
        self.engine = None
        engine_kwargs = dict(
            dtype=self.dtype,
            page_size=page_size,
            num_pages=num_kv_pages,
            kv_cache_bytes=kv_cache_bytes,
            kv_quant=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            attn_impl=attn_impl,
            note_program=self._note_program,
            executable_dir=os.path.join(cache_dir(), "executables") if executable_cache else None,
            speculative=speculative,
            lora=lora,
            kv_host_cache_bytes=kv_host_cache_bytes,
            kv_disk_cache_dir=kv_disk_cache_dir,
            kv_disk_cache_bytes=kv_disk_cache_bytes,
            kv_mooncake=kv_mooncake,
            kv_write_through=kv_write_through,
            kv_prefetch=kv_prefetch,
            kv_eviction_policy=kv_eviction_policy,
            kv_transfer=kv_transfer,
            kv_transfer_bytes=kv_transfer_bytes,
        )
        if speculative is not None and kv_cache != "paged":
            raise ValueError("speculative decoding runs in the paged engine (kv_cache='paged')")
        if (
            kv_cache == "paged"
            and self.placement is not None
            and self.placement.mesh.shape["data"] > 1
        ):
            # A packed continuous-batching step has no batch axis to split: data parallelism
            # is one engine per data index, each on its own sub-mesh.
            self.engine = EngineReplicas(
                [
                    LLMEngine(
                        self.cfg,
                        replica.params(self.params),
                        self.engine_cfg,
                        placement=replica,
                        **engine_kwargs,
                    )
                    for replica in self.placement.replicas()
                ]
            )
        else:
            if self.placement is not None:
                if (
                    kv_cache == "contiguous"
                    and self.placement.pipeline is not None
                    and (self.placement.mesh.shape["data"] > 1)
                ):
                    # Static batches alternate between data-parallel replicas: XLA cannot
                    # partition the decode's cache writes inside a pipeline stage over a data
                    # axis as well (see sharding.rules), so each replica has its own sub-mesh.
                    self._static_replicas = [
                        (r, r.params(self.params)) for r in self.placement.replicas()
                    ]
                else:
                    self.params = self.placement.params(self.params)
                    self._static_replicas = [(self.placement, self.params)]
            if kv_cache == "paged":
                self.engine = LLMEngine(
                    self.cfg,
                    self.params,
                    self.engine_cfg,
                    placement=self.placement,
                    **engine_kwargs,
                )
        # Where `update_weights` places new weights: each engine's shapes, dtypes, shardings.
        self._weights_spec = [weights.spec(e.params) for e in self._paged_engines()]
        self.static = None
        if self.engine is None:
            self.static = StaticBatchEngine(
                self.cfg,
                self.engine_cfg,
                self._static_replicas,
                dtype=self.dtype,
                attn_impl=attn_impl,
                note_program=self._note_program,
            )
        buckets = aot.parse_buckets(
            aot.DEFAULT_BUCKETS if compile_buckets is None else compile_buckets
        )
        self.startup = {"load_s": time.perf_counter() - t0}
        if warmup:
            t1 = time.perf_counter()
            if isinstance(self.engine, LLMEngine) and self.placement is None:
                self.startup["programs"] = self.engine.precompile(buckets, len(self.eos_ids))
            else:
                self.generate(
                    [[self.cfg.bos_token_id or 0]], SamplingParams(max_tokens=2, temperature=0)
                )
            self.startup["compile_s"] = time.perf_counter() - t1
        self.startup["ready_s"] = time.perf_counter() - t0
        log.info(
            "engine ready in %.1f s (loading %.1f s, compiling %.1f s)",
            self.startup["ready_s"],
            self.startup["load_s"],
            self.startup.get("compile_s", 0.0),
        )

    # ------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------
    def generate(
        self, prompts, sampling_params=None, *, use_tqdm: bool = False, lora_request=None
    ) -> list[RequestOutput]:
        """Generates for each prompt (str, list of token ids, or {"prompt"|"prompt_token_ids"}).

        `lora_request`: the LoRA adapter for every prompt, or a list of one per prompt: a name
        given to `load_lora`, an `engine.lora.LoRARequest` (loaded from its path on first use),
        or None for the base model (needs `LLM(enable_lora=True)`)."""
        requests = self.processor.make_requests(
            prompts, sampling_params, stream=False, lora_request=lora_request
        )
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="generating", unit="req")
        for _ in self._run(requests, self.engine_cfg.decode_steps):
            pass
        if bar is not None:
            bar.update(len(requests))
            bar.close()
        return [r.to_output() for r in requests]

    def chat(
        self,
        messages,
        sampling_params=None,
        *,
        add_generation_prompt=True,
        use_tqdm=False,
        lora_request=None,
    ):
        """Like `generate`, for one conversation (list of {"role", "content"}) or a list of them,
        formatted with the tokenizer's chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation, add_generation_prompt=True, **kwargs) -> dict:
        """A conversation as a prompt: {"prompt": text, "prompt_token_ids": ids}; extra keyword
        arguments (e.g. ``tools``) reach the chat template."""
        return self.processor.apply_chat_template(conversation, add_generation_prompt, **kwargs)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a sequence (the model's and the tokenizer's EOS)."""
        return self.processor.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.processor.eos_ids = frozenset(ids)

    def stream(
        self, prompt, sampling_params: SamplingParams | None = None, *, lora_request=None
    ) -> Iterator[str]:
        """Yields text deltas of one completion as they are generated (single decode steps).

        The deltas concatenate to the text `generate` returns for the same request."""
        params = sampling_params or SamplingParams()
        if params.num_samples != 1:
            raise InvalidSamplingParams("stream() produces one completion; use n=1 (or generate)")
        requests = self.processor.make_requests([prompt], params, lora_request=lora_request)
        for _seq, delta in self._run(requests, decode_steps=1):
            if delta:
                yield delta

    def beam_search(
        self,
        prompts,
        beam_width: int,
        max_tokens: int | list[int],
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        structured=None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, inside the continuous-batching scheduler: beams share
        pages through fork and are freed when pruned. `max_tokens`: for every prompt, or a list
        of one per prompt. `structured` (a `StructuredOutputs` or a dict of its fields): beams
        are extended only with tokens its grammar allows.

        Returns:
          one `BeamSearchOutput` per prompt with its `beam_width` best hypotheses, best first.
        """
        if self.engine is None:
            raise InvalidSamplingParams("beam_search needs the paged KV cache (kv_cache='paged')")
        if not isinstance(beam_width, int) or not 1 <= beam_width <= 10:
            raise InvalidSamplingParams(f"beam_width must be an int in [1, 10], got {beam_width!r}")
        if beam_width > self.engine_cfg.max_num_seqs:
            raise InvalidSamplingParams(
                f"beam_width={beam_width} exceeds max_num_seqs={self.engine_cfg.max_num_seqs}"
            )
        # One max_tokens per prompt: make_requests checks there is one per prompt.
        lengths = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else None
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                logprobs=2 * beam_width,
                ignore_eos=True,
                structured=structured,
            )
            for n in (lengths if lengths is not None else [max_tokens])
        ]
        requests = self.processor.make_requests(
            prompts, params if lengths is not None else params[0]
        )
        eos = frozenset() if ignore_eos else self.eos_ids
        for r in requests:
            r.beam = BeamController(beam_width, length_penalty, eos, r.params.max_tokens)
        for _ in self._run_engine(requests):
            pass
        outputs = []
        for r in requests:
            for h in r.beam.finished:
                h.text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True)
            outputs.append(BeamSearchOutput(list(r.prompt_ids), r.beam.finished))
        return outputs

    def generate_file(
        self, in_path: str, out_path: str, sampling_params: SamplingParams | None = None, **kwargs
    ) -> dict:
        """Runs (or resumes) a JSONL batch job; see `entrypoints.batch.run_batch`. Across the
        replicas of a Ray cluster: `entrypoints.ray_batch.run_ray_batch` (same lines, records
        and resume rules)."""
        from jaxgen.entrypoints.batch import run_batch

        return run_batch(self, in_path, out_path, sampling_params, **kwargs)

    def load_lora(self, name: str, path: str) -> None:
        """Loads the PEFT LoRA adapter in directory `path` (adapter_config.json and
        adapter_model.safetensors) under `name`, for requests to name in `lora_request`. It is
        read and checked now (LoRAError); its weights reach a device slot when a request needs
        them. Needs `LLM(enable_lora=True)`."""
        self._lora_registry().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forgets adapter `name` (LoRANotLoaded if it is not loaded); requests already
        running with it finish with it."""
        self._lora_registry().unload(name)

    def list_loras(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return [] if self.loras is None else self.loras.names

    def _lora_registry(self):
        if self.loras is None:
            raise LoRANotLoaded(
                "this engine serves no LoRA adapters: build it with LLM(enable_lora=True)"
            )
        return self.loras

    def reset_prefix_cache(self) -> int:
        """Forgets the paged engine's cached prompt prefixes (vLLM's `reset_prefix_cache`), e.g.
        between a benchmark's warm-up and its timed run. Returns the pages that were cached."""
        return 0 if self.engine is None else self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Lets go of what the engine holds outside this process (a shared KV store's
        connection, after writing the cached pages down its tiers). The LLM is not used after."""
        if self.engine is not None:
            self.engine.close()

    def stats(self) -> dict:
        """Engine-wide state: running/waiting, KV pages used/free/cached, prefix-cache hit rate,
        preemptions, tokens/s, and the last step's MBU / MFU against this machine's roofline."""
        if self.engine is None:
            return {"kv_cache": "contiguous", "compiled_programs": self.num_compilations}
        stats = self.engine.stats(roofline.machine_limits(quick=True))
        stats["compiled_programs"] = self.num_compilations
        return stats

    # ------------------------------------------------------------------------------------------
    # Generation inside a training loop: weights, pause, sleep
    # ------------------------------------------------------------------------------------------
    def update_weights(self, params) -> int:
        """Generates with `params` from now on: a pytree in the layout `load_model` returns
        (any float dtype, any sharding), placed like the engine's weights on its devices
        without a host round trip (leaves already of its dtype and sharding are taken as is:
        the engine then shares them, so do not donate them to a later jitted step; others are
        cast or resharded on the device; quantized to the engine's format when it runs
        quantized). No program recompiles. Cached prefixes of the older weights are never
        reused. Raises WeightsMismatch (before any device work) for another layout. Allowed
        while sleeping (level 2 needs it before `wake_up`). Returns the new weights version."""
        engines = self._paged_engines("update_weights")
        weights.check_layout(params, self._weights_layout)
        for e in engines:
            if e.drafter is not None and e.spec.method != "draft":
                raise JaxgenError(
                    f"update_weights with speculative method {e.spec.method!r} (drafting from "
                    "the model's own weights) is not supported: use 'ngram' or 'draft'"
                )
        if self._quantization is not None:
            from jaxgen.model.quantize import on_the_fly

            params = on_the_fly(params, *self._quantization)
        version = 0
        for engine, target in zip(engines, self._weights_spec, strict=True):
            version = engine.replace_params(weights.place_like(params, target))
        self.params = engines[0].params
        return version

    def get_weights(self):
        """The engine's current weights (its pytree, on its devices; None asleep at level 2)."""
        return self._paged_engines("get_weights")[0].params

    @property
    def weights_version(self) -> int:
        """0 for the weights loaded, then one more per `update_weights`."""
        return self._paged_engines("weights_version")[0].weights_version

    def pause(self, mode: str = "finish") -> list[str]:
        """Stops admitting requests until `resume`: "finish" lets running requests finish,
        "abort" aborts them all (finish reason "abort") and refuses new ones (EnginePaused),
        "keep" runs no step and keeps them (their K/V recomputed on `resume` if the weights
        changed). Returns the ids of the requests aborted. A server queues requests meanwhile;
        `generate` on a paused engine raises EnginePaused (it would wait forever)."""
        return [i for e in self._paged_engines("pause") for i in e.pause(mode)]

    def resume(self) -> None:
        """Carries on after `pause`."""
        for e in self._paged_engines("resume"):
            e.resume()

    def sleep(self, level: int = 1) -> dict:
        """Frees the KV page pool's device memory (level 2: the weights too, as far as this
        engine holds them), keeping the compiled programs; `wake_up` re-allocates without
        compiling. Needs no request running (`pause` first). Returns the live device bytes
        before and after, from JAX's own accounting (`jax.live_arrays`)."""
        engines = self._paged_engines("sleep")
        before = live_device_bytes()
        for e in engines:
            e.sleep(level)
        if level == 2:
            self.params = self._static_replicas = None
        return {
            "level": level,
            "device_bytes_before": before,
            "device_bytes_after": live_device_bytes(),
        }

    def wake_up(self) -> dict:
        """Re-allocates what `sleep` freed (after level 2, the weights of `update_weights`).
        Returns the live device bytes before and after."""
        before = live_device_bytes()
        for e in self._paged_engines("wake_up"):
            e.wake_up()
        return {"device_bytes_before": before, "device_bytes_after": live_device_bytes()}

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 or 2: the level of `sleep`."""
        return self._paged_engines("sleep_level")[0].sleep_level

    def _paged_engines(self, what: str | None = None) -> list[LLMEngine]:
        if self.engine is None:
            if what is None:
                return []
            raise JaxgenError(f"{what} needs the paged engine (kv_cache='paged')")
        return self.engine.engines if isinstance(self.engine, EngineReplicas) else [self.engine]

    @property
    def num_compilations(self) -> int:
        """Distinct compiled device programs used so far (bounded by the bucket lists)."""
        return len(self.compiled)

    # ------------------------------------------------------------------------------------------
    # Execution: the paged engine, or static batches over the contiguous cache
    # ------------------------------------------------------------------------------------------
    def _run(self, requests: list[Request], decode_steps: int) -> Iterator[tuple[Sequence, str]]:
        if self.engine is not None:
            yield from self._run_engine(requests)
            return
        yield from self.static.run(requests, decode_steps)

    def _run_engine(self, requests: list[Request]) -> Iterator[tuple[Sequence, str]]:
        """Continuous batching: all requests go through the scheduler together."""
        for e in self._paged_engines():
            if e.sleep_level:
                raise EngineSleeping("the engine sleeps: wake_up() before generating")
            if e.paused:
                raise EnginePaused(f"the engine is paused (mode={e.paused!r}): resume() first")
            leaves = jax.tree.leaves(e.params)  # host (numpy) leaves cannot be deleted
            if any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
                raise JaxgenError(
                    "the engine's weights were deleted (donated to a jitted step after "
                    "update_weights shared them?): update_weights(params) with live arrays"
                )
        self.engine.add_requests(requests)  # all fit, or none is queued
        try:
            while not all(r.finished for r in requests):
                yield from self.engine.step()
        finally:  # an abandoned stream must not leave its pages behind
            for r in requests:
                if not r.finished:
                    self.engine.abort(r.request_id)
