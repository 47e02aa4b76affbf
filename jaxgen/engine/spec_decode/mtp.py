"""The multi-token-prediction drafter ("mtp"): DeepSeek-V3's MTP module (`model.mtp`) proposes k
tokens, which the engine verifies like any other drafter's (lossless: Leviathan et al. Alg. 1).

The module needs the main model's hidden state h_i at each position. The target's own steps hand
them over (as vLLM's and SGLang's MTP proposers take them): with this drafter the engine's
`paged_step` also returns every packed token's last hidden state, which stays on the device, and
`hand_over` keeps the newest step's with where each sequence's tokens sit. A sequence that has
accepted tokens t_c..t_{n-1} since the drafter last ran (its verify row's accepted prefix, or a
prefill) reads h_c..h_{n-1} from them: the module's entries at positions c..n-1 (h_i with
t_{i+1}) in one forward, d_1 from its output at n - 1, then d_2..d_k recursively (the module's
normalised output and the previous draft at the next position). So the drafter never runs the
main layers -- unless the handed-over states do not cover a sequence's new positions (a prompt
prefilled in chunks or from cached pages, a structured-output step): the drafter then
recomputes h_0..h_{n-1} with the main layers over the whole sequence, in its own latent page
pool of num_layers + 1 layers (the main layers, then the module's).
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
    hidden_index,
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
    """One drafter forward over packed tokens. The module reads the hidden state
    `hidden[hidden_index[j]]` at packed token j (hidden [M, D]: the target's handed-over states
    or the module's previous outputs; index -1: padding), or with catch_up, the main layers make
    them from `tokens` (hidden unused). Returns (tokens i32[R], log q f32[R, V], the module's
    normalised output at each row's last token [R, D], kv)."""
    from jaxgen.model.mtp import mtp_block, mtp_norm, shared_head, trunk

    if catch_up:
        h, kv = trunk(cfg, params, tokens[None], positions[None], kv, md, attn_impl)
    else:
        rows = hidden[jnp.maximum(hidden_index, 0)]
        h = jnp.where(hidden_index[:, None] >= 0, rows, jnp.zeros_like(rows))[None]
    g, kv = mtp_block(cfg, params, h, next_tokens[None], positions[None], kv, md, attn_impl)
    out = mtp_norm(cfg, params, g[0, logit_index])
    logq = processed_logprobs(shared_head(cfg, params, out), sa, None, None)

    def draw(key_data, s, lq):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key_data), 0xD6), s)
        return argmax((lq + jax.random.gumbel(key, lq.shape))[None])[0]

    token = jax.vmap(draw)(sa.keys, step, logq)
    token = jnp.where(sa.temperature > 0, token, argmax(logq)).astype(jnp.int32)
    return token, logq, out, kv


class MTPDrafter(ModelDrafter):
    """See the module docstring. Shares the target's weights (params["mtp"] holds the module)."""

    handoff = True  # the engine hands over its steps' hidden states (`hand_over`)

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
        # seq id -> leading positions whose module entries are right (the main layers' entries
        # are right only after a recomputation, which always starts at position 0)
        self.computed: dict = {}
        self._handed = None  # the last step's (hidden [N, D] on the device, token spans)
        self._no_hidden = jnp.zeros((1, cfg.hidden_size), dtype)

    def hand_over(self, hidden, spans: dict) -> None:
        """The engine's newest step: every packed token's hidden state after the final norm
        ([N, D], on the device; None if the step returned none) and where each sequence's tokens
        sit ({seq id: (first packed index, first position, count)}: `runner.shapes.token_spans`).
        Replaces the previous step's, which no later proposal may read: its rejected drafts'
        positions hold other tokens' states."""
        self._handed = None if hidden is None else (hidden, spans)

    def _run_mtp(self, rows, sa, step, hidden, index):
        """rows: [(seq id, tokens, next tokens, first position)]; hidden: [M, D] states on the
        device and index: per row, the rows of `hidden` its tokens read; hidden None: the main
        layers recompute them. Returns (tokens [R], logq [R, V], module outputs [R, D])."""
        plain = [(sid, feed, first) for sid, feed, _, first in rows]
        pages = 1 << max(max(len(self.bm.tables[sid]) for sid, _, _ in plain) - 1, 0).bit_length()
        tokens, positions, md, logit_index, sa, step, width = pack_draft_rows(
            self.bm, self.buckets, plain, sa, step, max(pages, 8)
        )
        next_tokens = np.zeros_like(tokens)
        hidden_index = np.full(len(tokens), -1, np.int32)
        for r, (_, feed, nxt, _) in enumerate(rows):
            next_tokens[r * width : r * width + len(feed)] = nxt
            if hidden is not None:
                hidden_index[r * width : r * width + len(feed)] = index[r]
        with self.placement.context() if self.placement else contextlib.nullcontext():
            token, logq, out, self.kv = mtp_draft_step(
                self.params,
                self.kv,
                tokens,
                next_tokens,
                self._no_hidden if hidden is None else hidden,
                hidden_index,
                positions,
                md,
                logit_index,
                sa,
                step,
                cfg=self.cfg,
                catch_up=hidden is None,
            )
        return token[: len(rows)], logq[: len(rows)], out[: len(rows)]

    def _first(self, states, sa, step):
        """The first draft of each sequence, from the handed-over hidden states where they
        cover the positions it has not seen, else from a recomputation of all of them."""
        handed, self._handed = self._handed, None
        hidden, spans = handed if handed is not None else (None, {})
        groups = {True: [], False: []}  # handed over: [(state row, mtp row, hidden rows)]
        for j, s in enumerate(states):
            n = len(s.tokens) - 1  # t_n is the newest token
            c = min(self.computed[s.id], n - 1)
            first, start, count = spans.get(s.id, (0, n, 0))
            if start <= c and n <= start + count:
                index = np.arange(first + c - start, first + n - start)
                groups[True].append((j, (s.id, s.tokens[c:n], s.tokens[c + 1 : n + 1], c), index))
            else:
                groups[False].append((j, (s.id, s.tokens[:n], s.tokens[1 : n + 1], 0), None))
        results = []
        for handed_over, group in groups.items():
            if group:
                js = np.asarray([j for j, _, _ in group])
                sub = jax.tree.map(lambda a, js=js: a[js], sa)
                rows, index = [r for _, r, _ in group], [i for _, _, i in group]
                out = self._run_mtp(rows, sub, step[js], hidden if handed_over else None, index)
                results.append((js, out))
        if len(results) == 1:
            return results[0][1]
        order = np.argsort(np.concatenate([js for js, _ in results]))
        (_, a), (_, b) = results
        return tuple(jnp.concatenate(pair)[order] for pair in zip(a, b, strict=True))

    def propose(self, states, k: int, sa: SamplingArrays):
        """Drafts k tokens for each sequence (rows of `sa` in the same order); returns what
        `ModelDrafter.propose` does."""
        live = [i for i, s in enumerate(states) if self._ensure(s)]
        if not live:
            self._handed = None
            return {}, None, {}
        states = [states[i] for i in live]
        sa = jax.tree.map(lambda a: np.asarray(a)[live], sa)
        drafted = {s.id: [] for s in states}
        logqs, out = [], None
        for i in range(k):
            step = np.asarray([len(s.seq.output_ids) + i for s in states], np.int32)
            if i == 0:
                token, logq, out = self._first(states, sa, step)
            else:
                rows = []
                for s in states:
                    last = len(s.tokens) - 1
                    # Position n - 1 + i: needs slots for n + i tokens (drafts appended as needed).
                    while len(self.bm.tokens[s.id]) < last + 1 + i:
                        pending = drafted[s.id][len(self.bm.tokens[s.id]) - last - 1]
                        if self.bm.append(s.id, pending) is None:
                            return self._finish(states, drafted, logqs, live)
                    rows.append((s.id, [0], [drafted[s.id][-1]], last - 1 + i))
                index = [np.asarray([r]) for r in range(len(rows))]  # row r's previous output
                token, logq, out = self._run_mtp(rows, sa, step, out, index)
            for s, t in zip(states, np.asarray(token).tolist(), strict=True):
                drafted[s.id].append(int(t))
            logqs.append(logq)
        return self._finish(states, drafted, logqs, live)

    def _finish(self, states, drafted, logqs, live):
        k = len(logqs)
        for s in states:  # the module's entries are right at positions < n (recursive ones not)
            self.computed[s.id] = len(s.tokens) - 1
            drafted[s.id] = drafted[s.id][:k]
        logq = jnp.stack(logqs, axis=1) if logqs else None
        return drafted, logq, {s.id: r for r, s in enumerate(states)}
