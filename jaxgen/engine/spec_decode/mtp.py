"""The multi-token-prediction drafter ("mtp"): DeepSeek-V3's MTP module (`model.mtp`) proposes k
tokens, which the engine verifies like any other drafter's (lossless: Leviathan et al. Alg. 1).

The module needs the main model's hidden state h_i at each position. This drafter computes them
itself: it mirrors the target's sequences in a latent page pool of num_layers + 1 layers (the
main layers, then the module's), catches up on the tokens it has not seen with the main layers
and the module in one forward (positions c..n-1 of t_0..t_n: h_i from t_i, the module's entry
from h_i and t_{i+1}), drafts d_1 from the module's output at n - 1, then d_2..d_k recursively
(module output g and the previous draft at the next position). So each step costs the drafter
one forward of the main layers over the newly accepted tokens: the handoff of the verify step's
own hidden states, which would remove that cost, is not built.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.engine.sample.sampling import SamplingArrays, argmax, processed_logprobs
from jaxgen.engine.spec_decode.speculative import ModelDrafter, pack_draft_rows


@functools.partial(
    jax.jit, static_argnames=("cfg", "catch_up", "attn_impl"), donate_argnames=("kv",)
)
def mtp_draft_step(
    params,
    kv,
    tokens,
    next_tokens,
    hidden,
    positions,
    md,
    logit_index,
    sa: SamplingArrays,
    step,
    *,
    cfg,
    catch_up,
    attn_impl=None,
):
    """One drafter forward over packed tokens. catch_up: the main layers make the hidden states
    from `tokens` (else `hidden` [N, D] is the module's previous output). Returns (tokens i32[R],
    log q f32[R, V], the module's output at each row's last token [R, D], kv)."""
    from jaxgen.model.mtp import gather_rows, mtp_block, mtp_logits, trunk

    if catch_up:
        h, kv = trunk(cfg, params, tokens[None], positions[None], kv, md, attn_impl)
    else:
        h = hidden[None]
    g, kv = mtp_block(cfg, params, h, next_tokens[None], positions[None], kv, md, attn_impl)
    logits = mtp_logits(cfg, params, g, logit_index[None])[0]
    logq = processed_logprobs(logits, sa, None, None)

    def draw(key_data, s, lq):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), 0xD6), s)
        return argmax((lq + jax.random.gumbel(key, lq.shape))[None])[0]

    token = jax.vmap(draw)(sa.keys, step, logq)
    token = jnp.where(sa.temperature > 0, token, argmax(logq)).astype(jnp.int32)
    g_last = gather_rows(jnp.broadcast_to(g, (logit_index.shape[0], *g.shape[1:])), logit_index)
    return token, logq, g_last, kv


class MTPDrafter(ModelDrafter):
    """See the module docstring. Shares the target's weights (params["mtp"] holds the module)."""

    def __init__(self, cfg, params, dtype, page_size: int, num_pages: int, buckets, placement=None):
        from jaxgen.cache.block_manager import BlockManager
        from jaxgen.cache.mla import PagedMLACache

        if cfg.mla is None:
            raise ValueError("the MTP drafter runs DeepSeek-V3-style (MLA) models only")
        self.cfg, self.params, self.buckets = cfg, params, buckets
        shape = (cfg.num_layers + 1, num_pages, page_size, cfg.mla.latent_dim)
        self.kv = PagedMLACache(entries=jnp.zeros(shape, dtype))
        if placement is not None:
            self.kv = placement.cache(self.kv)
        self.placement = placement
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.computed: dict = {}  # seq id -> leading positions with right entries in every layer

    def _run_mtp(self, rows, sa, step, table_pages, hidden_rows=None):
        """rows: [(seq id, tokens, next tokens, first position)]; hidden_rows: [R, D] the
        module's previous outputs (one token per row), or None to catch up with the main layers.
        Returns (tokens [R], logq [R, V], module outputs [R, D])."""
        plain = [(sid, feed, first) for sid, feed, _, first in rows]
        tokens, positions, md, logit_index, sa, step, width = pack_draft_rows(
            self.bm, self.buckets, plain, sa, step, table_pages
        )
        next_tokens = np.zeros_like(tokens)
        hidden = np.zeros((len(tokens), self.cfg.hidden_size), np.float32)
        for r, (_, feed, nxt, _) in enumerate(rows):
            next_tokens[r * width : r * width + len(feed)] = nxt
            if hidden_rows is not None:
                hidden[r * width] = hidden_rows[r]
        with self.placement.context() if self.placement else contextlib.nullcontext():
            token, logq, g, self.kv = mtp_draft_step(
                self.params,
                self.kv,
                tokens,
                next_tokens,
                jnp.asarray(hidden, self.kv.entries.dtype),
                positions,
                md,
                logit_index,
                sa,
                step,
                cfg=self.cfg,
                catch_up=hidden_rows is None,
            )
        return token[: len(rows)], logq[: len(rows)], np.asarray(g[: len(rows)])

    def propose(self, states, k: int, sa: SamplingArrays):
        """Drafts k tokens for each sequence (rows of `sa` in the same order); returns what
        `ModelDrafter.propose` does."""
        live = [i for i, s in enumerate(states) if self._ensure(s)]
        if not live:
            return {}, None, {}
        states = [states[i] for i in live]
        sa = jax.tree.map(lambda a: np.asarray(a)[live], sa)
        drafted = {s.id: [] for s in states}
        logqs, g = [], None
        for i in range(k):
            rows = []
            for s in states:
                last = len(s.tokens) - 1  # n: t_n is the newest token
                if i == 0:
                    start = self.computed[s.id]
                    rows.append((s.id, s.tokens[start:last], s.tokens[start + 1 :], start))
                    continue
                # Position n - 1 + i: needs slots for n + i tokens (drafts appended as needed).
                while len(self.bm.tokens[s.id]) < last + 1 + i:
                    pending = drafted[s.id][len(self.bm.tokens[s.id]) - last - 1]
                    if self.bm.append(s.id, pending) is None:
                        return self._finish(states, drafted, logqs, live)
                rows.append((s.id, [0], [drafted[s.id][-1]], last - 1 + i))
            pages = 1 << max(max(len(self.bm.tables[s.id]) for s in states) - 1, 0).bit_length()
            step = np.asarray([len(s.seq.output_ids) + i for s in states], np.int32)
            token, logq, g = self._run_mtp(rows, sa, step, max(pages, 8), g if i else None)
            for s, t in zip(states, np.asarray(token).tolist(), strict=True):
                drafted[s.id].append(int(t))
            logqs.append(logq)
        return self._finish(states, drafted, logqs, live)

    def _finish(self, states, drafted, logqs, live):
        k = len(logqs)
        for s in states:  # every layer is right at positions < n (the recursive entries are not)
            self.computed[s.id] = len(s.tokens) - 1
            drafted[s.id] = drafted[s.id][:k]
        logq = jnp.stack(logqs, axis=1) if logqs else None
        return drafted, logq, {s.id: r for r, s in enumerate(states)}
