"""The engine's configuration: one frozen dataclass per concern, gathered in `JaxgenConfig`.

    LoadConfig       what is loaded and how it computes (model, dtype, quantization, length)
    CacheConfig      the device KV page pool
    TierConfig       the KV tiers below it (host RAM, disk, Mooncake store, transfer engine)
    SchedulerConfig  what one step may hold, and how steps follow each other
    CompileConfig    which programs compile when, and the caches that keep them
    ParallelConfig   the device mesh
    SpeculativeConfig  speculative decoding (None: off)
    LoRAConfig       the adapter stack (enable_lora)

Each field is declared once, with its default and its help text (`option`): `LLM(**options)`
takes the field names as keywords (`JaxgenConfig.from_options`), the engine takes the configs,
and the command line is generated from the same fields (`cli.options`). Each section checks its
own values in `validate()`; `JaxgenConfig.validate` checks which features combine, in one place,
before any device work. `EngineConfig` is derived from them once the model's length is known:
the bucket lists every step shape is padded to.

This module imports no JAX (the command line's `--help` reads it).
"""

from __future__ import annotations

import dataclasses
import difflib

from jaxgen.errors import CapacityError, JaxgenError, LoRAError

# Every dynamic size is padded to one of these; the number of compiled programs is therefore
# bounded by the product of the bucket lists actually used.
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SPECULATIVE_METHODS = ("ngram", "draft", "self", "mtp")
# `pallas_kernels.dispatch.IMPLS` (which imports JAX; a test keeps the two equal)
ATTN_IMPLS = ("pallas", "interpret", "xla", "flash", "mosaic", "mosaic_interpret")


def option(default, help: str, **cli):
    """A config field: its default and help text, and how its command-line flag reads
    (`cli`: `flag` instead of --field-name, `choices`, `metavar`, `type`, `nargs`)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


class Section:
    """A config dataclass: `validate()` raises a typed error for a bad value of its own."""

    def validate(self) -> None:
        pass

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class LoadConfig(Section):
    model: str | None = option(
        None,
        "HF directory, .gguf file or jaxgen checkpoint (None: the embedded SmolLM2-135M-Instruct)",
    )
    dtype: str = option(
        "float32",
        "weights/compute dtype: float32 (the CPU default), bfloat16 or float16 (GPU)",
        choices=("float32", "bfloat16", "float16"),
    )
    quantization: str | None = option(
        None,
        "quantize the weights on load (RTN: per-channel 8-bit, group 128 int4, group 64 nf4, "
        "unless the group size says otherwise); a `jaxgen quantize` checkpoint loads as is",
        choices=("int8", "int4", "nf4", "fp8"),
    )
    quantization_group_size: int | None = option(
        None, "group size for --quantization", flag="--group-size"
    )
    max_model_len: int | None = option(
        None, "longest prompt + output (None: the model's limit, at most 8192)"
    )
    attn_impl: str | None = option(
        None,
        "attention implementation (None: the backend's best; see pallas_kernels.dispatch)",
        choices=ATTN_IMPLS,
    )
    seed: int | None = option(
        None,
        "seeds the draws of requests that give no seed of their own (on the command line, the "
        "sampling of its prompts too)",
    )


@dataclasses.dataclass(frozen=True)
class CacheConfig(Section):
    kv_cache: str = option(
        "paged",
        "paged: continuous batching over a page pool (prefix caching, n > 1 by copy-on-write); "
        "contiguous: static batches over one slab per sequence",
        choices=("paged", "contiguous"),
    )
    page_size: int = option(16, "tokens per KV page")
    kv_cache_bytes: int | None = option(
        None, "memory budget of the page pool (None: what the weights leave)"
    )
    num_kv_pages: int | None = option(None, "pages in the pool (overrides --kv-cache-bytes)")
    kv_cache_dtype: str | None = option(
        None, "quantized KV pages (None: the model's dtype)", choices=("int8", "fp8")
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV pages of a prompt prefix computed before"
    )
    kv_eviction_policy: str = option(
        "lru",
        "which cached page the device pool displaces (and writes down the KV tiers): lru, or "
        "lfu (reused least often, least recent among equals)",
        choices=("lru", "lfu"),
    )
    share_on_fork: bool = option(
        True,
        "n > 1 and beam search share the parent's pages (copy-on-write); off copies them "
        "instead, to measure what sharing saves (benchmarks/sharing.py)",
    )

    def validate(self) -> None:
        if self.kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"kv_cache must be 'paged' or 'contiguous', got {self.kv_cache!r}")
        if self.kv_eviction_policy not in ("lru", "lfu"):
            raise JaxgenError(
                f"kv_eviction_policy={self.kv_eviction_policy!r}: use one of ['lru', 'lfu']"
            )


@dataclasses.dataclass(frozen=True)
class TierConfig(Section):
    """KV cache tiers below the device pool (`cache.tiers`, LMCache's local CPU / disk
    backends; `cache.mooncake`; `cache.transfer`)."""

    kv_host_cache_bytes: int | None = option(
        None,
        "KV tier in host RAM: cached prefix pages evicted from the device pool are kept there "
        "(LRU, at most this many bytes) and loaded back instead of recomputed",
    )
    kv_disk_cache_dir: str | None = option(
        None, "KV tier on disk (one checksummed file per page): found again after a restart"
    )
    kv_disk_cache_bytes: int | None = option(None, "bound of --kv-disk-cache-dir")
    kv_mooncake: str | dict | None = option(
        None,
        "shared KV tier in a Mooncake Store (the `mooncake` extra): Mooncake's client config, "
        "a dict or the path of its JSON file; engines pointed at the same master reuse each "
        "other's prefixes (a store that is down or returns a bad block: recomputed, warned)",
        metavar="CONFIG.json",
        type=str,
    )
    kv_transfer: str | dict | None = option(
        None,
        "KV pages read straight from one engine's memory by another (Mooncake's transfer "
        "engine; a disaggregated prefill / decode pair): its config, a dict or a JSON path",
        metavar="CONFIG.json",
        type=str,
    )
    kv_transfer_bytes: int = option(
        256 << 20, "host memory registered with the transfer engine for those pages"
    )
    kv_write_through: bool = option(
        False,
        "write a finished request's full pages down the tiers at once (a disaggregated "
        "prefill instance) instead of when the pool evicts them",
    )
    kv_prefetch: bool | None = option(
        None,
        "read tier prefixes on a background thread while other requests run (None: on for "
        "GPU/TPU, off on the CPU backend, where the reads share the step's cores)",
    )

    @property
    def asked(self) -> bool:
        return any(
            x is not None
            for x in (self.kv_host_cache_bytes, self.kv_disk_cache_dir, self.kv_mooncake,
                      self.kv_transfer)
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(Section):
    max_num_seqs: int = option(32, "sequences decoded together in one step")
    max_num_batched_tokens: int = option(512, "token budget of one continuous-batching step")
    decode_steps: int = option(32, "tokens per fused on-device decode call (static batches)")
    overlap: bool = option(
        True,
        "dispatch each step before the previous one's tokens are read back, so host work "
        "overlaps the device's (identical tokens; steps with beam search, penalties, "
        "speculative decoding or a pp mesh run synchronously)",
    )
    batch_invariant: bool = option(
        False,
        "each request's tokens and logprobs bitwise the same whatever shares its steps: "
        "decode and prefill steps each at one shape, prompts chunked alone, no prefix caching "
        "(paged engine on one device, no speculative decoding; a preempted sequence recomputes "
        "its tokens as a prefill, which can change its later tokens)",
    )
    invariant_chunk: int = option(64, "prefill chunk length in batch-invariant mode")

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.invariant_chunk < 1:
            raise ValueError(f"invariant_chunk must be >= 1, got {self.invariant_chunk}")


@dataclasses.dataclass(frozen=True)
class CompileConfig(Section):
    ragged_step: bool = option(
        True,
        "every step on one flat token axis, the whole program ladder compiled at start-up; "
        "off: the older step shaped by its rows, compiled as new shapes arrive",
    )
    warmup: bool = option(
        True,
        "compile the step programs at start-up, before the first request (static-batch and "
        "mesh engines: by generating two tokens)",
    )
    compile_buckets: str | tuple | None = option(
        None,
        "row-shaped step programs compiled at start-up, e.g. 'prefill:128,decode:8@1024' "
        "('' for none; None: engine.runner.aot.DEFAULT_BUCKETS)",
        type=str,
    )
    executable_cache: bool = option(
        True,
        "save the compiled step programs in the jaxgen cache and load them on later starts",
    )
    compilation_cache: bool | str = option(
        False,
        "turn on JAX's persistent compilation cache for the process (True: in the jaxgen "
        "cache; or a directory); the command line owns its process and turns it on",
        type=bool,
    )
    cover_new_shapes: float = option(
        0.0,
        "row-shaped step: run a step whose program has not compiled yet on a compiled one that "
        "covers it when that costs at most this many times its own work (0: always compile)",
        metavar="FACTOR",
    )
    compile_in_background: bool = option(
        False,
        "row-shaped step: a step nothing covers within --cover-new-shapes runs on one that "
        "covers it with more padding while its own program compiles on a thread",
    )

    def validate(self) -> None:
        factor = self.cover_new_shapes
        if factor != 0 and not factor >= 1:
            raise ValueError(
                f"cover_new_shapes must be 0 (off) or >= 1 (x a step's own work), got {factor}"
            )
        if self.compile_buckets is not None:
            parse_buckets(self.compile_buckets)  # a bad spec fails before the model loads


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Section):
    mesh: str | None = option(
        None,
        "device mesh, e.g. 'tp=4' or 'dp=2,tp=2,pp=2' (dp data, tp tensor, sp sequence, pp "
        "pipeline parallel; None: one device)",
    )
    pipeline_microbatches: int | None = option(
        None, "microbatches per pipelined step (None: the number of stages)"
    )


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig(Section):
    """`LLM(speculative={"method": ..., ...})`; None: no speculative decoding."""

    method: str = option(
        "ngram",
        "speculative decoding drafter (mtp: the checkpoint's own multi-token-prediction "
        "module, DeepSeek-V3)",
        flag="--speculative",
        choices=SPECULATIVE_METHODS,
    )
    num_tokens: int = option(4, "tokens drafted per step (k)", flag="--num-speculative-tokens")
    model: str | None = option(None, "the draft model's path (method draft)", flag="--draft-model")
    num_layers: int | None = option(
        None, "target layers used as the drafter (method self)", flag="--draft-layers"
    )
    ngram_max: int = option(4, "longest n-gram matched (method ngram)")
    ngram_min: int = option(1, "shortest n-gram matched (method ngram)")
    adaptive: bool = option(
        False, "shrink / grow k from the running acceptance rate", flag="--adaptive-speculation"
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if not 1 <= self.num_tokens <= 15:
            raise ValueError(f"num_tokens must be in [1, 15], got {self.num_tokens}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs 'model': a path to the draft model")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")

    @classmethod
    def from_dict(cls, spec) -> SpeculativeConfig | None:
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError('speculative must be a dict like {"method": "ngram", "num_tokens": 4}')
        return cls(**spec)


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Section):
    """The shape of the engine's adapter stack (vLLM's ``max_loras`` / ``max_lora_rank``)."""

    enable_lora: bool = option(
        False,
        "serve PEFT LoRA adapters on the base model (`load_lora`, then a request names one)",
    )
    max_loras: int = option(4, "adapters one step mixes (device slots); others wait")
    max_lora_rank: int = option(16, "largest adapter rank (every adapter is padded to it)")
    lora_target_modules: tuple[str, ...] | None = option(
        None, "the linears the adapter stack adapts (None: every projection)", nargs="+"
    )

    def __post_init__(self):
        if self.lora_target_modules is not None:
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))

    def validate(self) -> None:
        from jaxgen.model.lora import TARGET_MODULES

        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoRAError(f"{name} must be an int >= 1, got {value!r}")
        targets = self.target_modules
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown or not targets:
            raise LoRAError(
                f"lora target modules must be a non-empty subset of {list(TARGET_MODULES)}, "
                f"got {list(targets)}"
            )

    @property
    def target_modules(self) -> tuple[str, ...]:
        if self.lora_target_modules is not None:
            return self.lora_target_modules
        from jaxgen.model.lora import TARGET_MODULES

        return tuple(TARGET_MODULES)


SECTIONS = {
    "load": LoadConfig,
    "cache": CacheConfig,
    "tiers": TierConfig,
    "scheduler": SchedulerConfig,
    "compile": CompileConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}


@dataclasses.dataclass(frozen=True)
class JaxgenConfig:
    """Every option of an engine, by concern (vLLM's `VllmConfig`)."""

    load: LoadConfig = LoadConfig()
    cache: CacheConfig = CacheConfig()
    tiers: TierConfig = TierConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    compile: CompileConfig = CompileConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig = LoRAConfig()
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_options(cls, base: JaxgenConfig | None = None, **options) -> JaxgenConfig:
        """`base` (default: every default) with `options` set, each a field of a section by
        its name (`max_num_seqs=8`, `kv_cache_dtype="int8"`), or `speculative=` a dict or a
        `SpeculativeConfig`. An unknown name is a TypeError that names the closest ones."""
        config = base or cls()
        owner = {name: key for key, section in SECTIONS.items() for name in section.names()}
        changes: dict[str, dict] = {}
        for name, value in options.items():
            if name == "speculative":
                config = dataclasses.replace(config, speculative=SpeculativeConfig.from_dict(value))
                continue
            if name not in owner:
                close = difflib.get_close_matches(name, [*owner, "speculative"], n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise TypeError(f"unknown engine option {name!r}{hint}")
            changes.setdefault(owner[name], {})[name] = value
        return dataclasses.replace(
            config,
            **{
                key: dataclasses.replace(getattr(config, key), **values)
                for key, values in changes.items()
            },
        )

    def sections(self) -> list[Section]:
        return [getattr(self, key) for key in SECTIONS] + [self.speculative]

    def validate(self, model_cfg=None) -> None:
        """Each section's values, then which features combine (with the model's config:
        what its architecture runs with). Raises a typed error before any device work."""
        for section in self.sections():
            # A feature that is off takes its options unchecked (LoRA's without enable_lora).
            if section is not None and (section is not self.lora or self.lora.enable_lora):
                section.validate()
        check_features(self, model_cfg)


def check_features(config: JaxgenConfig, model_cfg=None) -> None:
    """The one place that says which features run together."""
    cache, parallel, sched = config.cache, config.parallel, config.scheduler
    paged, one_device = cache.kv_cache == "paged", parallel.mesh is None
    if not paged and (config.tiers.asked or config.tiers.kv_disk_cache_bytes is not None):
        raise JaxgenError(
            "KV cache tiers (kv_host_cache_bytes, kv_disk_cache_dir, kv_mooncake, kv_transfer) "
            "need kv_cache='paged'"
        )
    if sched.batch_invariant and not (paged and one_device):
        raise ValueError(
            "batch_invariant=True runs in the paged engine on one device: use "
            "kv_cache='paged' and no mesh"
        )
    if config.compile.compile_in_background and not (paged and one_device):
        raise ValueError(
            "compile_in_background=True compiles the paged engine's one-device step "
            "programs: use kv_cache='paged' and no mesh"
        )
    if config.lora.enable_lora and not paged:
        raise LoRAError("LoRA adapters run in the paged engine: use kv_cache='paged'")
    if config.speculative is not None and not paged:
        raise ValueError("speculative decoding runs in the paged engine (kv_cache='paged')")
    if model_cfg is not None:
        limit = model_cfg.max_position_embeddings
        length = config.load.max_model_len
        if length is not None and length > limit:
            raise ValueError(f"max_model_len {length} exceeds the model's {limit} positions")


def check_engine_features(config: JaxgenConfig, model_cfg, *, pipeline: bool) -> None:
    """What the paged engine runs together, once its placement says whether it has pipeline
    stages (a mesh spec alone does not: `pp=1`)."""
    speculative, lora = config.speculative is not None, config.lora.enable_lora
    kv_quant = config.cache.kv_cache_dtype
    if pipeline and speculative:
        raise ValueError(
            "speculative decoding does not run with pipeline parallelism (pp) yet: "
            "drop speculative= or the 'pp' axis of the mesh"
        )
    if model_cfg.mla is not None and (kv_quant is not None or pipeline):
        raise ValueError(
            f"{model_cfg.arch} (Multi-head Latent Attention) runs with unquantized latent pages "
            f"and without pipeline stages: drop kv_quant={kv_quant!r} or the 'pp' axis"
        )
    if config.scheduler.batch_invariant:
        if speculative or pipeline:
            raise ValueError(
                "batch_invariant=True runs without speculative decoding and pipeline stages "
                "(their steps change shape with the batch): drop one or the other"
            )
        chunk, budget = config.scheduler.invariant_chunk, config.scheduler.max_num_batched_tokens
        if chunk > budget:
            raise ValueError(
                f"batch-invariant prefill chunks of {chunk} tokens exceed "
                f"max_num_batched_tokens={budget}: raise the budget"
            )
    if lora and pipeline:
        raise LoRAError(
            "LoRA adapters do not run with pipeline parallelism (pp) yet: drop enable_lora "
            "or the 'pp' axis of the mesh"
        )
    if lora and speculative:
        raise LoRAError(
            "LoRA adapters do not run with speculative decoding yet (the drafter has no "
            "adapters): drop enable_lora or speculative="
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The limits every step shape is padded to, derived from a `JaxgenConfig` once the model's
    length is known (`EngineConfig.of`); the scheduler, packer and step programs read it."""

    max_model_len: int
    max_num_seqs: int = 32
    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS  # prompt lengths and cache lengths
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    decode_steps: int = 32  # tokens per fused on-device decode call (non-streaming)
    overlap: bool = True  # the paged engine dispatches step N+1 before reading step N back
    share_on_fork: bool = True  # `CacheConfig.share_on_fork`
    # Batch-invariant mode: a row's tokens and logprobs do not depend on what shares its steps.
    # Every decode step runs at one shape (max_num_seqs rows, page tables max_model_len wide),
    # every prefill step at another (prompts chunked alone at multiples of `invariant_chunk`),
    # so a row always meets the same compiled program; prefix caching is off.
    batch_invariant: bool = False
    invariant_chunk: int = 64  # prefill chunk length in batch-invariant mode
    # A step whose program has not compiled yet runs on a compiled program that covers it (more
    # rows, longer rows, wider page tables: padding) when that one's work is at most this many
    # times its own; only when none does, the step compiles its own program first (which stalls
    # the engine: 0.1-5 s on a CPU). 0: always compile (every step runs at its own shape).
    cover_new_shapes: float = 0.0
    # A step that no compiled program covers within `cover_new_shapes` runs on the least-work
    # compiled program that covers it at all (any padding), while its own program compiles on
    # a background thread (the engine's loop goes on: XLA releases the GIL); the program
    # serves the steps after it has compiled. Only a step nothing covers compiles first.
    compile_in_background: bool = False
    # One ragged step (`runner.shapes.FlatShape`): every step packs its tokens on one flat axis
    # padded to a token bucket, and the whole ladder compiles at start-up. False: the older
    # `StepShape` step, a program per combination of rows (kept to measure against while
    # pipelined meshes, MLA, speculative decoding and batch-invariant mode on the attention
    # kernels still run on it).
    ragged_step: bool = True

    def __post_init__(self):
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            decode_steps=self.decode_steps,
            invariant_chunk=self.invariant_chunk,
        ).validate()
        CompileConfig(cover_new_shapes=self.cover_new_shapes).validate()
        tokens = tuple(sorted(b for b in self.token_buckets if b < self.max_model_len))
        object.__setattr__(self, "token_buckets", tokens + (self.max_model_len,))
        batches = tuple(sorted(b for b in self.batch_buckets if b < self.max_num_seqs))
        object.__setattr__(self, "batch_buckets", batches + (self.max_num_seqs,))

    @classmethod
    def of(cls, config: JaxgenConfig, model_cfg) -> EngineConfig:
        """The step limits of `config` over a model (its length: at most 8192 by default)."""
        sched, comp = config.scheduler, config.compile
        limit = model_cfg.max_position_embeddings
        return cls(
            max_model_len=config.load.max_model_len or min(limit, 8192),
            max_num_seqs=sched.max_num_seqs,
            decode_steps=sched.decode_steps,
            overlap=sched.overlap,
            share_on_fork=config.cache.share_on_fork,
            batch_invariant=sched.batch_invariant,
            invariant_chunk=sched.invariant_chunk,
            cover_new_shapes=comp.cover_new_shapes,
            compile_in_background=comp.compile_in_background,
            ragged_step=comp.ragged_step,
        )

    def token_bucket(self, n: int) -> int:
        return _bucket(n, self.token_buckets, "tokens", "max_model_len")

    def batch_bucket(self, n: int) -> int:
        return _bucket(n, self.batch_buckets, "sequences", "max_num_seqs")


def _bucket(n: int, buckets: tuple[int, ...], what: str, limit: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise CapacityError(f"{n} {what} exceed the largest bucket {buckets[-1]}; raise {limit}")


# ------------------------------------------------------------------------------------------
# The compile-bucket language of `CompileConfig.compile_buckets` (`engine.runner.aot` compiles
# them): prefill:T, decode:B or decode:B@C.
# ------------------------------------------------------------------------------------------
DEFAULT_BUCKETS = ("prefill:32", "prefill:64", "decode:1@128", "decode:1@256")


def serving_buckets(max_num_seqs: int, context: int = 256) -> tuple[str, ...]:
    """What a server compiles before it answers /health: the default buckets plus decoding at
    every batch bucket up to `max_num_seqs` (a burst of clients decodes together at once)."""
    sizes = [b for b in DEFAULT_BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
    decode = tuple(
        f"decode:{b}@{context}" for b in sizes if f"decode:{b}@{context}" not in DEFAULT_BUCKETS
    )
    return DEFAULT_BUCKETS + ("prefill:128",) + decode


DEFAULT_DECODE_CONTEXT = 128


@dataclasses.dataclass(frozen=True)
class Bucket:
    kind: str  # "prefill" or "decode"
    size: int  # prompt tokens (prefill) or sequences (decode)
    context: int  # tokens of context the step's page tables cover

    def __str__(self) -> str:
        if self.kind == "prefill":
            return f"prefill:{self.size}"
        return f"decode:{self.size}@{self.context}"


def parse_buckets(specs) -> list[Bucket]:
    """["prefill:32", "decode:8@1024", ...] (or one comma-separated string) -> [Bucket]."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    buckets = []
    for spec in specs:
        kind, _, rest = str(spec).strip().partition(":")
        size, _, context = rest.partition("@")
        try:
            size_n = int(size)
            context_n = int(context) if context else None
        except ValueError:
            size_n = context_n = None
        if (
            kind not in ("prefill", "decode")
            or size_n is None
            or size_n < 1
            or (context_n is not None and (kind == "prefill" or context_n < 1))
        ):
            raise ValueError(
                f"bad compile bucket {spec!r}: use 'prefill:TOKENS', 'decode:SEQS' or "
                "'decode:SEQS@CONTEXT' with positive integers"
            )
        if kind == "prefill":
            context_n = size_n
        buckets.append(Bucket(kind, size_n, context_n or DEFAULT_DECODE_CONTEXT))
    return buckets
