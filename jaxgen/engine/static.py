"""Static batching over the contiguous cache: a batch of sequences is prefilled together and
decoded in `decode_loop` chunks until every row has finished; then the next batch. Pipeline
stages run GPipe over the batch's rows, and data-parallel replicas take batches in turn.
Kept beside the continuous engine (`engine.core`) for the jobs where it is faster; see
docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.contiguous import KVCache
from jaxgen.engine.outputs import Logprob
from jaxgen.engine.request import Request
from jaxgen.engine.runner import steps
from jaxgen.engine.runner.shapes import logprob_bucket
from jaxgen.engine.sample.sampling import SamplingArrays
from jaxgen.engine.sched.sequence import Sequence
from jaxgen.errors import InvalidSamplingParams
from jaxgen.sharding.rules import to_host


class StaticBatchEngine:
    """Runs requests in static batches of at most `max_num_seqs` sequences.

    Args:
      replicas: [(placement or None, params)]; batch i runs on replica i mod len(replicas).
      note_program: called with each program's key before it runs (compile accounting).
    """

    def __init__(self, cfg, engine_cfg, replicas, *, dtype, attn_impl=None, note_program=None):
        self.cfg, self.engine_cfg = cfg, engine_cfg
        self.replicas = replicas
        self.dtype = jnp.dtype(dtype)
        self.attn_impl = attn_impl
        self._note_program = note_program or (lambda *key: None)

    def run(self, requests: list[Request], decode_steps: int) -> Iterator[tuple[Sequence, str]]:
        """Yields (sequence, text delta) for every token, batch after batch."""
        if any(r.params.structured is not None for r in requests):
            # The fused decode loop samples many tokens on the device between host visits.
            raise InvalidSamplingParams(
                "structured outputs need the paged engine (kv_cache='paged', the default); "
                "static batches over the contiguous cache sample without the host"
            )
        rows = [(r, s) for r in requests for s in r.seqs]
        size = self.engine_cfg.max_num_seqs
        for i, start in enumerate(range(0, len(rows), size)):
            placement, params = self.replicas[i % len(self.replicas)]
            with placement.context() if placement else contextlib.nullcontext():
                yield from self._run_batch(
                    rows[start : start + size], decode_steps, placement, params
                )

    def _run_batch(self, rows, decode_steps, placement, params) -> Iterator[tuple[Sequence, str]]:
        cfg, ecfg = self.cfg, self.engine_cfg
        num = len(rows)
        batch = ecfg.batch_bucket(num)
        if placement is not None and placement.pipeline is not None:
            m = placement.pipeline.microbatches  # padding rows fill the last microbatch
            batch = -(-batch // m) * m
        prompt_lens = np.zeros(batch, np.int32)
        prompt_lens[:num] = [len(s.prompt_ids) for _, s in rows]
        num_tokens = ecfg.token_bucket(int(prompt_lens.max()))
        cache_len = ecfg.token_bucket(max(len(s.prompt_ids) + s.params.max_tokens for _, s in rows))
        tokens = np.zeros((batch, num_tokens), np.int32)
        prompt_mask = np.zeros((batch, cfg.vocab_size), bool)
        for i, (_, s) in enumerate(rows):
            tokens[i, : len(s.prompt_ids)] = s.prompt_ids
            prompt_mask[i, s.prompt_ids] = True
        want_prompt_lp = [r.params.prompt_logprobs is not None for r, _ in rows]
        num_logprobs = logprob_bucket(max((s.params.logprobs or 0) for _, s in rows))

        now = time.perf_counter()
        for r, _ in rows:
            r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or now
        kv = KVCache.init(cfg, batch, cache_len, self.dtype)
        pipeline = None
        if placement is not None:
            kv = placement.cache(kv)
            pipeline = placement.pipeline
        all_logits = any(want_prompt_lp)
        self._note_program(
            "prefill",
            f"{batch}x{num_tokens}",
            f"cache {cache_len}",
            "all logits" if all_logits else "last logits",
        )
        logits, kv = steps.prefill(
            params,
            jnp.asarray(tokens),
            jnp.asarray(prompt_lens),
            kv,
            cfg=cfg,
            attn_impl=self.attn_impl,
            all_logits=all_logits,
            pipeline=pipeline,
        )
        if all_logits:
            self._record_prompt_logprobs(rows, logits, tokens)
            logits = logits[jnp.arange(batch), jnp.maximum(jnp.asarray(prompt_lens) - 1, 0)]

        max_stop = max(len(s.stop_ids) for _, s in rows)
        stop_ids = np.full(
            (batch, max(4, 1 << (max_stop - 1).bit_length())), cfg.vocab_size, np.int32
        )
        for i, (_, s) in enumerate(rows):
            stop_ids[i, : len(s.stop_ids)] = sorted(s.stop_ids)
        state = steps.DecodeState.create(
            cfg.vocab_size,
            max_tokens=[s.params.max_tokens for _, s in rows] + [1] * (batch - num),
            min_tokens=[s.params.min_tokens for _, s in rows] + [0] * (batch - num),
            stop_ids=stop_ids,
            live=np.arange(batch) < num,
            prompt_mask=prompt_mask,
        )
        keys = np.zeros((batch, 2), np.uint32)
        keys[:num] = [s.key for _, s in rows]
        sa = SamplingArrays.build([s.params for _, s in rows] + [None] * (batch - num), keys)

        self._note_program("sample", f"batch {batch}", f"top-{num_logprobs} logprobs")
        state, info = steps.sample_tokens(logits, state, sa, num_logprobs=num_logprobs)
        yield from self._deliver(rows, jax.tree.map(lambda x: x[None], info), 1)
        while True:
            finished = np.array([s.finished for _, s in rows] + [True] * (batch - num))
            if finished.all():
                break
            # Stop strings are found on the host: tell the device those rows are done.
            state = state.replace(done=state.done | jnp.asarray(finished))
            self._note_program(
                "decode",
                f"batch {batch}",
                f"cache {cache_len}",
                f"{decode_steps} steps",
                f"top-{num_logprobs} logprobs",
            )
            outs, kv, state, n = steps.decode_loop(
                params,
                kv,
                state,
                sa,
                cfg=cfg,
                num_steps=decode_steps,
                num_logprobs=num_logprobs,
                attn_impl=self.attn_impl,
                pipeline=pipeline,
            )
            yield from self._deliver(rows, outs, int(to_host(n)))

    def _deliver(self, rows, info, num_steps) -> Iterator[tuple[Sequence, str]]:
        """Hands the sampled tokens of `num_steps` steps to their sequences (host)."""
        host = to_host(info)
        now = time.perf_counter()
        for step in range(num_steps):
            for i, (req, seq) in enumerate(rows):
                token = int(host.tokens[step, i])
                if seq.finished or token < 0:
                    continue
                n = seq.params.logprobs or 0
                top = list(
                    zip(
                        host.top_ids[step, i, :n].tolist(),
                        host.top_logprobs[step, i, :n].tolist(),
                        strict=True,
                    )
                )
                delta = seq.append(
                    token, float(host.logprobs[step, i]), int(host.ranks[step, i]), top, now
                )
                if seq.finished:
                    req.metrics.finished_time = now if req.finished else req.metrics.finished_time
                yield seq, delta

    def _record_prompt_logprobs(self, rows, logits, tokens):
        n = logprob_bucket(max((r.params.prompt_logprobs or 0) for r, _ in rows))
        info = to_host(steps.prompt_token_logprobs(logits, jnp.asarray(tokens), num_logprobs=n))
        for i, (req, seq) in enumerate(rows):
            if req.params.prompt_logprobs is None or seq.index != 0:
                continue
            k = req.params.prompt_logprobs
            entries: list[dict[int, Logprob] | None] = [None]
            for t in range(len(req.prompt_ids) - 1):
                token = int(info.tokens[i, t])
                entry = {
                    int(tid): Logprob(float(lp), r + 1)
                    for r, (tid, lp) in enumerate(
                        zip(info.top_ids[i, t, :k], info.top_logprobs[i, t, :k], strict=True)
                    )
                }
                entry[token] = Logprob(float(info.logprobs[i, t]), int(info.ranks[i, t]))
                entries.append(entry)
            req.prompt_logprobs = entries
