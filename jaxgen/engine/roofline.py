"""Bytes moved and FLOPs of a model step, from the config: the numerators of MBU and MFU.

MBU (model bandwidth utilisation) = bytes a step must read / step time / peak bandwidth;
MFU (model FLOP utilisation) = FLOPs a step must do / step time / peak FLOP rate.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

DEFAULT_CPU_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.85


def default_kv_budget(weight_bytes: int) -> int:
    """KV pool bytes when none is given: 1 GiB on the CPU; on a GPU, 85% of its memory
    minus the weights (the rest is left for activations and XLA's workspace)."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform == "gpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] * GPU_MEMORY_FRACTION) - weight_bytes
    return DEFAULT_CPU_KV_BYTES


def param_bytes(params) -> int:
    """Bytes of every parameter leaf (quantized weights count at their stored size)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def matmul_params(cfg) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not; the LM
    head does, tied or not)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attn + 3 * d * f) + cfg.vocab_size * d


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def step_cost(
    cfg,
    weight_bytes: int,
    *,
    new_tokens: int,
    context_tokens: int,
    kv_itemsize: int,
    attended_pairs: int | None = None,
) -> dict:
    """Minimum bytes and FLOPs of one forward step.

    Args:
      weight_bytes: `param_bytes(params)` (every weight is read once per step).
      new_tokens: tokens processed this step, summed over the batch.
      context_tokens: KV entries read this step, summed over the batch.
      attended_pairs: (query, key) pairs scored, summed over the batch; default
        new_tokens * context_tokens / batch is not knowable here, so decode callers pass
        context_tokens (one query per sequence).
    """
    pairs = context_tokens if attended_pairs is None else attended_pairs
    flops = 2 * matmul_params(cfg) * new_tokens
    flops += 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs  # QK^T and PV
    nbytes = weight_bytes + context_tokens * kv_bytes_per_token(cfg, kv_itemsize)
    return {"bytes": nbytes, "flops": flops}


# Datasheet peaks (dense, no sparsity) of GPUs we know.
GPU_PEAKS = {
    "H100": {"hbm_gbps": 3350.0, "bf16_tflops": 989.0, "f32_tflops": 67.0},
    "H200": {"hbm_gbps": 4800.0, "bf16_tflops": 989.0, "f32_tflops": 67.0},
}


def gpu_peaks() -> dict | None:
    kind = getattr(jax.devices()[0], "device_kind", "")
    for name, peaks in GPU_PEAKS.items():
        if name in kind:
            return dict(peaks, device=kind)
    return None


def _median_seconds(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_read_bandwidth(size_mb: int = 512, repeats: int = 7) -> float:
    """GB/s of a large-array reduction (random data: every byte read once)."""
    x = jax.random.normal(jax.random.key(0), (size_mb * 1024 * 1024 // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    return x.nbytes / _median_seconds(lambda: f(x).block_until_ready(), repeats) / 1e9


def measure_copy_bandwidth(size_mb: int = 512, repeats: int = 7) -> float:
    """GB/s of read + write of a large array (x * 2)."""
    x = jax.random.normal(jax.random.key(0), (size_mb * 1024 * 1024 // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2)
    return 2 * x.nbytes / _median_seconds(lambda: f(x).block_until_ready(), repeats) / 1e9


def measure_matmul_peak(dtype=jnp.float32, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul."""
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    return 2 * n**3 / _median_seconds(lambda: f(a, b).block_until_ready(), repeats) / 1e9


@functools.cache
def machine_limits(quick: bool = False) -> dict:
    """This machine's roofline: measured read bandwidth and matmul peaks (f32, bf16); on a
    known GPU the datasheet peaks and a measured copy bandwidth too. Measured once per process."""
    size, n = (64, 512) if quick else (512, 2048)
    limits = {
        "read_gbps": measure_read_bandwidth(size),
        "f32_gflops": measure_matmul_peak(jnp.float32, n),
        "bf16_gflops": measure_matmul_peak(jnp.bfloat16, n),
    }
    peaks = gpu_peaks()
    if peaks:
        limits["copy_gbps"] = measure_copy_bandwidth(size)
        limits["datasheet"] = peaks
        # Judge GPU steps against the datasheet, as MBU/MFU are usually quoted.
        limits["read_gbps"] = peaks["hbm_gbps"]
        limits["bf16_gflops"] = peaks["bf16_tflops"] * 1e3
        limits["f32_gflops"] = peaks["f32_tflops"] * 1e3
    return limits
