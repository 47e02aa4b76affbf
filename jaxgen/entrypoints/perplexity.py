"""Perplexity with a sliding window (the strided evaluation of HF's perplexity guide).

Windows of `max_length` tokens start every `stride` tokens; each window scores only the tokens
no earlier window scored, so every token after the first is scored exactly once, with up to
``max_length - stride`` tokens of context carried over.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.model.llama import Transformer


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"))
def token_nll(params, tokens, *, cfg, attn_impl=None):
    """f32[B, T-1]: negative log-likelihood of tokens[:, 1:] given their prefixes."""
    logits, _ = Transformer(cfg, attn_impl).apply({"params": params}, tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def windows(num_tokens: int, max_length: int, stride: int):
    """Yields (begin, end, first_scored) for each window; tokens first_scored..end-1 are scored."""
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == num_tokens:
            break


PAGE_SIZE = 16
KV_CHUNK = 128  # tokens per step when K/V go through a (quantized) page pool


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"), donate_argnames=("kv",))
def _paged_chunk_nll(params, kv, tokens, next_tokens, md, *, cfg, attn_impl=None):
    """NLL of next_tokens [1, C] after a chunk whose attention reads K/V back from the pool."""
    positions = md.context_lens[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits, kv = Transformer(cfg, attn_impl).apply({"params": params}, tokens, positions, kv, md)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, next_tokens[..., None], axis=-1)[..., 0], kv


def _window_nll_paged(cfg, params, kv, window, attn_impl):
    """Per-token NLL of one window, fed in chunks through the page pool (every attention,
    the chunk's own keys included, reads K/V after the pool's quantization)."""
    from jaxgen.cache.paged import PagedMetadata

    n = len(window)
    table = jnp.arange(kv.num_pages, dtype=jnp.int32)[None]
    out = []
    for start in range(0, n - 1, KV_CHUNK):
        end = min(start + KV_CHUNK, n - 1)
        chunk = np.zeros((1, KV_CHUNK), np.int32)
        nxt = np.zeros((1, KV_CHUNK), np.int32)
        chunk[0, : end - start] = window[start:end]
        nxt[0, : end - start] = window[start + 1 : end + 1]
        slots = np.full((1, KV_CHUNK), -1, np.int32)
        slots[0, : end - start] = np.arange(start, end)
        md = PagedMetadata(
            jnp.asarray(slots),
            table,
            jnp.asarray([start], jnp.int32),
            jnp.asarray([end - start], jnp.int32),
            fresh=False,
        )
        nll, kv = _paged_chunk_nll(
            params, kv, jnp.asarray(chunk), jnp.asarray(nxt), md, cfg=cfg, attn_impl=attn_impl
        )
        out.append(np.asarray(nll)[0, : end - start])
    return np.concatenate(out), kv


def perplexity(
    cfg,
    params,
    token_ids,
    *,
    max_length=1024,
    stride=512,
    progress=False,
    attn_impl=None,
    kv_quant: str | None = None,
) -> dict:
    """Sliding-window perplexity of `token_ids` (a 1-D sequence).

    Args:
      kv_quant: None (attention on full-precision K/V), or "int8" / "fp8": every window is fed
        in chunks through a quantized page pool, so attention sees the quantized cache.
    Returns:
      {"perplexity": float, "nll": mean NLL per scored token, "tokens": tokens scored}.
    """
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim != 1 or ids.size < 2:
        raise ValueError(f"perplexity needs a 1-D sequence of >= 2 tokens, got shape {ids.shape}")
    if not 0 < stride <= max_length:
        raise ValueError(f"need 0 < stride <= max_length, got {stride=} {max_length=}")
    max_length = min(max_length, ids.size)
    spans = list(windows(ids.size, max_length, stride))
    bar = None
    if progress:
        from tqdm import tqdm

        # tqdm's estimate (elapsed<remaining) is there from the second window; the first one
        # also compiles the scoring step.
        bar = spans = tqdm(
            spans,
            desc=f"perplexity over {ids.size} tokens ({max_length}-token windows, stride {stride})",
            unit="window",
        )
    kv = None
    if kv_quant is not None:
        from jaxgen.cache.paged import PagedKVCache

        dtype = params["embed"].dtype
        kv = PagedKVCache.init(cfg, -(-max_length // PAGE_SIZE), PAGE_SIZE, dtype, kv_quant)
    total, count = 0.0, 0
    for begin, end, first in spans:
        if kv is not None:
            nll, kv = _window_nll_paged(cfg, params, kv, ids[begin:end], attn_impl)
        else:
            window = np.zeros((1, max_length), np.int32)  # one shape for every window
            window[0, : end - begin] = ids[begin:end]
            nll = np.asarray(token_nll(params, jnp.asarray(window), cfg=cfg, attn_impl=attn_impl))[
                0
            ]
        # nll[j] scores token begin + j + 1.
        scored = nll[first - begin - 1 : end - begin - 1].astype(np.float64)
        total += float(scored.sum())
        count += scored.size
        if bar is not None:
            bar.set_postfix(ppl=f"{math.exp(total / count):.3f}")
    mean = total / count
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": count}
