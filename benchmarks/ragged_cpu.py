"""One attention layer on XLA:CPU: the ragged step's attention against today's per-class paths.

`python -m benchmarks.ragged_cpu [--repeats N] [--quick]` (from the repository root) times one
call (jitted, median of N, `jax.block_until_ready`, wall and process CPU time) at the default
model's attention shape (9 heads, 3 KV heads, head dim 64, page 16, f32), the ragged call
always padded to a token bucket, S = 64 sequence rows and a 128-page table width, so its time
shows whether its cost follows the real work:

  decode B rows x context C   today: `page_blocks` (the engine's CPU decode path)
  fresh prefill of 512        today: `dispatch.attention` (contiguous, over the chunk's keys)
  256-token chunk after 1024  today: `paged_prefill_reference` (prefix gathered from its pages)
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.pallas_kernels import dispatch
from jaxgen.pallas_kernels.page_blocks import page_blocks
from jaxgen.pallas_kernels.paged_attention import kv_cache_shape
from jaxgen.pallas_kernels.paged_prefill import paged_prefill_reference
from jaxgen.pallas_kernels.ragged_xla import ragged_paged_attention_xla

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
ROWS, WIDTH = 64, 128  # the ragged call's fixed sequence rows and table width (pages)


def _time(fn, *args, repeats: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms of this process, all threads): on a shared machine the
    CPU time is the steadier figure (time spent waiting for a core is not in it)."""
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(*args))
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def _pool(rng, num_pages):
    shape = kv_cache_shape(num_pages, PAGE, KV_HEADS, HEAD_DIM)
    return jnp.asarray(rng.randn(*shape), jnp.float32), jnp.asarray(rng.randn(*shape), jnp.float32)


def _ragged_args(rng, seqs, bucket):
    """Flat inputs for sequences (q_len, seq_len), padded to `bucket` tokens, ROWS rows, WIDTH."""
    pages_needed = sum(-(-n // PAGE) for _, n in seqs)
    k, v = _pool(rng, pages_needed + 1)
    tables = np.zeros((ROWS, WIDTH), np.int32)
    perm = rng.permutation(pages_needed)
    used = 0
    for s, (_, n) in enumerate(seqs):
        need = -(-n // PAGE)
        tables[s, :need] = perm[used : used + need]
        used += need
    cu = np.zeros(ROWS + 1, np.int32)
    cu[1 : len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    lens = np.zeros(ROWS, np.int32)
    lens[: len(seqs)] = [n for _, n in seqs]
    q = jnp.asarray(rng.randn(bucket, HEADS, HEAD_DIM), jnp.float32)
    md = (jnp.asarray(tables), jnp.asarray(cu), jnp.asarray(lens), jnp.asarray([len(seqs)]))
    return (q, k, v, *md), tables, lens


def ragged(*args):
    return ragged_paged_attention_xla(*args, sm_scale=HEAD_DIM**-0.5)


def run(repeats: int, quick: bool) -> list[dict]:
    rng = np.random.RandomState(0)
    rows = []
    decode = [(1, 256), (8, 256), (32, 256), (1, 1024), (8, 1024), (32, 1024)]
    for batch, ctx in decode[:2] if quick else decode:
        args, tables, lens = _ragged_args(rng, [(1, ctx)] * batch, bucket=64)
        q, k, v = args[:3]
        blocks = jax.tree.map(jnp.asarray, page_blocks(list(tables[:batch]), lens[:batch], PAGE))
        q_old = q[:batch, None]
        old = _time(
            lambda q, k, v, t, n, b: dispatch.paged_attention(q, k, v, t, n, blocks=b, impl="xla"),
            q_old,
            k,
            v,
            jnp.asarray(tables[:batch, : -(-ctx // PAGE)]),
            jnp.asarray(lens[:batch]),
            blocks,
            repeats=repeats,
        )
        new = _time(ragged, *args, repeats=repeats)
        rows.append(
            dict(
                case=f"decode B={batch} ctx={ctx}",
                old="page_blocks",
                old_ms=old,
                new_ms=new,
                bucket="T=64",
            )
        )
    # The same decode rows in a 512-token bucket: padding tokens cost nothing.
    args, _, _ = _ragged_args(rng, [(1, 1024)] * 8, bucket=512)
    new = _time(ragged, *args, repeats=repeats)
    rows.append(
        dict(
            case="decode B=8 ctx=1024",
            old="(as above)",
            old_ms=rows[-2]["old_ms"] if not quick else rows[-1]["old_ms"],
            new_ms=new,
            bucket="T=512",
        )
    )
    # A fresh 512-token prefill: today over the chunk's own keys, contiguous.
    args, _, _ = _ragged_args(rng, [(512, 512)], bucket=512)
    q = args[0][None]
    k_c = jnp.asarray(rng.randn(1, 512, KV_HEADS, HEAD_DIM), jnp.float32)
    old = _time(
        lambda q, k, v: dispatch.attention(q, k, v, kv_lens=jnp.array([512]), impl="xla"),
        q,
        k_c,
        k_c,
        repeats=repeats,
    )
    new = _time(ragged, *args, repeats=repeats)
    rows.append(
        dict(
            case="fresh prefill 512",
            old="dispatch.attention",
            old_ms=old,
            new_ms=new,
            bucket="T=512",
        )
    )
    # A 256-token chunk after 1024 cached tokens.
    args, tables, _ = _ragged_args(rng, [(256, 1280)], bucket=512)
    q, k, v = args[:3]
    k_new = jnp.asarray(rng.randn(1, 256, KV_HEADS, HEAD_DIM), jnp.float32)
    old = _time(
        lambda q, kn, vn, k, v, t: paged_prefill_reference(
            q, kn, vn, k, v, t, jnp.array([1024]), jnp.array([256])
        ),
        q[None, :256],
        k_new,
        k_new,
        k,
        v,
        jnp.asarray(tables[:1]),
        repeats=repeats,
    )
    new = _time(ragged, *args, repeats=repeats)
    rows.append(
        dict(
            case="chunk 256 after 1024",
            old="paged_prefill_reference",
            old_ms=old,
            new_ms=new,
            bucket="T=512",
        )
    )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args(argv)
    print(
        f"| case | today | today ms wall / CPU | ragged ({ROWS} rows, {WIDTH}-page tables) "
        "ms wall / CPU | new / old (CPU) |"
    )
    print("|---|---|---|---|---|")
    for r in run(ns.repeats, ns.quick):
        (ow, oc), (nw, nc) = r["old_ms"], r["new_ms"]
        print(
            f"| {r['case']} | {r['old']} | {ow:.2f} / {oc:.2f} | {nw:.2f} / {nc:.2f} "
            f"({r['bucket']}) | {nc / oc:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
