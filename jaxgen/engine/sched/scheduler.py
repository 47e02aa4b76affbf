"""Continuous batching (Orca-style iteration-level scheduling) over the paged KV cache.

Host side only: plain Python and numpy, no JAX. Each call to `schedule()` composes one device
step under a token budget and a sequence budget:

1. every running sequence that is decoding gets its next token's slot (copy-on-write if its
   last page is shared); if no page is free, the newest running sequence is preempted
   (recompute: its pages are freed and it re-enters the front of the waiting queue with its
   prompt and the tokens it already generated);
2. running sequences in the middle of a chunked prefill get their next chunk;
3. waiting requests are admitted first-come-first-served while pages and budgets allow, reusing
   cached prefix pages; a long prompt is split into chunks so decodes never wait for more than
   one chunk. Only a step's first prefill row is chunked at the budget: a prompt that would be
   cut to an earlier row's chunk length waits to lead a later step, whole (`_cut_short`). A
   request with a LoRA adapter is admitted once the adapter has a slot of the engine's stack;
   if every slot is pinned by running sequences' adapters it keeps its place and later
   requests go ahead (vLLM's `max_loras` rule).

`launch()` records that a step was dispatched (its K/V are being written; each row that samples
leaves its sequence one *pending* token, whose slot the next step may already reserve), and
`update()` hands the sampled tokens back to their sequences and retires finished ones at once,
so their slots refill on the next step. Between the two the engine may schedule, pack and
dispatch the next step (the overlapped loop): a pending token is decoded from the device's
copy of it, and a sequence that turns out to have finished costs one wasted row.

A request with n > 1 samples is prefilled once; its other samples fork the prompt's pages
(copy-on-write) and sample their first token from the same logits row.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterator

import numpy as np

from jaxgen.cache.block_manager import BlockManager
from jaxgen.engine.sched import beam
from jaxgen.engine.sched.sequence import FINISHED, RUNNING, WAITING, Sequence
from jaxgen.engine.sched.state import Row, ScheduledStep, SeqState
from jaxgen.errors import CapacityError

PREFETCH_AHEAD = 4  # waiting requests whose tier prefixes are read ahead of their admission


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_rows: int | None = None,
        token_bucket=lambda n: n,
        adapters=None,
        fixed_chunk: int | None = None,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if fixed_chunk is not None and not 1 <= fixed_chunk <= max_num_batched_tokens:
            raise ValueError(f"fixed_chunk {fixed_chunk} not in [1, {max_num_batched_tokens}]")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_rows = max_prefill_rows
        self.token_bucket = token_bucket
        # `engine.lora.AdapterSlots` (None: no LoRA): `acquire(lora, in_use) -> bool`.
        self.adapters = adapters
        # Batch-invariant scheduling: every prompt is prefilled in chunks [i*C, (i+1)*C) whatever
        # else is waiting, and a step holds decodes only or prefill chunks only (each kind then
        # runs as one program shape); the two kinds alternate while both have work.
        self.fixed_chunk = fixed_chunk
        self._last_was_prefill = False
        self.waiting: collections.deque[SeqState] = collections.deque()
        self.running: list[SeqState] = []
        self.requests: dict[str, list[SeqState]] = {}
        self.num_preemptions = 0
        # Prefixes in the KV tiers are read on the prefetch thread while other requests run
        # (`BlockManager.prefetch`); False: read at admission, in the step. The engine sets
        # it (`kv_prefetch`).
        self.prefetch_tiers = True
        # False while the engine is paused or asleep: waiting sequences stay waiting.
        self.admitting = True

    # ------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raises CapacityError for a sequence that could never fit the whole page pool."""
        need = self.bm.pages_needed(prompt_len + max_tokens)
        if need > self.bm.num_pages:
            raise CapacityError(
                f"a sequence of {prompt_len} prompt tokens + max_tokens={max_tokens} needs {need} "
                f"KV pages but the cache has {self.bm.num_pages}; shorten the request or give "
                "the engine a larger KV cache budget"
            )

    def add(self, request) -> None:
        """Queues every sequence of a request (FCFS). n > 1 siblings wait for the primary."""
        states = [SeqState(s, request) for s in request.seqs]
        for sibling in states[1:]:
            sibling.fork_from = states[0]
        self.requests[request.request_id] = states
        self.waiting.append(states[0])

    def abort(self, request_id: str) -> bool:
        """Stops a request now and frees its pages; False if it is unknown or already done."""
        states = self.requests.pop(request_id, None)
        if states is None:
            return False
        for s in states:
            if s.status == RUNNING:
                self.running.remove(s)
                self.bm.free(s.id)
            elif s in self.waiting:
                self.waiting.remove(s)
                self.bm.cancel_prefetch(s.id)
            s.status = FINISHED
            s.seq.abort()
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt_running(self) -> int:
        """Frees every running sequence's pages and queues it to recompute (its K/V came from
        weights since replaced, or from a pool since freed). Returns how many."""
        n = len(self.running)
        while self.running:
            self._preempt(self.running[-1], ScheduledStep([], [], [], []))
        return n

    # ------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------
    def _preempt(self, victim: SeqState, step: ScheduledStep) -> None:
        """Frees `victim`'s pages and queues it at the front to recompute. A beam-search
        request's beams go together (the search advances all of them at once, and admission
        takes them back together), dropping any of them already in `step`."""
        group = [victim]
        if victim.request.beam is not None:
            group = [x for x in self.requests[victim.seq.request_id] if x.status == RUNNING]
        freed = set()
        for x in reversed(group):
            freed.update(self.bm.tables[x.id])
            self.running.remove(x)
            self.bm.free(x.id)
            x.status, x.num_computed = WAITING, 0
            self.waiting.appendleft(x)
        self.num_preemptions += len(group)
        if len(group) > 1:
            step.decode[:] = [r for r in step.decode if r.state.status == RUNNING]
            step.verify[:] = [r for r in step.verify if r.state.status == RUNNING]
            step.copies[:] = [c for c in step.copies if c[1] not in freed]

    def _reserve_next_slot(self, s: SeqState, step: ScheduledStep, num_tokens: int) -> bool:
        """Gives the newest token of a decoding sequence (`num_tokens` long) a slot, preempting
        if needed. Returns False if `s` itself had to be preempted."""
        while (have := len(self.bm.tokens[s.id])) < num_tokens:
            result = self.bm.append(s.id, s.token_at(have))
            if result is not None:
                if result.copy is not None:
                    step.copies.append(result.copy)
                continue
            self._preempt(self.running[-1], step)
            if s.status != RUNNING:
                return False
        return True

    def decoding(self) -> list[SeqState]:
        """Running sequences whose next step is a decode (candidates for drafting)."""
        return [s for s in self.running if s.remaining == 1]

    def decodes_fit(self) -> bool:
        """Whether every decoding sequence's next slot fits the free pages, so that the next
        `schedule()` preempts nobody (the overlapped loop schedules only then: a preempted
        sequence must not have a pending token)."""
        free = self.bm.num_free_pages
        if free >= len(self.running):  # a decode takes one page at most
            return True
        need = sum(self.bm.append_pages_needed(s.id) for s in self.running if s.remaining == 1)
        return need <= free

    def schedule(self, drafts: dict | None = None) -> ScheduledStep:
        """Composes the next step. `drafts` maps a decoding sequence's id to speculative
        tokens to verify after its last token (slots are reserved for them too, as far as pages
        allow; they are released again after verification)."""
        step = ScheduledStep([], [], [], [])
        if self.fixed_chunk is None:
            tokens_left = self._schedule_decodes(step, drafts, self.max_num_batched_tokens)
            self._schedule_prefills(step, tokens_left)
        else:
            parts = [self._schedule_prefills, lambda s, t: self._schedule_decodes(s, drafts, t)]
            if self._last_was_prefill:
                parts.reverse()
            for part in parts:  # the other kind only when this one has nothing to run
                part(step, self.max_num_batched_tokens)
                if not step.empty:
                    break
            self._last_was_prefill = bool(step.prefill)

        step.copies += self.bm.take_copies()  # forks since the last step (share_on_fork=False)
        # n > 1: when a primary's prompt completes (in whichever kind of row), its siblings fork.
        for row in step.decode + step.prefill:
            if row.emits:
                siblings = self._unforked_siblings(row.state)
                if siblings:
                    self._fork_siblings(step, row, siblings)
        return step

    def _schedule_decodes(self, step: ScheduledStep, drafts, tokens_left: int) -> int:
        """Section 1 of `schedule`: a row for each decoding sequence. Returns the budget left."""
        # 1. Decodes, oldest first (preemption takes the newest).
        for s in list(self.running):
            if s.status != RUNNING:
                continue
            num_tokens = s.seq.total_len + s.pending
            if num_tokens - s.num_computed != 1:
                continue
            if s.pending and s.num_generated >= s.seq.params.max_tokens:
                continue  # its pending token is its last (finish by length)
            if not self._reserve_next_slot(s, step, num_tokens):
                continue
            draft = []
            for token in drafts.get(s.id, [])[: max(tokens_left - 1, 0)] if drafts else ():
                result = self.bm.append(s.id, token)
                if result is None:  # out of pages: verify fewer drafts rather than preempt
                    break
                if result.copy is not None:
                    step.copies.append(result.copy)
                draft.append(token)
            row = Row(s, s.num_computed, s.num_computed + 1 + len(draft), emits=True, draft=draft)
            (step.verify if draft else step.decode).append(row)
            tokens_left -= row.end - row.start
        return tokens_left

    def _schedule_prefills(self, step: ScheduledStep, tokens_left: int) -> None:
        """Sections 2 and 3 of `schedule`: chunks of prefills under way, then admissions."""
        now = time.perf_counter()
        # 2. Chunked prefills already under way.
        chunk_len = self.fixed_chunk  # every prefill row of a step shares one padded length
        for s in self.running:
            if s.remaining > 1 and tokens_left > 0 and self._prefill_room(step, chunk_len):
                if self._cut_short(s.remaining, tokens_left, chunk_len, s.num_computed):
                    continue  # not started (deferred): it leads a later step, whole
                chunk_len = self._add_prefill(step, s, tokens_left, chunk_len)
                tokens_left -= step.prefill[-1].end - step.prefill[-1].start

        # 3. Admissions, first come first served. Unforked n > 1 siblings of running
        # primaries already hold their places in the sequence budget.
        reserved = sum(len(self._unforked_siblings(s)) for s in self.running)
        seqs_left = self.max_num_seqs - len(self.running) - reserved
        in_use = None  # the adapters of running sequences: their slots are pinned
        if self.adapters is not None:
            in_use = {x.request.lora for x in self.running} - {None}
        skipped = []  # requests whose adapter found no slot: they keep their places
        while (
            self.admitting
            and self.waiting
            and tokens_left > 0
            and self._prefill_room(step, chunk_len)
        ):
            s = self.waiting[0]
            if s.request.beam is not None and s.seq.output_ids:
                # Preempted beams come back together (all or none), in their order.
                admitted = beam.admit(self, s, seqs_left)
                if not admitted:
                    break
                seqs_left -= admitted
                continue
            siblings = self._unforked_siblings(s)
            if seqs_left < 1 + len(siblings):
                break
            reuse = not s.needs_prompt_logprobs  # cached pages (prompt logprobs recompute)
            if self._cut_short(len(s.tokens), tokens_left, chunk_len):
                # A prompt with a cached prefix (a decode instance's handed-off prompt: all but
                # its tail) reads its pages whatever its chunks: it joins. One without leads a
                # later step (FCFS: later requests wait too).
                if not (reuse and self.bm.cached_prefix_tokens(s.tokens, s.request.cache_salt)):
                    break
            if siblings and not self.bm.share_on_fork:
                # An engine that cannot share admits n samples only with pages for n prompts.
                need = self.bm.pages_needed(len(s.tokens)) * (1 + len(siblings))
                if need > self.bm.num_free_pages:
                    break
            if (
                self.prefetch_tiers
                and reuse
                and not self.bm.prefetch(s.id, s.tokens, salt=s.request.cache_salt, wait=step.empty)
            ):
                # Its prefix is being read from the tiers below: later requests go first, and
                # it keeps its place (with nothing else to run, the step waits for the reads).
                skipped.append(self.waiting.popleft())
                continue
            if in_use is not None and not self.adapters.acquire(s.request.lora, in_use):
                skipped.append(self.waiting.popleft())
                continue
            cached = self.bm.allocate(s.id, s.tokens, reuse=reuse, salt=s.request.cache_salt)
            if cached is None:
                break  # out of pages: later requests wait too (FCFS)
            self.waiting.popleft()
            if in_use is not None:
                in_use.add(s.request.lora)
            s.status, s.num_computed = RUNNING, cached
            self.running.append(s)
            seqs_left -= 1 + len(siblings)
            metrics = s.request.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
            if s.seq.index == 0 and not s.seq.output_ids:
                metrics.num_cached_prompt_tokens = cached
            if s.remaining == 1 and self.fixed_chunk is None:
                step.decode.append(Row(s, cached, cached + 1, emits=True))
                tokens_left -= 1
            else:
                chunk_len = self._add_prefill(step, s, tokens_left, chunk_len)
                tokens_left -= step.prefill[-1].end - step.prefill[-1].start
        self.waiting.extendleft(reversed(skipped))
        # Look-ahead: the next waiting requests' prefixes are read from the tiers while they
        # wait for a sequence slot or pages, so their admission does not wait on the reads.
        # Each is asked once here (a store lookup is I/O); admission asks again when it tries.
        if self.prefetch_tiers and self.bm.store is not None:
            for s in itertools.islice(self.waiting, PREFETCH_AHEAD):
                if not s.needs_prompt_logprobs and not self.bm.prefetch_started(s.id):
                    self.bm.prefetch(s.id, s.tokens, salt=s.request.cache_salt)

    def _prefill_room(self, step, chunk_len) -> bool:
        """Whether one more prefill row fits: prefill rows are padded to the step's chunk length,
        so past the first row the padded rows stay within max_num_batched_tokens (and within
        `max_prefill_rows` where one is set)."""
        rows = len(step.prefill)
        if self.max_prefill_rows is not None and rows >= self.max_prefill_rows:
            return False
        return rows == 0 or (rows + 1) * chunk_len <= self.max_num_batched_tokens

    def _cut_short(self, length: int, tokens_left: int, chunk_len: int | None,
                   computed: int = 0) -> bool:  # fmt: skip
        """Whether a prompt none of whose tokens are computed yet (`computed` 0) would be cut
        to the chunk length an earlier row of the step set (or to the budget left beside it):
        such a prompt waits for a step whose first prefill row it is, rather than become a
        short chunk and a remainder with cached context (which attends over its page table,
        a costlier program: on XLA:CPU a 263-token remainder on a 64-page table took 3.2 s,
        a fresh 512-token row 1.4 s). A step's first prefill row is still chunked at the
        budget (a prompt longer than it must be), and batch-invariant chunks (`fixed_chunk`)
        as they are."""
        if chunk_len is None or self.fixed_chunk is not None or computed:
            return False
        return length > min(tokens_left, chunk_len)

    def _add_prefill(self, step, s, tokens_left, chunk_len):
        limit = min(tokens_left, chunk_len or tokens_left)
        end = s.num_computed + min(s.remaining, limit)
        step.prefill.append(Row(s, s.num_computed, end, emits=end == s.num_tokens))
        if chunk_len is None:
            chunk_len = self.token_bucket(end - s.num_computed)
        return chunk_len

    def _unforked_siblings(self, s: SeqState) -> list[SeqState]:
        if s.seq.index != 0 or s.seq.output_ids:
            return []
        return [
            x
            for x in self.requests.get(s.seq.request_id, [])
            if x.fork_from is s and x.status == WAITING
        ]

    def _fork_siblings(self, step, row: Row, siblings) -> None:
        """n > 1: the siblings share the prompt's pages and sample from the same logits."""
        for sib in siblings:
            self.bm.fork(row.state.id, sib.id)
            sib.status, sib.fork_from = RUNNING, None
            sib.num_computed = row.state.num_computed
            self.running.append(sib)
            step.samples.append(Row(sib, row.start, row.end, emits=True, sample_of=row))
        for sib in siblings:
            metrics = sib.request.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or time.perf_counter()

    def launch(self, step: ScheduledStep) -> None:
        """Records that `step` was dispatched: its rows' K/V count as computed (the device
        writes them before any later step reads them) and every row that samples leaves its
        sequence a pending token (`SeqState.pending_row` names the row)."""
        for r, row in enumerate(step.decode + step.prefill + step.samples):
            s = row.state
            s.num_computed = row.end
            self.bm.mark_computed(s.id, row.end)
            if row.emits:
                s.pending += 1
                s.pending_row = r

    def update(
        self, step: ScheduledStep, tokens: np.ndarray, info, verified=None
    ) -> Iterator[tuple[Sequence, str]]:
        """Applies a launched step that finished: fills in its pending tokens, appends them to
        their sequences, retires finished sequences (freeing their pages at once). Rows of
        sequences that finished or were aborted since it was dispatched are skipped.

        Args:
          tokens: i32[R] sampled token per row, rows ordered decode + prefill + samples.
          info: callable(row_index) -> (logprob, rank, top) for the row's token.
          verified: for `step.verify` rows, (num_accepted [Bv], next_token [Bv],
            token_logprobs [Bv, k+1]) from `engine.spec_decode.speculative.verify`.
        """
        now = time.perf_counter()
        rows = step.decode + step.prefill + step.samples
        for r, row in enumerate(rows):
            s = row.state
            if row.emits and s.pending:
                s.pending -= 1
                if s.status == RUNNING and s.request.beam is None:
                    # A slot the next step reserved already: its page may now be hashed.
                    self.bm.set_token(s.id, s.seq.total_len, int(tokens[r]))
                    self.bm.mark_computed(s.id, s.num_computed)
        yield from self._apply_verified(step, verified, now)
        beams: dict[str, list] = {}
        for r, row in enumerate(rows):
            s = row.state
            if not row.emits or s.status != RUNNING:
                continue
            logprob, rank, top = info(r)
            if s.request.beam is not None:
                beams.setdefault(s.seq.request_id, []).append((s, top))
                continue
            delta = s.seq.append(int(tokens[r]), logprob, rank, top, now)
            if s.seq.finished:
                self.retire(s)
            yield s.seq, delta
        for request_id, candidates in beams.items():
            search = candidates[0][0].request.beam
            live = [x for x in self.requests.get(request_id, []) if x.status != FINISHED]
            ready = search.collect(candidates, live)
            if ready is not None:
                search.advance(self, ready)

    def _apply_verified(self, step, verified, now):
        """Appends each verify row's accepted drafts and the target's token, then rolls the
        rejected positions back by truncating the pages (no copies)."""
        for v, row in enumerate(step.verify):
            s = row.state
            accepted = int(verified[0][v])
            emitted = row.draft[:accepted] + [int(verified[1][v])]
            for i, token in enumerate(emitted):
                delta = s.seq.append(token, float(verified[2][v, i]), None, None, now)
                yield s.seq, delta
                if s.seq.finished:
                    break
            s.request.spec_accepted += accepted
            s.request.spec_drafted += len(row.draft)
            if s.seq.finished:
                self.retire(s)
                continue
            # K/V are valid for the last token and the accepted drafts; the rest are dropped.
            s.num_computed = s.num_tokens - 1
            self.bm.truncate(s.id, s.num_computed)
            self.bm.mark_computed(s.id, s.num_computed)

    def fork_running(self, parent: SeqState, child: Sequence) -> SeqState:
        """A new running sequence sharing all of `parent`'s pages (beam search)."""
        state = SeqState(child, parent.request, RUNNING, parent.num_computed)
        self.bm.fork(parent.id, state.id)
        self.running.append(state)
        self.requests[child.request_id].append(state)
        return state

    def retire(self, s: SeqState) -> None:
        """Ends a running sequence now (its Sequence must be finished) and frees its pages."""
        self.running.remove(s)
        self.bm.free(s.id)
        s.status = FINISHED
        states = self.requests.get(s.seq.request_id, [])
        if all(x.status == FINISHED for x in states):
            self.requests.pop(s.seq.request_id, None)
            s.request.metrics.finished_time = time.perf_counter()

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
            **self.bm.stats(),
        }
