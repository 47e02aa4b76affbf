"""Kernel benchmarks: `python -m benchmarks.kernels {flash,paged,prefill} [--json] [--quick]`.

flash: TFLOP/s of our FlashAttention kernels' forward and backward (B*T = 16k tokens, H=128,
N=32, K=8, causal, bf16): the Triton one ("jaxgen") and the Hopper one ("jaxgen_mosaic", forward
only: its backward is the Triton kernel's), against `jax.nn.dot_product_attention` (XLA and
cuDNN) and JAX's own Pallas `mha` (which has no GQA: K/V are repeated for it outside the timed
region). `--table` writes `pallas_kernels/prefill_table.py` from the forward times: per shape
class, the faster of our two kernels (the engine's choice).
paged: achieved HBM bandwidth of the paged decode kernel against JAX's own Pallas
`paged_attention`, as a fraction of the GPU's peak.
prefill: a chunk after an 8k cached prefix through the paged prefill kernel (prefix read from
its pages) against contiguous prefill of the same tokens.

Without a GPU both run in interpret mode at tiny sizes, only to prove the script works.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import device_profile
from jaxgen.bench import harness


def _timed(fn, *args, repeats):
    compiled = jax.jit(fn)
    out = compiled(*args)
    jax.block_until_ready(out)
    return harness.timeit(
        lambda: jax.block_until_ready(compiled(*args)), warmup=1, repeats=repeats
    ).median


def _header(interpret, dtype, heads, kv_heads, head_dim) -> dict:
    """The fields every kernel benchmark's result starts with."""
    return {
        "machine": harness.machine_info(),
        "interpret": interpret,
        "dtype": str(jnp.dtype(dtype)),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
    }


def _flash_flops(batch, seq, heads, head_dim, causal):
    flops = 4 * batch * seq * seq * heads * head_dim
    return flops / 2 if causal else flops


def flash(quick: bool, repeats: int) -> dict:
    from jaxgen.pallas_kernels import flash_attention_mgpu as mgpu
    from jaxgen.pallas_kernels import mosaic_interpret
    from jaxgen.pallas_kernels.flash_attention import BlockSizes, flash_attention

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not quick:
        grid = [(16384 // t, t) for t in (2048, 8192)]
        heads, kv_heads, head_dim, dtype = 32, 8, 128, jnp.bfloat16
    else:
        grid = [(2, 64)]
        heads, kv_heads, head_dim, dtype = 4, 2, 64, jnp.float32
    interpret = not on_gpu
    # The Hopper kernel: on the GPU, or in JAX's Mosaic GPU interpreter (JAX >= 0.12) in bf16.
    mosaic = on_gpu or mosaic_interpret.available()
    blocks = None if on_gpu else BlockSizes(16, 16, 16, 16)
    rows = []
    for batch, seq in grid:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
        k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
        v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
        fwd_flops = _flash_flops(batch, seq, heads, head_dim, True)
        impls = {
            "jaxgen": lambda q, k, v: flash_attention(
                q, k, v, causal=True, interpret=interpret, block_sizes=blocks
            ),
            "xla": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="xla"
            ),
        }
        if mosaic:
            impls["jaxgen_mosaic"] = lambda q, k, v: mgpu.attention(
                q.astype(jnp.bfloat16),
                k.astype(jnp.bfloat16),
                v.astype(jnp.bfloat16),
                causal=True,
                interpret=interpret,
            )
        if on_gpu:
            from jax.experimental.pallas.ops.gpu import attention as jax_pallas

            impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
            rep = heads // kv_heads
            k_rep, v_rep = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            impls["jax_pallas_mha"] = lambda q, k, v, k_rep=k_rep, v_rep=v_rep: jax_pallas.mha(
                q, k_rep, v_rep, None, sm_scale=head_dim**-0.5, causal=True
            )
        for name, fn in impls.items():
            row = {"kernel": name, "batch": batch, "seq": seq}
            try:
                t_fwd = _timed(fn, q, k, v, repeats=repeats)
                row["fwd_ms"] = t_fwd * 1e3
                row["fwd_tflops"] = fwd_flops / t_fwd / 1e12
                if interpret and name == "jaxgen_mosaic":
                    # Its backward is the Triton kernel's (the row above); under jit on a
                    # 2-core host the interpreter's threads can starve with it alongside.
                    rows.append(row)
                    continue
                loss = lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum()
                t_bwd = _timed(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, repeats=repeats)
                # The gradient call includes a forward; FA-2 counts backward as 2.5x forward.
                row["fwd_bwd_ms"] = t_bwd * 1e3
                row["bwd_tflops"] = 2.5 * fwd_flops / max(t_bwd - t_fwd, 1e-9) / 1e12
            except Exception as e:  # a peer that cannot run this shape is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
    _ratios([r for r in rows if r["batch"] == batch and r["seq"] == seq])
    return {
        **_header(interpret, dtype, heads, kv_heads, head_dim),
        "rows": rows,
    }


def _ratios(rows: list[dict]) -> None:
    """Each row's forward speed relative to cuDNN's and JAX's Pallas `mha`'s on the same shape
    (the issue's targets are these ratios)."""
    times = {r["kernel"]: r["fwd_ms"] for r in rows if "fwd_ms" in r}
    for r in rows:
        for peer in ("cudnn", "jax_pallas_mha"):
            if "fwd_ms" in r and peer in times and r["kernel"] != peer:
                r[f"fwd_vs_{peer}"] = times[peer] / r["fwd_ms"]


def prefill_table(result: dict) -> dict[str, str]:
    """Shape class -> the faster of our kernels ("mosaic" or "triton") by forward time."""
    from jaxgen.pallas_kernels import dispatch

    table = {}
    for batch, seq in sorted({(r["batch"], r["seq"]) for r in result["rows"]}):
        times = {
            r["kernel"]: r["fwd_ms"]
            for r in result["rows"]
            if (r["batch"], r["seq"]) == (batch, seq) and "fwd_ms" in r
        }
        if "jaxgen" not in times or "jaxgen_mosaic" not in times:
            continue
        dt = jnp.dtype(result["dtype"])
        q = jax.ShapeDtypeStruct((batch, seq, result["heads"], result["head_dim"]), dt)
        k = jax.ShapeDtypeStruct((batch, seq, result["kv_heads"], result["head_dim"]), dt)
        fastest = "mosaic" if times["jaxgen_mosaic"] < times["jaxgen"] else "triton"
        table[dispatch.shape_class(q, k, True)] = fastest
    return table


def write_prefill_table(result: dict, path: str | None = None) -> str:
    """Rewrites `pallas_kernels/prefill_table.py` with this GPU's measured entries (other GPUs'
    entries are kept). Refuses interpret-mode results: their times say nothing."""
    import pprint

    from jaxgen.pallas_kernels import prefill_table as module

    if result["interpret"]:
        raise ValueError("--table needs a compiled GPU run; interpret-mode times say nothing")
    path = path or module.__file__
    tables = {**module.TABLE, result["machine"]["device"]: prefill_table(result)}
    head = open(path).read().split("TABLE:")[0]
    with open(path, "w") as f:
        f.write(head + "TABLE: dict[str, dict[str, str]] = " + pprint.pformat(tables) + "\n")
    return path


FLASH_COLUMNS = [
    ("kernel", "kernel"),
    ("batch", "B"),
    ("seq", "T=S"),
    ("fwd_ms", "fwd ms"),
    ("fwd_tflops", "fwd TFLOP/s"),
    ("fwd_vs_cudnn", "fwd vs cuDNN"),
    ("fwd_vs_jax_pallas_mha", "fwd vs JAX mha"),
    ("bwd_tflops", "bwd TFLOP/s"),
    ("error", "note"),
]


def _mode(result: dict) -> str:
    return (
        "interpret mode (CPU, tiny: proves the script only)" if result["interpret"] else "compiled"
    )


def flash_markdown(result: dict) -> str:
    m = result["machine"]
    mode = _mode(result)
    return (
        f"### FlashAttention kernel ({m['device']}, {mode})\n\n"
        f"{result['dtype']}, N={result['heads']}, K={result['kv_heads']}, "
        f"H={result['head_dim']}, causal; {m['date']}.\n\n"
        + harness.markdown_table(result["rows"], FLASH_COLUMNS)
    )


def _jax_paged(kernel, splits, per_block, q, k_t, v_t, tables, lens):
    """JAX's own Pallas paged kernel on kv-head-major pages ``[K, P, page, H]``."""
    return kernel(q, k_t, v_t, tables, lens, k_splits=splits, pages_per_compute_block=per_block)


def paged(quick: bool, repeats: int) -> dict:
    from jaxgen.pallas_kernels.paged_attention import BlockSizes, kv_cache_shape, paged_attention

    on_gpu = jax.default_backend() == "gpu"
    peak = harness.gpu_peaks()
    if on_gpu and not quick:
        grid = [(b, c) for b in (1, 32, 256) for c in (1024, 32768)]
        heads, kv_heads, head_dim, page_size, dtype = 32, 8, 128, 16, jnp.bfloat16
    else:
        grid = [(2, 64)]
        heads, kv_heads, head_dim, page_size, dtype = 4, 2, 64, 8, jnp.float32
    interpret = not on_gpu
    rows = []
    for batch, context in grid:
        pages_per_seq = context // page_size
        num_pages = batch * pages_per_seq
        keys = jax.random.split(jax.random.key(0), 3)
        shape = kv_cache_shape(num_pages, page_size, kv_heads, head_dim)
        k_pages = jax.random.normal(keys[0], shape, dtype)
        v_pages = jax.random.normal(keys[1], shape, dtype)
        q = jax.random.normal(keys[2], (batch, heads, head_dim), dtype)
        tables = (
            jax.random.permutation(keys[0], num_pages)
            .reshape(batch, pages_per_seq)
            .astype(jnp.int32)
        )
        lens = jnp.full((batch,), context, jnp.int32)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dtype).itemsize
        jaxgen = functools.partial(
            paged_attention,
            interpret=interpret,
            block_sizes=None if on_gpu else BlockSizes(pages_per_block=2),
        )
        impls = {"jaxgen": (jaxgen, (q, k_pages, v_pages, tables, lens))}
        if on_gpu:
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

            # JAX's kernel wants kv-head-major pages [K, P, page, H]; converted outside the timing.
            k_t, v_t = jnp.moveaxis(k_pages, 2, 0), jnp.moveaxis(v_pages, 2, 0)
            splits = min(16, pages_per_seq)
            per_block = min(8, pages_per_seq // splits)
            impls["jax_pallas_paged"] = (
                functools.partial(_jax_paged, jax_paged.paged_attention, splits, per_block),
                (q, k_t, v_t, tables, lens),
            )
        for name, (fn, args) in impls.items():
            row = {"kernel": name, "batch": batch, "context": context}
            try:
                t = _timed(fn, *args, repeats=repeats)
                row["us"] = t * 1e6
                row["gbps"] = kv_bytes / t / 1e9
                # Device time from the profiler: the kernels' own time, without the host's
                # dispatch and synchronisation that the wall time above includes.
                prof = device_profile.profile_call(
                    jax.jit(fn).lower(*args).compile(), args, calls=20
                )
                row["device_us"] = prof["device_us"]
                row["launches"] = prof["launches"]
                row["gbps_device"] = kv_bytes / (prof["device_us"] * 1e-6) / 1e9
                if peak:
                    row["frac_peak"] = row["gbps"] / peak["hbm_gbps"]
                    row["frac_peak_device"] = row["gbps_device"] / peak["hbm_gbps"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
        if on_gpu:
            rows.append(
                _paged_sweep(
                    paged_attention,
                    BlockSizes,
                    (q, k_pages, v_pages, tables, lens),
                    batch,
                    context,
                    kv_bytes,
                    peak,
                )
            )
    return {
        **_header(interpret, dtype, heads, kv_heads, head_dim),
        "page_size": page_size,
        "peak": peak,
        "rows": rows,
    }


# (pages per inner step, warps, splits per sequence; None: the kernel's default), tried in this
# order until SWEEP_SECONDS have passed for one shape.
SWEEP = [
    (4, 4, None),
    (8, 4, None),
    (16, 4, None),
    (8, 8, None),
    (4, 4, 64),
    (8, 4, 64),
    (4, 4, 8),
    (16, 8, None),
    (8, 4, 8),
    (16, 4, 64),
]
SWEEP_SECONDS = 12.0


def _paged_sweep(kernel, block_sizes, args, batch, context, kv_bytes, peak) -> dict:
    """The best device time of the paged kernel over a small grid of its block sizes (pages
    per inner step, splits per sequence, warps): which tiling the default should take."""
    tried = []
    deadline = time.perf_counter() + SWEEP_SECONDS
    for ppb, warps, splits in SWEEP:
        if time.perf_counter() > deadline:
            break  # the rest untried: the suite has a time limit
        bs = block_sizes(pages_per_block=ppb, num_splits=splits, num_warps=warps)
        entry = {"ppb": ppb, "warps": warps, "splits": splits}
        try:
            fn = jax.jit(functools.partial(kernel, block_sizes=bs))
            prof = device_profile.profile_call(fn.lower(*args).compile(), args, calls=10)
            entry["device_us"] = prof["device_us"]
        except Exception as e:  # a tiling the kernel or the GPU refuses
            entry["error"] = f"{type(e).__name__}: {str(e)[:80]}"
        tried.append(entry)
    ok = [t for t in tried if "device_us" in t]
    row = {"kernel": "jaxgen (best tiling)", "batch": batch, "context": context, "sweep": tried}
    if ok:
        best = min(ok, key=lambda t: t["device_us"])
        row.update(
            device_us=best["device_us"],
            gbps_device=kv_bytes / (best["device_us"] * 1e-6) / 1e9,
            error=f"ppb={best['ppb']} warps={best['warps']} splits={best['splits']}",
        )
        if peak:
            row["frac_peak_device"] = row["gbps_device"] / peak["hbm_gbps"]
    return row


PAGED_COLUMNS = [
    ("kernel", "kernel"),
    ("batch", "B"),
    ("context", "context"),
    ("us", "wall µs"),
    ("device_us", "device µs"),
    ("launches", "launches"),
    ("gbps_device", "GB/s (K+V read, device)"),
    ("frac_peak_device", "of peak HBM (device)"),
    ("error", "note"),
]


def paged_markdown(result: dict) -> str:
    m = result["machine"]
    mode = _mode(result)
    peak = result["peak"]
    return (
        f"### Paged decode attention ({m['device']}, {mode})\n\n"
        f"{result['dtype']}, N={result['heads']}, K={result['kv_heads']}, H={result['head_dim']}, "
        f"page {result['page_size']}; peak HBM {peak['hbm_gbps'] if peak else '–'} GB/s "
        f"(datasheet); {m['date']}.\n\n" + harness.markdown_table(result["rows"], PAGED_COLUMNS)
    )


def chunked_prefill(quick: bool, repeats: int) -> dict:
    """A chunk after a cached prefix: `paged_prefill` (prefix read from its pages, chunk from
    the batch) against contiguous prefill of the same tokens (the FlashAttention kernel over
    the prefix and the chunk as one contiguous K/V, q_offsets at the prefix), both timed as
    attention calls on the same inputs. ratio = contiguous time / paged time (>= 0.9 is the
    issue's must: the pages cost little)."""
    from jaxgen.pallas_kernels.flash_attention import BlockSizes, flash_attention
    from jaxgen.pallas_kernels.paged_attention import kv_cache_shape
    from jaxgen.pallas_kernels.paged_prefill import PrefillBlocks, paged_prefill_attention

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not quick:
        grid, page = [(8192, 2048), (8192, 512)], 16
        heads, kv_heads, head_dim, dtype = 32, 8, 128, jnp.bfloat16
    else:
        grid, page = [(48, 32)], 8
        heads, kv_heads, head_dim, dtype = 4, 2, 32, jnp.float32
    interpret = not on_gpu
    flash_blocks = None if on_gpu else BlockSizes(16, 16, 16, 16)
    paged_blocks = None if on_gpu else PrefillBlocks(block_m=16, block_k=16, pages_per_block=2)

    def measure(prefix, chunk):
        keys = jax.random.split(jax.random.key(0), 4)
        total = prefix + chunk
        q = jax.random.normal(keys[0], (1, chunk, heads, head_dim), dtype)
        k = jax.random.normal(keys[1], (1, total, kv_heads, head_dim), dtype)
        v = jax.random.normal(keys[2], (1, total, kv_heads, head_dim), dtype)
        num_pages = total // page
        # The prefix's pages scattered through a pool twice its size (a real block table).
        order = jax.random.permutation(keys[3], 2 * num_pages)[:num_pages]
        pool_shape = kv_cache_shape(2 * num_pages, page, kv_heads, head_dim)
        as_pages = lambda x: (
            jnp.zeros(pool_shape, dtype).at[order].set(x[0].reshape(num_pages, page, kv_heads, -1))
        )
        k_pages, v_pages = as_pages(k), as_pages(v)
        tables = order[None].astype(jnp.int32)
        ctx, new = jnp.array([prefix], jnp.int32), jnp.array([chunk], jnp.int32)
        contiguous = lambda q, k, v: flash_attention(
            q, k, v, kv_lens=ctx + new, q_offsets=ctx, interpret=interpret, block_sizes=flash_blocks
        )
        paged = lambda q, kn, vn, kp, vp: paged_prefill_attention(
            q, kn, vn, kp, vp, tables, ctx, new, interpret=interpret, blocks=paged_blocks
        )
        row = {"prefix": prefix, "chunk": chunk, "page": page}
        t_contig = _timed(contiguous, q, k, v, repeats=repeats)
        t_paged = _timed(paged, q, k[:, prefix:], v[:, prefix:], k_pages, v_pages, repeats=repeats)
        flops = 4 * chunk * (prefix + chunk / 2) * heads * head_dim
        row.update(
            contiguous_ms=t_contig * 1e3,
            paged_ms=t_paged * 1e3,
            paged_tflops=flops / t_paged / 1e12,
            ratio=t_contig / t_paged,
        )
        return row

    rows = [measure(prefix, chunk) for prefix, chunk in grid]
    return {
        **_header(interpret, dtype, heads, kv_heads, head_dim),
        "rows": rows,
    }


PREFILL_COLUMNS = [
    ("prefix", "cached prefix"),
    ("chunk", "chunk"),
    ("page", "page"),
    ("contiguous_ms", "contiguous ms"),
    ("paged_ms", "paged ms"),
    ("paged_tflops", "paged TFLOP/s"),
    ("ratio", "contiguous / paged"),
]


def chunked_prefill_markdown(result: dict) -> str:
    m = result["machine"]
    return (
        f"### Chunked prefill over a paged prefix ({m['device']}, {_mode(result)})\n\n"
        f"{result['dtype']}, N={result['heads']}, K={result['kv_heads']}, "
        f"H={result['head_dim']}; {m['date']}.\n\n"
        + harness.markdown_table(result["rows"], PREFILL_COLUMNS)
    )


BENCHES = {
    "flash": (flash, flash_markdown),
    "paged": (paged, paged_markdown),
    "prefill": (chunked_prefill, chunked_prefill_markdown),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("which", choices=sorted(BENCHES))
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write JSON here")
    p.add_argument("--write-docs", action="store_true", help="update its section of docs/gpu.md")
    p.add_argument(
        "--table",
        action="store_true",
        help="flash: write pallas_kernels/prefill_table.py (the dispatch's choice) from this run",
    )
    args = p.parse_args(argv)
    if args.table and args.which != "flash":
        p.error("--table goes with flash")
    run, to_markdown = BENCHES[args.which]
    result = run(args.quick, args.repeats)
    if args.table:
        print(f"wrote {write_prefill_table(result)}", file=sys.stderr)
    markdown = to_markdown(result)
    if args.out:
        harness.dump_json(result, args.out)
    print(harness.dump_json(result) if args.json else markdown)
    if args.write_docs:
        harness.write_section(f"kernels-{args.which}", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
