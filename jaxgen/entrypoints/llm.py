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
from jaxgen.engine.config import EngineConfig, JaxgenConfig
from jaxgen.engine.core import LLMEngine
from jaxgen.engine.lora import LoRARegistry
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
      config: every engine option as one `engine.config.JaxgenConfig` (default: the defaults).
      options: any option by its field name, over `config`: `max_num_seqs=8`,
        `kv_cache_dtype="int8"`, `mesh="tp=2"`, `enable_lora=True`, `speculative={"method":
        "ngram", "num_tokens": 4}`, ... Each field, its default and what it does are listed once,
        in `jaxgen.engine.config` (`LoadConfig`, `CacheConfig`, `TierConfig`, `SchedulerConfig`,
        `CompileConfig`, `ParallelConfig`, `LoRAConfig`, `SpeculativeConfig`); `jaxgen generate
        --help` shows the same as flags. An unknown name is a TypeError naming the closest.

    Every option is checked, and which options combine, before the model loads.
    `compilation_cache` (JAX's persistent compilation cache) is off unless asked for: it sets
    `jax.config` for the whole process.
    """

    def __init__(self, model: str | None = None, *, config: JaxgenConfig | None = None, **options):
        if model is not None:
            options["model"] = model
        config = JaxgenConfig.from_options(config, **options)
        config.validate()  # before the model loads
        t0 = time.perf_counter()
        load, cache_option = config.load, config.compile.compilation_cache
        if cache_option:
            if config.parallel.mesh is not None and jax.default_backend() == "cpu":
                log.warning("JAX's persistent compilation cache is not used with a CPU mesh")
            else:
                enable_compilation_cache(None if cache_option is True else cache_option)
        path = resolve_source(load.model)  # converts the default model on first use
        # The tokenizer builds in a thread while the weights restore (~0.7 s of start-up).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, path)
            cfg, params = load_model(path, dtype=load.dtype)
            tokenizer = tokenizer.result()
        # What `update_weights` takes: load_model's layout, quantized here like these weights.
        self._weights_layout = weights.layout(params)
        self._quantization = None
        if load.quantization is not None:
            from jaxgen.model.quantize import on_the_fly

            self._quantization = (load.quantization, load.quantization_group_size)
            params = on_the_fly(params, *self._quantization)
        self._setup(cfg, params, tokenizer, t0, config)

    @classmethod
    def from_parts(
        cls, cfg, params, tokenizer, *, config: JaxgenConfig | None = None, **options
    ) -> LLM:
        """An engine over an already-built model (e.g. a tiny random one in a notebook or test).

        `config` / `options`: as `LLM(...)`'s, but what loads a model (model, dtype,
        quantization, compilation_cache) does not apply. Without `config` the executable cache
        is off unless asked for (a throwaway model's programs are not worth keeping); a
        `config` says for itself."""
        built = ("model", "dtype", "quantization", "quantization_group_size", "compilation_cache")
        given = sorted(set(built) & set(options))
        if given:
            raise TypeError(
                f"LLM.from_parts takes a model already built: {', '.join(given)} do not apply"
            )
        if config is None:
            options.setdefault("executable_cache", False)
        llm = cls.__new__(cls)
        llm._weights_layout, llm._quantization = weights.layout(params), None
        config = JaxgenConfig.from_options(config, **options)
        llm._setup(cfg, params, tokenizer, time.perf_counter(), config)
        return llm

    def _setup(self, cfg, params, tokenizer, t0: float, config: JaxgenConfig) -> None:
        """The engine over a loaded model: its request processor, its paged engine (or one per
        data-parallel replica) or static-batch engine, compiled before it returns (`warmup`)."""
        self.cfg, self.params, self.tokenizer, self.config = cfg, params, tokenizer, config
        config.validate(cfg)
        self.engine_cfg = EngineConfig.of(config, cfg)
        self.placement = None
        if config.parallel.mesh is not None:
            from jaxgen.sharding.placement import Placement

            mesh, microbatches = config.parallel.mesh, config.parallel.pipeline_microbatches
            self.placement = Placement.from_spec(cfg, mesh, microbatches)
        self.dtype = jnp.dtype(self.params["embed"].dtype)
        self.attn_impl, self.kv_cache = config.load.attn_impl, config.cache.kv_cache
        eos_ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        # The loaded LoRA adapters (enable_lora).
        self.loras = LoRARegistry(cfg, config.lora) if config.lora.enable_lora else None
        # Every request is built and validated there, once (the server and batch jobs too).
        self.processor = Processor(
            tokenizer, cfg.vocab_size, self.engine_cfg.max_model_len, eos_ids, config.load.seed,
            self.loras,
        )  # fmt: skip
        # The engine keeps the log (not `self`: a cycle LLM -> engine -> LLM would hold the KV
        # pool, 1 GiB by default, until Python's next full collection).
        self._note_program = aot.ProgramLog()
        self.compiled: set[tuple] = self._note_program.keys
        self.engine = self.static = None
        self._static_replicas = [(None, params)]
        if self.kv_cache == "paged":
            self.engine = self._paged_engine(config)
        else:
            self.static = self._static_engine()
        # Where `update_weights` places new weights: each engine's shapes, dtypes, shardings.
        self._weights_spec = [weights.spec(e.params) for e in self._paged_engines()]
        self.startup = {"load_s": time.perf_counter() - t0}
        if config.compile.warmup:
            t1 = time.perf_counter()
            self._warm_up(config.compile.compile_buckets)
            self.startup["compile_s"] = time.perf_counter() - t1
        self.startup["ready_s"] = time.perf_counter() - t0
        log.info(
            "engine ready in %.1f s (loading %.1f s, compiling %.1f s)",
            self.startup["ready_s"],
            self.startup["load_s"],
            self.startup.get("compile_s", 0.0),
        )

    def _paged_engine(self, config: JaxgenConfig) -> LLMEngine | EngineReplicas:
        """The continuous-batching engine; on a mesh with a data axis, one engine per data
        index, each on its own sub-mesh (a packed step has no batch axis to split)."""
        executable_dir = None
        if config.compile.executable_cache:
            executable_dir = os.path.join(cache_dir(), "executables")

        def engine(params, placement):
            return LLMEngine(
                self.cfg,
                params,
                config,
                placement=placement,
                note_program=self._note_program,
                executable_dir=executable_dir,
            )

        if self.placement is not None and self.placement.mesh.shape["data"] > 1:
            return EngineReplicas(
                [engine(r.params(self.params), r) for r in self.placement.replicas()]
            )
        if self.placement is not None:
            self.params = self.placement.params(self.params)
            self._static_replicas = [(self.placement, self.params)]  # not the unplaced copy
        return engine(self.params, self.placement)

    def _static_engine(self) -> StaticBatchEngine:
        """The static-batch engine (kv_cache="contiguous") over its replicas."""
        placement = self.placement
        if placement is not None:
            if placement.pipeline is not None and placement.mesh.shape["data"] > 1:
                # Static batches alternate between data-parallel replicas: XLA cannot
                # partition the decode's cache writes inside a pipeline stage over a data
                # axis as well (see sharding.rules), so each replica has its own sub-mesh.
                self._static_replicas = [(r, r.params(self.params)) for r in placement.replicas()]
            else:
                self.params = placement.params(self.params)
                self._static_replicas = [(placement, self.params)]
        return StaticBatchEngine(
            self.cfg,
            self.engine_cfg,
            self._static_replicas,
            dtype=self.dtype,
            attn_impl=self.attn_impl,
            note_program=self._note_program,
        )

    def _warm_up(self, compile_buckets) -> None:
        """Compiles before the first request: a one-device paged engine its step programs (the
        ragged ladder, or the declared buckets of the row-shaped step); the others generate two
        tokens."""
        if isinstance(self.engine, LLMEngine) and self.placement is None:
            specs = aot.DEFAULT_BUCKETS if compile_buckets is None else compile_buckets
            self.startup["programs"] = self.engine.precompile(
                aot.parse_buckets(specs), len(self.eos_ids)
            )
        else:
            self.generate(
                [[self.cfg.bos_token_id or 0]], SamplingParams(max_tokens=2, temperature=0)
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
