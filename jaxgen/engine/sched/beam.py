"""Beam search inside the continuous-batching scheduler.

Every step, each live beam of a request produces the top 2W next tokens of the model's raw
distribution; the W best continuations (by cumulative log-probability) survive. A parent with
several surviving children is forked (the children share its pages, copy-on-write); a parent
with none is freed. A continuation ending in EOS becomes a finished hypothesis, scored
``sum_logprob / len ** length_penalty`` (generated tokens only), as in transformers.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxgen.engine.sched.sequence import RUNNING, WAITING


@dataclasses.dataclass
class BeamHypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    text: str = ""
    finish_reason: str = "length"


@dataclasses.dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamHypothesis]  # best first


class BeamController:
    def __init__(self, width: int, length_penalty: float, eos_ids: frozenset[int], max_tokens: int):
        self.width = width
        self.length_penalty = length_penalty
        self.eos_ids = eos_ids
        self.max_tokens = max_tokens
        self.finished: list[BeamHypothesis] = []
        self._next_index = itertools.count(1)
        self.done = False
        self._held: dict[int, tuple] = {}  # id(SeqState) -> (state, top) awaiting the rest

    def collect(self, rows, live) -> list | None:
        """Gathers one step of the search: `rows` ([(SeqState, top)]) are the beams that
        produced their next candidates in this engine step, `live` every unfinished beam of the
        request. A beam that was preempted recomputes its tokens and produces its candidates
        steps later; the others' are held (they are not scheduled meanwhile: they have no next
        token) until every live beam's are in. Returns the complete rows, or None."""
        self._held.update((id(state), (state, top)) for state, top in rows)
        if any(id(state) not in self._held for state in live):
            return None
        ready = [self._held[id(state)] for state in live]
        self._held.clear()
        return ready

    def _score(self, cumulative: float, length: int) -> float:
        return cumulative / (max(length, 1) ** self.length_penalty)

    def advance(self, sched, rows) -> None:
        """rows: [(SeqState, top)] with top = [(token, logprob)] for each live beam."""
        candidates = []
        for state, top in rows:
            base = state.seq.cumulative_logprob
            for token, logprob in top[: 2 * self.width]:
                if logprob != float("-inf"):  # a token structured outputs forbid
                    candidates.append((base + logprob, logprob, token, state))
        candidates.sort(key=lambda c: -c[0])
        survivors = []
        for cumulative, logprob, token, state in candidates:
            if token in self.eos_ids:
                length = len(state.seq.output_ids) + 1
                self.finished.append(
                    BeamHypothesis(
                        state.seq.output_ids + [token],
                        cumulative,
                        self._score(cumulative, length),
                        finish_reason="stop",
                    )
                )
                continue
            survivors.append((cumulative, logprob, token, state))
            if len(survivors) == self.width:
                break
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]
        live_best = survivors[0][0] if survivors else None
        length = len(rows[0][0].seq.output_ids) + 1
        # Done when no continuation can beat the W-th finished hypothesis any more
        # (transformers' early_stopping=False heuristic) or the length limit is reached.
        if (
            not survivors
            or length >= self.max_tokens
            or (
                len(self.finished) >= self.width
                and self._score(live_best, length) < self.finished[-1].score
            )
        ):
            self.done = True
        children: dict[int, list] = {}
        for _, logprob, token, state in survivors:
            children.setdefault(id(state), []).append((state, token, logprob))
        # Fork before appending: a child starts from its parent's tokens.
        new_states = []
        for group in children.values():
            parent = group[0][0]
            for _, token, logprob in group[1:]:
                child = sched.fork_running(parent, parent.seq.fork(next(self._next_index)))
                parent.request.seqs.append(child.seq)
                new_states.append((child, token, logprob))
            new_states.append((parent, group[0][1], group[0][2]))
        for state, token, logprob in new_states:
            state.seq.append(token, logprob)
        for state, _ in rows:
            if id(state) not in children:
                state.seq.finish_reason = "pruned"
                sched.retire(state)
        if self.done:
            for state, _, _ in new_states:
                seq = state.seq
                self.finished.append(
                    BeamHypothesis(
                        list(seq.output_ids),
                        seq.cumulative_logprob,
                        self._score(seq.cumulative_logprob, len(seq.output_ids)),
                    )
                )
                if seq.finish_reason is None:
                    seq.finish_reason = "length"
                if state.status == "running":
                    sched.retire(state)
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width :]
        else:
            for state, _, _ in new_states:
                if state.seq.finished:  # reached max_tokens: Sequence ended it
                    sched.retire(state)


def admit(sched, s, seqs_left: int) -> int:
    """Gives every waiting beam of `s`'s request its pages, or none of them (the scheduler
    admits a preempted beam search's beams together). The beams become running sequences with
    their tokens to recompute: step 2 of `Scheduler.schedule()` gives them prefill rows (from
    the next step on). Returns how many (0: they do not all fit)."""
    group = [x for x in sched.waiting if x.request is s.request]
    if len(group) > seqs_left:
        return 0
    done = []
    for x in group:
        cached = sched.bm.allocate(x.id, x.tokens, salt=x.request.cache_salt)
        if cached is None:
            for y in done:
                sched.bm.free(y.id)
                y.status, y.num_computed = WAITING, 0
                sched.running.remove(y)
            return 0
        x.status, x.num_computed = RUNNING, cached
        sched.running.append(x)
        done.append(x)
    for x in group:
        sched.waiting.remove(x)
    return len(group)
