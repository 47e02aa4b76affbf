"""A discrete-event simulator of a serving deployment, after DistServe's (Zhong et al., OSDI
2024, section 4.1): requests arrive, queue at an instance, are batched step by step with the
times a `LatencyModel` gives, and leave with a TTFT and a TPOT.

Colocated: every instance runs continuous batching with a token budget; each step holds all
running decode rows (one token each) and fills the rest of the budget with prefill chunks in
arrival order (chunked prefill, Sarathi-style), so a long prompt is spread over several steps
that also decode.
Disaggregated: prefill instances batch whole prompts up to the token budget; a finished prompt's
KV moves to the least-loaded decode instance over its prefill instance's link (transfers from
one prefill instance go one at a time); decode instances batch every admitted sequence.

With `tail_page` (jaxgen's own deployment: the KV moves through a shared store in whole
pages, and the decode instance computes the prompt's last partial page, at least one token, to
sample the first token itself) an arriving sequence is a short prefill chunk on its decode
instance, batched with the running decodes, and its first token comes from that step.

Definitions: TTFT = first token on the client - arrival; in the disaggregated deployment the
first token leaves after the KV transfer (the decode instance streams from then on), so the
transfer counts in TTFT. TPOT = (last token - first token) / (output tokens - 1), 0 for one
token. A sequence reserves KV for prompt + output at admission (no preemption), and admission
is FIFO: the head of a queue that does not fit blocks the ones behind it. `overhead`: seconds
every request spends outside the engines' steps before its first token reaches the client (HTTP
hops, tokenizing, the router; measured by `python -m benchmarks disagg`), added to each TTFT.

Handoff: a prompt's KV handed between instances also costs the engines' own time (the model's
`handoff`): the prefill instance writes its pages out after the step that finished it (busy,
and the transfer starts after), the decode instance admits them (reads, checks, loads into its
pool) in the step that first holds the row.

Overlap (`overlap=True`: jaxgen's engines, SGLang's overlap scheduler, vLLM's async
scheduling): a busy instance schedules its next step when the one before starts, so a request
that reaches it while a step runs joins the step after the next (one more step before its
first token); an idle instance schedules at once.

Compiles: an engine that compiles a program per step shape (jaxgen's, with XLA) stalls the
first time a shape comes up. With a model that prices those steps (`LatencyModel.compile`), each
simulated instance remembers the programs (`Padding.program`) it has run, in a `Programs` that
one run hands to the next (a deployment's life: its warm-ups, then the replays), and a step
with a new one costs `compile_seconds`. With a `Padding`, every step is priced as the program
that runs it (`LatencyModel.program_seconds`): its own, or a larger compiled one covering it.

Background compiles (`Programs(background=True)`: jaxgen's `compile_in_background`): a step
whose program nothing compiled covers within the factor runs on the least-work compiled one that
covers it at all, while its own compiles on the instance's one compile thread (compiles queue
there, one at a time); its steps run on the cover until the compile has ended, and one that
nothing covers compiles inline. The compile thread and the steps share the instance's core
(processor sharing): while a compile runs, a step gets `LatencyModel.background_share` of the
core and the compile the rest; an idle instance gives the compile all of it. A compile's own
work is `compile_seconds - program_seconds` of its program. Compiles still running when a
simulation ends have ended before the next one (the bench waits for them between replays).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Sequence

from benchmarks.disagg.planner import LatencyModel, PlanningError


@dataclasses.dataclass(frozen=True)
class Request:
    arrival: float  # seconds
    prompt_len: int
    output_len: int


@dataclasses.dataclass(frozen=True)
class Outcome:
    ttft: float
    tpot: float
    finish: float
    # disaggregated: seconds from arrival until the prefill instance answered (its queue, the
    # prompt's steps, writing its pages out), the router's prefill hop; None colocated
    prefill: float | None = None


class _Row:
    __slots__ = ("index", "req", "prefilled", "generated", "first_token", "load", "handed",
                 "queued")  # fmt: skip

    def __init__(self, index: int, req: Request):
        self.index, self.req = index, req
        self.prefilled = 0
        self.generated = 0
        self.first_token = 0.0
        self.load = 0.0  # the decode instance's handoff seconds, paid by its next step
        self.handed = None  # when the prefill instance answered (disaggregated)
        self.queued = 0.0  # when it reached its current instance's queue


class Programs:
    """The step programs each instance of a simulated deployment has compiled (instances in
    order: the front ones, prefill or colocated, then the decode ones), and how many compiled
    in all. Pass one to consecutive simulations to carry an instance's programs over.
    `ahead_of_time`: the programs every instance compiles before it serves (jaxgen's
    `compile_buckets`; `jaxgen serve` compiles `aot.serving_buckets`)."""

    def __init__(self, cover: float = 0.0, ahead_of_time=(), background: bool = False,
                 frozen: bool = False, defer: int = 2):  # fmt: skip
        if cover != 0 and cover < 1:
            raise PlanningError(f"{cover=}: give 0 (off) or >= 1 (x a step's own work)")
        self.cover = cover  # the engines' `cover_new_shapes`
        self.background = background  # the engines' `compile_in_background`
        self.ahead_of_time = frozenset(ahead_of_time)
        self.known: collections.defaultdict[int, set] = collections.defaultdict(
            lambda: set(self.ahead_of_time)
        )
        # background compiles per instance, in order: [program key, seconds of work left]
        self.pending: collections.defaultdict[int, list] = collections.defaultdict(list)
        self.compiles = 0  # inline and background
        self.background_compiles = 0
        self.covered = 0  # steps run on a larger program their instance had compiled
        self.deferred = 0  # prefill rows a frozen instance left to its next step
        # The engines' programs are frozen (`Engine.freeze_programs`): a step not compiled runs
        # on the least-work program covering it at any factor; without one, its last prefill
        # rows wait for the next step until one does, and it compiles only when none does.
        # `defer` (`StepPrograms._defer_prefills`): 2, a row is deferred once, its next row stays;
        # 1, a row the last step deferred stays (the engine of the 2026-12-06 16:03 run); 0,
        # no deferring (engines before it).
        self.frozen, self.defer = frozen, int(defer)
        if self.defer not in (0, 1, 2):
            raise PlanningError(f"{defer=}: give 0, 1 or 2")

    def copy(self) -> Programs:
        out = Programs(self.cover, self.ahead_of_time, self.background, self.frozen, self.defer)
        out.known.update({i: set(k) for i, k in self.known.items()})
        out.pending.update({i: [list(p) for p in q] for i, q in self.pending.items()})
        out.compiles, out.covered, out.deferred = self.compiles, self.covered, self.deferred
        out.background_compiles = self.background_compiles
        return out

    def settle(self, index: int) -> None:
        """Instance `index`'s background compiles have ended (between two simulations)."""
        self.known[index].update(k for k, _ in self.pending.pop(index, ()))

    def covering(self, index: int, key: tuple, padding, factor: float | None = None):
        """The compiled program of instance `index` that runs a step of `key` (not compiled)
        with the least work (`Padding.covers`, within `factor`, default the engines' `cover`);
        None without one, or with cover off."""
        factor = self.cover if factor is None else factor
        if not factor:
            return None
        found = [k for k in self.known[index] if padding.covers(k, key, factor)]
        return min(found, key=lambda k: (padding.work(k), k), default=None)


class _Instance:
    def __init__(
        self,
        model: LatencyModel,
        *,
        prefill: bool,
        decode: bool,
        chunked: bool,
        programs: Programs | None = None,
        index: int = 0,
        overlap: bool = False,
    ):
        self.model = model
        self.overlap = overlap
        self.started = 0.0  # when the step in flight (or the last one) started
        self.programs = programs if model.compile else None
        self.index = index
        self.known = programs.known[index] if self.programs is not None else None
        self.pending = None  # background compiles: [[key, seconds of work left], ...]
        if self.programs is not None:
            self.programs.settle(index)
            self.pending = self.programs.pending[index]
        self.clock = 0.0  # the background compiles' work is counted up to here
        self.does_prefill, self.does_decode, self.chunked = prefill, decode, chunked
        self.waiting: collections.deque[_Row] = collections.deque()  # not yet admitted
        self.prefilling: list[_Row] = []  # admitted, prompt not finished
        self.running: list[_Row] = []  # decoding
        self.kv_used = 0
        self.busy = False
        self.link_free = 0.0  # when this (prefill) instance's outgoing KV link is free
        self.step_rows: tuple = ()
        self.waited: set = set()  # rows deferred and not run since (`_defer_prefills`)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def _reserve(self, row: _Row) -> int:
        req = row.req
        return req.prompt_len + (req.output_len if self.does_decode else 0)

    def enqueue(self, row: _Row, t: float) -> None:
        row.queued = t
        self.waiting.append(row)

    def _admit(self, cutoff: float) -> None:
        """Admits waiting rows in order, those queued by `cutoff` (what the scheduler saw)."""
        m = self.model
        while self.waiting:
            row = self.waiting[0]
            if row.queued > cutoff:
                return
            need = self._reserve(row)
            if need > m.max_kv_tokens:
                raise PlanningError(
                    f"a request of {row.req.prompt_len}+{row.req.output_len} tokens never fits "
                    f"an instance's {m.max_kv_tokens} KV tokens"
                )
            if len(self.prefilling) + len(self.running) >= m.max_num_seqs:
                return
            if self.kv_used + need > m.max_kv_tokens:
                return
            self.kv_used += need
            self.waiting.popleft()
            (self.prefilling if self.does_prefill else self.running).append(row)

    def _compile_for(self, work: float) -> None:
        """The head background compile does `work` seconds of its own; once it has no work
        left it has ended and its program serves."""
        self.pending[0][1] -= work
        if self.pending[0][1] <= 1e-12:
            key, _ = self.pending.pop(0)
            self.known.add(key)

    def idle_until(self, t: float) -> None:
        """The instance ran no step since `clock`: the compile thread had the core to itself."""
        free, self.clock = t - self.clock, max(self.clock, t)
        while self.pending and free > 0:
            done = min(free, self.pending[0][1])
            free -= done
            self._compile_for(done)

    def busy_for(self, t: float, work: float) -> float:
        """Wall seconds from `t` of `work` seconds of the instance's own (a step, writing KV
        out), sharing the core with its background compiles (processor sharing)."""
        self.idle_until(t)
        wall = 0.0
        while self.pending and work > 0:
            share = self.model.background_share
            # both run until the first of them ends
            dt = work / share if share >= 1 else min(work / share, self.pending[0][1] / (1 - share))
            work -= dt * share
            wall += dt
            self._compile_for(dt * (1 - share))
        wall += max(work, 0.0)
        self.clock = t + wall
        return wall

    def _defer_prefills(self, decode: list, chunks: list, lens: list) -> list:
        """jaxgen's `StepPrograms._defer_prefills`: on a frozen instance, a step that no program
        it holds runs (its own or a covering one) leaves its last prefill rows to the next
        step, one at a time, until what is left runs on one. A row is deferred once: its
        next row stays (`Programs.defer`), and the first row stays in a step without decode
        rows. Returns the chunks the step keeps (all when none runs)."""
        pad = self.model.padding
        if self.programs.defer == 1:  # the rows the last step deferred
            waited, self.waited = self.waited, set()
        else:
            waited = self.waited

        def held(rows) -> bool:
            key = pad.program([(n, r.prefilled) for r, n in rows],
                              [r.req.prompt_len for r, _ in rows], lens)  # fmt: skip
            cover = self.programs.covering(self.index, key, pad, float("inf"))
            return key in self.known or cover is not None

        keep = len(chunks)
        if not held(chunks):
            while keep > (0 if decode else 1) and chunks[keep - 1][0] not in waited:
                keep -= 1
                if held(chunks[:keep]):
                    self.programs.deferred += len(chunks) - keep
                    self.waited.update(r for r, _ in chunks[keep:])
                    break
            else:
                keep = len(chunks)
        self.waited.difference_update(r for r, _ in chunks[:keep])  # they run now
        return chunks[:keep]

    def plan_step(self, cutoff: float = float("inf")) -> float | None:
        """Chooses the next step's rows from the queue as it stood at `cutoff`; returns its
        seconds of work (`busy_for` gives its wall time), or None when idle."""
        self._admit(cutoff)
        m = self.model
        decode = list(self.running) if self.does_decode else []
        budget = m.max_batched_tokens - len(decode)
        chunks = []
        chunk_len = None  # padded engines: every prefill row of a step is as long as the first's
        for row in self.prefilling:
            left = row.req.prompt_len - row.prefilled
            limit = budget
            if chunk_len is not None:  # the padded rows stay within the budget (jaxgen's rule)
                if (len(chunks) + 1) * chunk_len > m.max_batched_tokens:
                    break
                limit = min(budget, chunk_len)
                if self.chunked and not row.prefilled and left > limit:
                    # jaxgen's `Scheduler._cut_short`: a prompt not started leads a later step,
                    # whole. A deferred one (running there) lets later rows by; one the engine
                    # has not admitted yet (admitted here once its KV fits) holds them (FCFS).
                    if row in self.waited:
                        continue
                    break
            if self.chunked:
                n = min(left, limit)
            else:  # a whole prompt; one longer than the budget goes alone
                n = left if left <= limit or not chunks else 0
            if n <= 0:
                break
            chunks.append((row, n))
            budget -= n
            if m.padding is not None and chunk_len is None:
                chunk_len = m.padding.token_bucket(n)
        if not decode and not chunks:
            return None
        lens = [r.req.prompt_len + r.generated for r in decode]  # KV once the step writes
        programs = self.programs
        if m.padding is not None and programs is not None and programs.frozen and programs.defer:
            chunks = self._defer_prefills(decode, chunks, lens)
        self.step_rows = (decode, chunks)
        spans = [(n, r.prefilled) for r, n in chunks]
        load = 0.0  # handed-off prompts admitted before this step
        for r in [*decode, *(r for r, _ in chunks)]:
            load, r.load = load + r.load, 0.0
        if m.padding is None:
            return load + m.mixed_seconds(spans, len(decode), sum(lens))
        # The program the engine runs it with (its own, or one covering it) prices the step.
        key = m.padding.program(spans, [r.req.prompt_len for r, _ in chunks], lens)
        if self.known is not None and key not in self.known:
            frozen = self.programs.frozen
            cover = self.programs.covering(
                self.index, key, m.padding, float("inf") if frozen else None
            )
            compiling = any(k == key for k, _ in self.pending)
            if cover is None and not frozen and (compiling or self.programs.background):
                cover = self.programs.covering(self.index, key, m.padding, float("inf"))
                if cover is not None and not compiling:
                    work = max(m.compile_seconds(key) - m.program_seconds(key), 0.0)
                    self.pending.append([key, work])
                    self.programs.compiles += 1
                    self.programs.background_compiles += 1
            if cover is not None:
                self.programs.covered += 1
                return load + m.program_seconds(cover)
            self.known.add(key)
            self.programs.compiles += 1
            return load + m.compile_seconds(key)
        return load + m.program_seconds(key)


class _Sim:
    def __init__(self, requests: Sequence[Request], tail_page: int = 0, overhead: float = 0.0):
        if overhead < 0:
            raise PlanningError(f"{overhead=} must be >= 0 seconds")
        self.tail_page, self.overhead = tail_page, overhead
        if not requests:
            raise PlanningError("the trace holds no requests")
        for r in requests:
            if r.prompt_len < 1 or r.output_len < 1 or r.arrival < 0:
                raise PlanningError(f"bad request {r}: lengths must be >= 1, arrival >= 0")
        self.requests = requests
        self.events: list = []
        self.seq = 0
        self.outcomes: list[Outcome | None] = [None] * len(requests)

    def push(self, t: float, kind: str, *data) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, data))
        self.seq += 1

    def finish(self, row: _Row, t: float) -> None:
        out = row.req.output_len
        tpot = (t - row.first_token) / (out - 1) if out > 1 else 0.0
        ttft = row.first_token - row.req.arrival + self.overhead
        hop = None if row.handed is None else row.handed - row.req.arrival
        self.outcomes[row.index] = Outcome(ttft, tpot, t, hop)

    def kick(self, inst: _Instance, t: float, after_step: bool = False) -> None:
        """Starts `inst`'s next step at `t` if it has one. `after_step`: `t` ends a step; an
        overlapped instance planned the next one when that step started (when that plan is
        empty, the engine plans again at once)."""
        if inst.busy:
            return
        inst.idle_until(t)  # compiles that ended meanwhile serve this step
        seconds = None
        if after_step and inst.overlap:
            seconds = inst.plan_step(inst.started)
        if seconds is None:
            seconds = inst.plan_step()
        if seconds is not None:
            inst.busy = True
            inst.started = t
            self.push(t + inst.busy_for(t, seconds), "step", inst)

    def run(self, front: list[_Instance], back: list[_Instance]) -> list[Outcome]:
        for i, r in enumerate(self.requests):
            self.push(r.arrival, "arrive", i)
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if kind == "arrive":
                inst = min(front, key=lambda x: x.load)
                inst.enqueue(_Row(data[0], self.requests[data[0]]), t)
                self.kick(inst, t)
            elif kind == "step":
                inst = data[0]
                inst.busy = False
                writing = self._step_done(inst, t, back)
                if writing:  # the instance writes the finished prompts' KV out first
                    inst.busy = True
                    self.push(t + inst.busy_for(t, writing), "free", inst)
                else:
                    self.kick(inst, t, after_step=True)
            elif kind == "free":
                inst = data[0]
                inst.busy = False
                self.kick(inst, t)
            else:  # "kv": a transfer landed at a decode instance
                row, inst = data
                row.load = inst.model.handoff_seconds(self.moved(row))
                if self.tail_page:  # the last partial page is computed there first
                    row.prefilled = row.req.prompt_len - ((row.req.prompt_len - 1)
                                                          % self.tail_page + 1)  # fmt: skip
                    row.generated = 0
                    inst.enqueue(row, t)
                    self.kick(inst, t)
                    continue
                row.first_token = t
                if row.req.output_len == 1:
                    self.finish(row, t)
                else:
                    inst.enqueue(row, t)
                    self.kick(inst, t)
        assert all(o is not None for o in self.outcomes)
        return self.outcomes  # type: ignore[return-value]

    def moved(self, row: _Row) -> int:
        """KV tokens handed from the prefill to the decode instance: the prompt's full pages
        with `tail_page`, else the whole prompt."""
        n = row.req.prompt_len
        return n - ((n - 1) % self.tail_page + 1) if self.tail_page else n

    def _step_done(self, inst: _Instance, t: float, back: list[_Instance]) -> float:
        """Lands a step's rows; returns the seconds the instance then spends writing the
        finished prompts' KV out (a prefill instance's handoff)."""
        decode, chunks = inst.step_rows
        writing = 0.0
        for row in decode:
            row.generated += 1
            if row.generated == row.req.output_len:
                inst.running.remove(row)
                inst.kv_used -= inst._reserve(row)
                self.finish(row, t)
        for row, n in chunks:
            row.prefilled += n
            if row.prefilled < row.req.prompt_len:
                continue
            inst.prefilling.remove(row)
            row.generated = 1  # the prefill step samples the first token
            if inst.does_decode:
                row.first_token = t
                if row.req.output_len == 1:
                    inst.kv_used -= inst._reserve(row)
                    self.finish(row, t)
                else:
                    inst.running.append(row)
                continue
            inst.kv_used -= inst._reserve(row)  # pages freed once the transfer is issued
            writing += inst.model.handoff_seconds(self.moved(row))
            row.handed = t + writing
            target = min(back, key=lambda x: x.load)
            start = max(t + writing, inst.link_free)
            inst.link_free = start + inst.model.transfer_seconds(row.req.prompt_len)
            self.push(inst.link_free, "kv", row, target)
        return writing


def simulate_colocated(
    requests: Sequence[Request],
    model: LatencyModel,
    num_instances: int = 1,
    overhead: float = 0.0,
    programs: Programs | None = None,
    overlap: bool = False,
) -> list[Outcome]:
    """Outcomes per request (same order) of `num_instances` colocated instances with chunked
    prefill; arrivals go to the instance with the fewest unfinished requests. `overhead`,
    `programs` (None: none compiled yet), `overlap`: see the module docstring."""
    if num_instances < 1:
        raise PlanningError(f"{num_instances=} must be >= 1")
    programs = Programs() if programs is None else programs
    insts = [
        _Instance(
            model,
            prefill=True,
            decode=True,
            chunked=True,
            programs=programs,
            index=i,
            overlap=overlap,
        )  # fmt: skip
        for i in range(num_instances)
    ]
    return _Sim(requests, overhead=overhead).run(insts, insts)


def simulate_disaggregated(
    requests: Sequence[Request],
    prefill_model: LatencyModel,
    decode_model: LatencyModel,
    num_prefill: int = 1,
    num_decode: int = 1,
    tail_page: int = 0,
    overhead: float = 0.0,
    chunked_prefill: bool = False,
    programs: Programs | None = None,
    overlap: bool = False,
) -> list[Outcome]:
    """Outcomes per request of `num_prefill` prefill and `num_decode` decode instances; the
    transfer time is the prefill model's (`transfer_seconds` of the prompt's KV). `tail_page`:
    the page size when the decode instance computes the prompt's last partial page (see the
    module docstring); 0: the first token arrives with the KV. `overhead`: see the module
    docstring. `chunked_prefill`: prefill instances cut prompts at the token budget, as
    jaxgen's do (False: whole prompts, as DistServe's). `programs` (None: none compiled yet),
    `overlap`: see the module docstring."""
    if num_prefill < 1 or num_decode < 1:
        raise PlanningError(f"{num_prefill=} and {num_decode=} must be >= 1")
    programs = Programs() if programs is None else programs
    front = [
        _Instance(
            prefill_model,
            prefill=True,
            decode=False,
            chunked=chunked_prefill,
            programs=programs,
            index=i,
            overlap=overlap,
        )
        for i in range(num_prefill)
    ]
    back = [
        _Instance(
            decode_model,
            prefill=bool(tail_page),
            decode=True,
            chunked=True,
            programs=programs,
            index=num_prefill + i,
            overlap=overlap,
        )
        for i in range(num_decode)
    ]
    return _Sim(requests, tail_page, overhead).run(front, back)


def attainment(outcomes: Sequence[Outcome], ttft_slo: float, tpot_slo: float) -> float:
    """Fraction of requests within both SLOs."""
    if ttft_slo <= 0 or tpot_slo <= 0:
        raise PlanningError(f"SLOs must be > 0 seconds: {ttft_slo=}, {tpot_slo=}")
    if not outcomes:
        raise PlanningError("no outcomes")
    ok = sum(o.ttft <= ttft_slo and o.tpot <= tpot_slo for o in outcomes)
    return ok / len(outcomes)
