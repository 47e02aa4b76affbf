"""The model on one ragged step (`FlatMetadata`): a mixed batch of a fresh prefill, a chunk
after cached context, decode rows and a verify-like row, packed on one flat token axis padded
to a token bucket, gives the logits of a full forward of each sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.cache import FlatMetadata, PagedKVCache
from jaxgen.model import init_params
from jaxgen.model.llama import Transformer
from tests.cache.test_paged_cache import CFG

PAGE, NUM_PAGES, ROWS, WIDTH, BUCKET = 4, 40, 8, 8, 32


def flat_step(chunks, tables):
    """Host-side FlatMetadata, tokens and positions for sequences given as (tokens of this
    step, tokens already cached), padded to BUCKET tokens and ROWS sequences."""
    tokens = np.zeros(BUCKET, np.int32)
    positions = np.zeros(BUCKET, np.int32)
    slots = np.full(BUCKET, -1, np.int32)
    cu = np.zeros(ROWS + 1, np.int32)
    seq_lens = np.zeros(ROWS, np.int32)
    page_tables = np.zeros((ROWS, WIDTH), np.int32)
    start = 0
    for s, (new, cached) in enumerate(chunks):
        n = len(new)
        pos = np.arange(cached, cached + n)
        tokens[start : start + n] = new
        positions[start : start + n] = pos
        slots[start : start + n] = tables[s][pos // PAGE] * PAGE + pos % PAGE
        start += n
        cu[s + 1] = start
        seq_lens[s] = cached + n
        page_tables[s, : len(tables[s])] = tables[s]
    cu[len(chunks) + 1 :] = start
    md = FlatMetadata(
        slot_mapping=jnp.asarray(slots),
        cu_q_lens=jnp.asarray(cu),
        seq_lens=jnp.asarray(seq_lens),
        page_tables=jnp.asarray(page_tables),
        num_seqs=jnp.asarray([len(chunks)], jnp.int32),
    )
    return jnp.asarray(tokens)[None], jnp.asarray(positions)[None], md


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_flat_step_matches_full_forward(impl):
    params = init_params(CFG, jax.random.key(0))
    rng = np.random.RandomState(3)
    # (cached before the mixed step, new in the mixed step) per sequence.
    plan = [(0, 7), (6, 5), (9, 1), (3, 1), (5, 4)]
    seqs = [rng.randint(1, CFG.vocab_size, c + n).astype(np.int32) for c, n in plan]
    perm = rng.permutation(NUM_PAGES)
    tables, used = [], 0
    for seq in seqs:
        need = -(-len(seq) // PAGE)
        tables.append(perm[used : used + need])
        used += need
    kv = PagedKVCache.init(CFG, NUM_PAGES, PAGE)
    unused = perm[used:]  # pages no sequence owns hold NaN
    kv = kv.replace(k=kv.k.at[:, unused].set(jnp.nan), v=kv.v.at[:, unused].set(jnp.nan))
    model = Transformer(CFG, attn_impl=impl)
    step = jax.jit(lambda t, p, kv, md: model.apply({"params": params}, t, p, kv, md))
    # Step 1 caches the contexts (itself a step of fresh prefills); step 2 is the mix.
    first = [(i, (seq[:c], 0)) for i, (seq, (c, _)) in enumerate(zip(seqs, plan, strict=True)) if c]
    tokens, positions, md = flat_step([ch for _, ch in first], [tables[i] for i, _ in first])
    logits1, kv = step(tokens, positions, kv, md)
    mixed = [(seq[c:], c) for seq, (c, _) in zip(seqs, plan, strict=True)]
    tokens, positions, md = flat_step(mixed, tables)
    logits2, kv = step(tokens, positions, kv, md)
    assert np.isfinite(np.asarray(logits2)).all()
    # One causal forward of every sequence, right-padded (padding after a token cannot reach it).
    longest = max(len(seq) for seq in seqs)
    batch = np.stack([np.pad(seq, (0, longest - len(seq))) for seq in seqs])
    full_logits = np.asarray(model.apply({"params": params}, jnp.asarray(batch))[0])
    start1 = start2 = 0
    for i, (seq, (c, n)) in enumerate(zip(seqs, plan, strict=True)):
        full = full_logits[i, : len(seq)]
        got = np.asarray(logits2[0, start2 : start2 + n])
        np.testing.assert_allclose(got, full[c:], atol=1e-5, rtol=0, err_msg=f"sequence {i}")
        start2 += n
        if c:
            got1 = np.asarray(logits1[0, start1 : start1 + c])
            np.testing.assert_allclose(got1, full[:c], atol=1e-5, rtol=0)
            start1 += c
