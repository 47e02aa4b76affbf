"""LLMEngine: the continuous-batching loop. The host scheduler composes a step, this module
packs it into device arrays (shapes padded to buckets), runs one jitted `paged_step`, and hands
the sampled tokens back. `LLM` and the server drive it through `add_request` / `step`."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from cache.block_manager import BlockManager
from cache.paged import PagedKVCache, RaggedMetadata
from engine import roofline, steps
from engine.config import EngineConfig
from engine.errors import CapacityError
from engine.sampling import SamplingArrays
from engine.scheduler import ScheduledStep, Scheduler

log = logging.getLogger("jaxgen.engine")

LOGPROB_BUCKETS = (0, 5, 20)  # top-n logprobs are computed for n padded to one of these


def logprob_bucket(n: int) -> int:
    return next(b for b in LOGPROB_BUCKETS if n <= b)


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


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def _uses_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class LLMEngine:
    """Paged KV cache + block manager + scheduler + the jitted packed step.

    Args:
      kv_cache_bytes: memory budget for the page pool; pages = budget / bytes_per_page (see
        `PagedKVCache.bytes_per_page`). `num_pages` overrides it.
      kv_quant: None, "int8" or "fp8" pages.
    """

    def __init__(
        self,
        cfg,
        params,
        engine_cfg: EngineConfig,
        *,
        dtype,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_quant: str | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 512,
        attn_impl: str | None = None,
        note_program=None,
    ):
        self.cfg, self.params, self.engine_cfg = cfg, params, engine_cfg
        self.dtype = jnp.dtype(dtype)
        self.attn_impl = attn_impl
        if num_pages is None:
            budget = kv_cache_bytes or default_kv_budget(roofline.param_bytes(params))
            num_pages = PagedKVCache.pages_for_budget(cfg, budget, page_size, self.dtype, kv_quant)
        if num_pages < 1:
            raise CapacityError(f"the KV cache budget holds no page of {page_size} tokens")
        self.kv = PagedKVCache.init(cfg, num_pages, page_size, self.dtype, kv_quant)
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.bm,
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            token_bucket=engine_cfg.token_bucket,
        )
        self.max_pages_per_seq = self.bm.pages_needed(engine_cfg.max_model_len)
        self._note_program = note_program or (lambda *key: None)
        self.weight_bytes = roofline.param_bytes(params)
        self.peak_pages_used = 0
        self.num_steps = 0
        self.tokens_generated = 0
        self.busy_time = 0.0
        self.last_step: dict = {}

    # ------------------------------------------------------------------------------------------
    def check_request(self, request) -> None:
        """Raises CapacityError if the request can never be served by this engine."""
        n = request.params.num_samples
        if n > self.engine_cfg.max_num_seqs:
            raise CapacityError(
                f"n/best_of={n} exceeds max_num_seqs={self.engine_cfg.max_num_seqs}"
            )
        self.scheduler.check_fits(len(request.prompt_ids), request.params.max_tokens)

    def add_request(self, request) -> None:
        self.check_request(request)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list:
        """Runs one scheduling iteration; returns [(Sequence, text delta)] for emitted tokens."""
        step = self.scheduler.schedule()
        self.peak_pages_used = max(self.peak_pages_used, self.bm.num_used_pages)
        if step.empty:
            if self.scheduler.has_work and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with free pages")  # a bug
            return []
        t0 = time.perf_counter()
        batch, sa, num_logprobs, prompt_logprobs, key = self._pack(step)
        self._note_program("paged_step", *key)
        info, prompt_info, self.kv = steps.paged_step(
            self.params,
            self.kv,
            batch,
            sa,
            cfg=self.cfg,
            num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs,
            attn_impl=self.attn_impl,
        )
        host = jax.device_get(info)
        if prompt_info is not None:
            self._record_prompt_logprobs(step, jax.device_get(prompt_info), batch.md)
        elapsed = time.perf_counter() - t0
        self._account(step, elapsed)

        def row_info(r):
            seq = (step.decode + step.prefill + step.samples)[r].state.seq
            n = seq.params.logprobs or 0
            top = list(
                zip(host.top_ids[r, :n].tolist(), host.top_logprobs[r, :n].tolist(), strict=True)
            )
            return float(host.logprobs[r]), int(host.ranks[r]), top

        events = list(self.scheduler.update(step, host.tokens, row_info))
        self.tokens_generated += len(events)
        return events

    # ------------------------------------------------------------------------------------------
    def _pack(self, step: ScheduledStep):
        """Host arrays for one step, padded to buckets (bounded number of programs)."""
        cfg, ecfg = self.cfg, self.engine_cfg
        ps = self.bm.page_size
        nd = ecfg.batch_bucket(len(step.decode)) if step.decode else 0
        if step.prefill:
            bp = _pow2(len(step.prefill))
            tp = ecfg.token_bucket(max(r.end - r.start for r in step.prefill))
        else:
            bp = tp = 0
        rows = step.decode + step.prefill + step.samples
        num_rows = ecfg.batch_bucket(len(rows))
        max_pages = _pow2(max(len(self.bm.tables[r.state.id]) for r in rows), 8)
        n = nd + bp * tp
        tokens = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        slots = np.full(n, -1, np.int32)
        dec_tables = np.zeros((nd, max_pages), np.int32)
        dec_lens = np.zeros(nd, np.int32)
        pre_tables = np.zeros((bp, max_pages), np.int32)
        pre_ctx = np.zeros(bp, np.int32)
        pre_new = np.zeros(bp, np.int32)
        logit_index = np.zeros(num_rows, np.int32)
        for i, row in enumerate(step.decode):
            s = row.state
            table = self.bm.tables[s.id]
            tokens[i] = s.tokens[row.start]
            positions[i] = row.start
            slots[i] = table[row.start // ps] * ps + row.start % ps
            dec_tables[i, : len(table)] = table
            dec_lens[i] = row.end
            logit_index[i] = i
        for p, row in enumerate(step.prefill):
            s = row.state
            table = self.bm.tables[s.id]
            base, length = nd + p * tp, row.end - row.start
            tokens[base : base + length] = s.tokens[row.start : row.end]
            positions[base : base + length] = np.arange(row.start, row.end)
            slots[base : base + length] = self.bm.slots(s.id, row.start, row.end)
            pre_tables[p, : len(table)] = table
            pre_ctx[p], pre_new[p] = row.start, length
            logit_index[len(step.decode) + p] = base + length - 1
        row_of = {id(r): i for i, r in enumerate(step.decode + step.prefill)}
        for j, row in enumerate(step.samples):
            logit_index[len(step.decode) + len(step.prefill) + j] = logit_index[
                row_of[id(row.sample_of)]
            ]
        md = RaggedMetadata(
            slot_mapping=slots,
            decode_tables=dec_tables,
            decode_seq_lens=dec_lens,
            prefill_tables=pre_tables,
            prefill_context=pre_ctx,
            prefill_num_new=pre_new,
            num_decode=nd,
            prefill_rows=bp,
            prefill_len=tp,
            prefill_fresh=all(r.start == 0 for r in step.prefill),
        )
        copies = np.zeros((2, _pow2(len(step.copies))), np.int32)
        if step.copies:
            copies[:, : len(step.copies)] = np.asarray(step.copies, np.int32).T

        params = [r.state.seq.params for r in rows] + [None] * (num_rows - len(rows))
        seqs = [r.state.seq for r in rows]
        row_step = np.zeros(num_rows, np.int32)
        block_stop = np.zeros(num_rows, bool)
        max_stop = max(len(s.stop_ids) for s in seqs)
        stop_ids = np.full((num_rows, _pow2(max_stop, 4)), cfg.vocab_size, np.int32)
        keys = np.zeros((num_rows, 2), np.uint32)
        for r, s in enumerate(seqs):
            row_step[r] = len(s.output_ids)
            block_stop[r] = len(s.output_ids) < s.params.min_tokens
            stop_ids[r, : len(s.stop_ids)] = sorted(s.stop_ids)
            keys[r] = s.key
        prompt_mask = counts = None
        penalties = any(_uses_penalties(s.params) for s in seqs)
        if penalties:
            prompt_mask = np.zeros((num_rows, cfg.vocab_size), bool)
            counts = np.zeros((num_rows, cfg.vocab_size), np.int32)
            for r, s in enumerate(seqs):
                prompt_mask[r, s.prompt_ids] = True
                np.add.at(counts[r], np.asarray(s.output_ids, np.int64), 1)
        batch = steps.StepBatch(
            tokens=tokens,
            positions=positions,
            md=md,
            copy_src=copies[0],
            copy_dst=copies[1],
            logit_index=logit_index,
            row_step=row_step,
            block_stop=block_stop,
            stop_ids=stop_ids,
            prompt_mask=prompt_mask,
            output_counts=counts,
        )
        wanted = [
            r.state.request.params.prompt_logprobs
            for r in step.prefill
            if self._wants_prompt_logprobs(r)
        ]
        prompt_logprobs = logprob_bucket(max(wanted)) if wanted else 0
        if wanted:
            prompt_logprobs = max(prompt_logprobs, 1)  # 1 even for prompt_logprobs=0 (the token)
            next_tokens = np.zeros(n, np.int32)
            for p, row in enumerate(step.prefill):
                toks = row.state.tokens
                base = nd + p * tp
                stop = min(row.end, len(toks) - 1)
                next_tokens[base : base + stop - row.start] = toks[row.start + 1 : stop + 1]
            batch = batch.replace(next_tokens=next_tokens)
        num_logprobs = logprob_bucket(max((s.params.logprobs or 0) for s in seqs))
        key = (
            nd,
            bp,
            tp,
            max_pages,
            num_rows,
            md.prefill_fresh,
            copies.shape[1],
            stop_ids.shape[1],
            num_logprobs,
            penalties,
            prompt_logprobs,
        )
        return batch, SamplingArrays.build(params, keys), num_logprobs, prompt_logprobs, key

    @staticmethod
    def _wants_prompt_logprobs(row) -> bool:
        """Prompt logprobs are recorded once per request, from its first (unpreempted) prefill."""
        s = row.state
        return (
            s.request.params.prompt_logprobs is not None
            and s.seq.index == 0
            and not s.seq.output_ids
        )

    def _record_prompt_logprobs(self, step, info, md) -> None:
        from engine.outputs import Logprob

        for p, row in enumerate(step.prefill):
            if not self._wants_prompt_logprobs(row):
                continue
            request = row.state.request
            k = request.params.prompt_logprobs
            entries = request.prompt_logprobs or [None]
            base = md.num_decode + p * md.prefill_len
            prompt_len = len(row.state.seq.prompt_ids)
            for i in range(row.start, min(row.end, prompt_len - 1)):
                j = base + i - row.start
                entry = {
                    int(t): Logprob(float(lp), r + 1)
                    for r, (t, lp) in enumerate(
                        zip(info.top_ids[j, :k], info.top_logprobs[j, :k], strict=True)
                    )
                }
                entry[int(info.tokens[j])] = Logprob(float(info.logprobs[j]), int(info.ranks[j]))
                entries.append(entry)
            request.prompt_logprobs = entries

    # ------------------------------------------------------------------------------------------
    def _account(self, step: ScheduledStep, elapsed: float) -> None:
        """Per-step roofline numerators (bytes, FLOPs) for the live MBU / MFU in `stats()`."""
        self.num_steps += 1
        self.busy_time += elapsed
        rows = step.decode + step.prefill
        context = sum(r.end for r in rows)
        pairs = sum((r.end - r.start) * (r.start + r.end + 1) // 2 for r in rows)
        cost = roofline.step_cost(
            self.cfg,
            self.weight_bytes,
            new_tokens=step.num_tokens,
            context_tokens=context,
            kv_itemsize=self.kv.k.dtype.itemsize,
            attended_pairs=pairs,
        )
        self.last_step = {
            "seconds": elapsed,
            "tokens": step.num_tokens,
            "decode_rows": len(step.decode),
            "prefill_rows": len(step.prefill),
            **cost,
        }

    def stats(self, limits: dict | None = None) -> dict:
        """Engine-wide counters, plus the last step's achieved bandwidth and FLOP rate as
        fractions of the machine's roofline (`limits`: read_gbps and peak GFLOP/s)."""
        out = self.scheduler.stats()
        out.update(
            steps=self.num_steps,
            tokens_generated=self.tokens_generated,
            peak_pages_used=self.peak_pages_used,
            tokens_per_s=self.tokens_generated / self.busy_time if self.busy_time else 0.0,
            kv_cache_bytes=self.kv.nbytes,
        )
        last = self.last_step
        if last:
            gbps = last["bytes"] / last["seconds"] / 1e9
            gflops = last["flops"] / last["seconds"] / 1e9
            out.update(step_gbps=gbps, step_gflops=gflops)
            if limits:
                peak = limits["bf16_gflops"] if self.dtype == jnp.bfloat16 else limits["f32_gflops"]
                out.update(mbu=gbps / limits["read_gbps"], mfu=gflops / peak)
        return out
