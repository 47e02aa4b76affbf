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

from model.llama import Transformer


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


def perplexity(
    cfg, params, token_ids, *, max_length=1024, stride=512, progress=False, attn_impl=None
) -> dict:
    """Sliding-window perplexity of `token_ids` (a 1-D sequence).

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
    if progress:
        from tqdm import tqdm

        spans = tqdm(spans, desc="perplexity", unit="window")
    total, count = 0.0, 0
    for begin, end, first in spans:
        window = np.zeros((1, max_length), np.int32)  # one shape for every window: one compile
        window[0, : end - begin] = ids[begin:end]
        nll = np.asarray(token_nll(params, jnp.asarray(window), cfg=cfg, attn_impl=attn_impl))[0]
        # nll[j] scores token begin + j + 1.
        scored = nll[first - begin - 1 : end - begin - 1].astype(np.float64)
        total += float(scored.sum())
        count += scored.size
    mean = total / count
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": count}


def read_text_tokens(tokenizer, path: str, max_tokens: int | None = None) -> list[int]:
    """Tokenizes a text file (no special tokens), keeping the first `max_tokens` tokens."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:max_tokens] if max_tokens else ids
