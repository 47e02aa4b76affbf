"""EngineConfig: the one list of shape buckets and the engine's capacity limits."""

from __future__ import annotations

import dataclasses

from jaxgen.errors import CapacityError, LoRAError

# Every dynamic size is padded to one of these; the number of compiled programs is therefore
# bounded by the product of the bucket lists actually used.
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 32
    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS  # prompt lengths and cache lengths
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    decode_steps: int = 32  # tokens per fused on-device decode call (non-streaming)
    overlap: bool = True  # the paged engine dispatches step N+1 before reading step N back
    # A fork (n > 1, beam search) shares the parent's KV pages; False copies them instead (an
    # engine that cannot share, kept only to measure what sharing saves: `jaxgen bench sharing`).
    share_on_fork: bool = True
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
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        check_cover_factor(self.cover_new_shapes)
        if self.invariant_chunk < 1:
            raise ValueError(f"invariant_chunk must be >= 1, got {self.invariant_chunk}")
        tokens = tuple(sorted(b for b in self.token_buckets if b < self.max_model_len))
        object.__setattr__(self, "token_buckets", tokens + (self.max_model_len,))
        batches = tuple(sorted(b for b in self.batch_buckets if b < self.max_num_seqs))
        object.__setattr__(self, "batch_buckets", batches + (self.max_num_seqs,))

    def token_bucket(self, n: int) -> int:
        return _bucket(n, self.token_buckets, "tokens", "max_model_len")

    def batch_bucket(self, n: int) -> int:
        return _bucket(n, self.batch_buckets, "sequences", "max_num_seqs")


def check_cover_factor(factor: float) -> None:
    """`cover_new_shapes`: 0 (off) or a factor >= 1."""
    if factor != 0 and not factor >= 1:
        raise ValueError(
            f"cover_new_shapes must be 0 (off) or >= 1 (x a step's own work), got {factor}"
        )


def check_features(
    cfg, engine_cfg: EngineConfig, *, pipeline, speculative, lora, kv_quant, max_num_batched_tokens
) -> None:
    """Raises a typed error for a combination of features an engine does not run (yet), before
    any device work: `pipeline`, `speculative`, `lora`: whether they are asked for."""
    if pipeline and speculative:
        raise ValueError(
            "speculative decoding does not run with pipeline parallelism (pp) yet: "
            "drop speculative= or the 'pp' axis of the mesh"
        )
    if cfg.mla is not None and (kv_quant is not None or pipeline):
        raise ValueError(
            f"{cfg.arch} (Multi-head Latent Attention) runs with unquantized latent pages "
            f"and without pipeline stages: drop kv_quant={kv_quant!r} or the 'pp' axis"
        )
    if engine_cfg.batch_invariant:
        if speculative or pipeline:
            raise ValueError(
                "batch_invariant=True runs without speculative decoding and pipeline stages "
                "(their steps change shape with the batch): drop one or the other"
            )
        chunk = engine_cfg.invariant_chunk
        if chunk > max_num_batched_tokens:
            raise ValueError(
                f"batch-invariant prefill chunks of {chunk} tokens exceed "
                f"max_num_batched_tokens={max_num_batched_tokens}: raise the budget"
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


def _bucket(n: int, buckets: tuple[int, ...], what: str, limit: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise CapacityError(f"{n} {what} exceed the largest bucket {buckets[-1]}; raise {limit}")
