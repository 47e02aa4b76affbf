"""Block manager: property tests over random interleavings (pages shared at fork, and copied
at fork), plus prefix caching, COW and the fork copies of share_on_fork=False."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxgen.cache.block_manager import BlockManager

PAGE = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / truncate / free / mark_computed; invariants each step.

    A shadow copy of every sequence's tokens checks that the pages a sequence reads hold
    exactly its own tokens: writes land through the returned slots into a simulated pool, so a
    write into a shared page (a missed copy-on-write) or into a cached page shows up as a
    mismatch. With `share_on_fork=False` the fork copies land when the next "step" starts
    (before its writes, all reading the pool as it was), as the engine does them.
    """

    share_on_fork = True

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_pages=12, page_size=PAGE, share_on_fork=self.share_on_fork)
        self.pool = {}  # slot -> token written there
        self.next_id = 0
        self.waiting = {}  # child -> the fork copies it still waits for (the model's own list)

    def _copied(self, copies):
        """The pool after `copies`, every source read before any target is written."""
        pool = dict(self.pool)
        for src, dst in copies:
            for off in range(PAGE):
                pool.pop(dst * PAGE + off, None)
                if src * PAGE + off in self.pool:
                    pool[dst * PAGE + off] = self.pool[src * PAGE + off]
        return pool

    def _step(self):
        """A step starts: the block manager hands over exactly the copies still needed."""
        copies = self.bm.take_copies()
        assert sorted(copies) == sorted(c for cs in self.waiting.values() for c in cs)
        self.pool = self._copied(copies)
        self.waiting.clear()
        assert self.bm.take_copies() == []

    def _write(self, seq, start):
        self._step()
        table = self.bm.tables[seq]
        for pos in range(start, len(self.bm.tokens[seq])):
            page = table[pos // PAGE]
            assert self.bm.ref_counts[page] == 1, "write into a shared page"
            self.pool[page * PAGE + pos % PAGE] = self.bm.tokens[seq][pos]

    def _check_content(self, seq, pool):
        table = self.bm.tables[seq]
        for pos in range(self.bm.computed[seq]):
            slot = table[pos // PAGE] * PAGE + pos % PAGE
            assert pool.get(slot) == self.bm.tokens[seq][pos], f"seq {seq} pos {pos}"

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def allocate(self, prompt):
        seq = self.next_id
        self.next_id += 1
        cached = self.bm.allocate(seq, prompt)
        if cached is None:
            return
        assert cached % PAGE == 0 and cached < len(prompt)
        self._check_content_prefix(seq, cached)
        self._write(seq, cached)
        self.bm.mark_computed(seq, len(prompt))

    def _check_content_prefix(self, seq, cached):
        table = self.bm.tables[seq]
        for pos in range(cached):
            slot = table[pos // PAGE] * PAGE + pos % PAGE
            assert self.pool.get(slot) == self.bm.tokens[seq][pos], "prefix hit with wrong content"

    @precondition(lambda self: self.bm.tables)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.bm.tables)))
        self._step()
        can = self.bm.can_append(seq)
        result = self.bm.append(seq, token)
        assert (result is not None) == can
        if result is None:
            return
        if result.copy:
            src, dst = result.copy
            for off in range(PAGE):
                if src * PAGE + off in self.pool:
                    self.pool[dst * PAGE + off] = self.pool[src * PAGE + off]
        page = result.slot // PAGE
        assert self.bm.ref_counts[page] == 1, "append into a shared page"
        self.pool[result.slot] = token
        self.bm.mark_computed(seq, len(self.bm.tokens[seq]))

    @precondition(lambda self: self.bm.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.bm.tables)))
        if parent in self.waiting:
            self._step()  # the engine forks a sequence only after its own copies are done
        child, self.next_id = self.next_id, self.next_id + 1
        free = self.bm.num_free_pages
        copies = self.bm.fork(parent, child)
        pairs = list(zip(self.bm.tables[parent], self.bm.tables[child], strict=True))
        if self.share_on_fork:
            assert copies == [] and all(p == c for p, c in pairs)
        else:  # copied while free pages last, shared after
            assert copies == [(p, c) for p, c in pairs if p != c]
            assert len(copies) == min(free, len(pairs))
            assert all(self.bm.ref_counts[c] == 1 for _, c in copies)
            if copies:
                self.waiting[child] = copies

    @precondition(lambda self: self.bm.tables)
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(sorted(self.bm.tables)))
        length = data.draw(st.integers(0, len(self.bm.tokens[seq])))
        self.bm.truncate(seq, length)
        if seq in self.waiting:  # a released page needs no copy
            kept = self.bm.tables[seq]
            self.waiting[seq] = [c for c in self.waiting[seq] if c[1] in kept]

    @precondition(lambda self: self.bm.tables)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.bm.tables)))
        self.bm.free(seq)
        self.waiting.pop(seq, None)

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        pool = self._copied([c for cs in self.waiting.values() for c in cs])  # as a step sees it
        for seq in self.bm.tables:
            self._check_content(seq, pool)

    def teardown(self):
        for seq in list(self.bm.tables):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_pages == self.bm.num_pages  # freeing everything returns every page
        assert self.bm.take_copies() == []


class CopyOnForkMachine(BlockManagerMachine):
    share_on_fork = False


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestCopyOnForkProperties = CopyOnForkMachine.TestCase
TestCopyOnForkProperties.settings = TestBlockManagerProperties.settings


def test_prefix_cache_hit_on_second_request():
    bm = BlockManager(num_pages=16, page_size=4)
    prompt = list(range(10))
    assert bm.allocate("a", prompt) == 0
    bm.mark_computed("a", 10)
    assert bm.allocate("b", prompt) == 8  # two full pages reused, the last token recomputed
    assert bm.tables["a"][:2] == bm.tables["b"][:2]
    assert bm.stats()["prefix_hit_tokens"] == 8
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_pages == 2 and bm.num_free_pages == 16
    assert bm.allocate("c", prompt + [99]) == 8  # still cached after the owners are gone


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_policy_picks_the_displaced_page(policy):
    """A prefix reused twice, then a newer one used once: a new prompt needing one cached page
    displaces the older (LRU) or the less reused one (LFU)."""
    bm = BlockManager(num_pages=4, page_size=4, eviction_policy=policy)
    hot, cold = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]  # one full page and one token each

    def run(seq, prompt):
        cached = bm.allocate(seq, prompt)
        bm.mark_computed(seq, len(prompt))
        bm.free(seq)
        return cached

    assert run("a", hot) == 0
    assert run("b", hot) == 4 and run("c", hot) == 4  # reused twice
    assert run("d", cold) == 0  # newer, never reused
    assert bm.num_cached_pages == 2
    run("e", list(range(20, 29)))  # 3 pages: the 2 free ones and one cached page
    kept = {name: bm.cached_prefix_tokens(p) for name, p in (("hot", hot), ("cold", cold))}
    assert kept == ({"hot": 0, "cold": 4} if policy == "lru" else {"hot": 4, "cold": 0})
    bm.check_invariants()
    with pytest.raises(ValueError, match="eviction policy 'fifo'"):
        BlockManager(num_pages=4, page_size=4, eviction_policy="fifo")


def test_uncomputed_pages_are_not_shared():
    bm = BlockManager(num_pages=16, page_size=4)
    bm.allocate("a", list(range(12)))
    bm.mark_computed("a", 4)  # chunked prefill: only the first page is written so far
    assert bm.allocate("b", list(range(12))) == 4


def test_salted_prefixes_are_kept_apart():
    """Pages cached under one salt (a LoRA adapter: other K/V for the same tokens) are reused
    under that salt only; a fork's new pages chain from its parent's salt."""
    bm = BlockManager(num_pages=32, page_size=4)
    prompt = list(range(10))
    assert bm.allocate("a", prompt, salt=("lora", 1)) == 0
    bm.mark_computed("a", 10)
    assert bm.allocate("base", prompt) == 0
    assert bm.allocate("other", prompt, salt=("lora", 2)) == 0
    assert bm.allocate("same", prompt, salt=("lora", 1)) == 8
    bm.fork("a", "child")
    for token in (10, 11):
        bm.append("child", token)
    bm.mark_computed("child", 12)
    assert bm.allocate("longer", prompt + [10, 11, 12], salt=("lora", 1)) == 12
    assert bm.allocate("longer base", prompt + [10, 11, 12]) == 0
    bm.check_invariants()


def test_fork_shares_pages_and_copies_on_write():
    bm = BlockManager(num_pages=8, page_size=4)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])
    bm.mark_computed("p", 6)
    for child in ("c1", "c2", "c3"):
        bm.fork("p", child)
    assert bm.num_used_pages == 2  # n = 4 samples of one prompt: the prompt's pages once
    result = bm.append("c1", 7)
    assert result.copy is not None and result.copy[0] == bm.tables["p"][1]
    assert bm.tables["c1"][0] == bm.tables["p"][0]  # the full first page stays shared
    assert bm.num_used_pages == 3


def test_fork_without_sharing_copies_every_page():
    bm = BlockManager(num_pages=16, page_size=4, share_on_fork=False)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])  # a full page and a partial one
    bm.mark_computed("p", 6)
    copies = {child: bm.fork("p", child) for child in ("c1", "c2", "c3")}
    parent = bm.tables["p"]
    for child, made in copies.items():
        assert made == list(zip(parent, bm.tables[child], strict=True))
        assert not set(bm.tables[child]) & set(parent)
        assert bm.tokens[child] == bm.tokens["p"] and bm.computed[child] == 6
    assert len({page for c in copies for page in bm.tables[c]}) == 3 * len(parent)
    assert all(bm.ref_counts[page] == 1 for table in bm.tables.values() for page in table)
    assert bm.num_used_pages == 4 * len(parent)  # n = 4 without sharing: the prompt 4 times
    assert bm.stats()["fork_pages_copied"] == 3 * len(parent)
    assert bm.take_copies() == [c for child in ("c1", "c2", "c3") for c in copies[child]]
    assert bm.take_copies() == []  # handed over once
    result = bm.append("c1", 7)  # the child's own partial page: no copy-on-write
    assert result.copy is None and result.slot // 4 == bm.tables["c1"][1]
    bm.check_invariants()


def test_fork_copies_of_released_pages_are_dropped():
    bm = BlockManager(num_pages=16, page_size=4, share_on_fork=False)
    bm.allocate("p", list(range(10)))  # three pages
    bm.mark_computed("p", 10)
    bm.fork("p", "gone")
    kept = bm.fork("p", "short")
    bm.fork("p", "kept")
    bm.free("gone")  # e.g. preempted before its copies ran: its pages may be reused
    bm.truncate("short", 5)  # two pages kept
    assert bm.take_copies() == kept[:2] + list(zip(bm.tables["p"], bm.tables["kept"], strict=True))
    bm.check_invariants()


def test_fork_without_sharing_shares_what_does_not_fit():
    bm = BlockManager(num_pages=5, page_size=4, share_on_fork=False, enable_prefix_caching=False)
    bm.allocate("p", list(range(10)))  # three pages, two left
    copies = bm.fork("p", "c")
    assert len(copies) == 2 and bm.num_free_pages == 0
    assert bm.tables["c"][2] == bm.tables["p"][2]  # the last page is shared after all
    assert bm.stats()["fork_pages_shared"] == 1
    bm.check_invariants()
    bm.free("c")
    assert bm.num_free_pages == 2 and bm.ref_counts[bm.tables["p"][2]] == 1


def test_running_out_is_reported_not_raised():
    bm = BlockManager(num_pages=2, page_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", list(range(8))) == 0
    assert bm.allocate("b", [1]) is None
    assert bm.append("a", 9) is None
    bm.check_invariants()
    bm.free("a")
    assert bm.allocate("b", [1]) == 0


def test_lru_eviction_only_when_free_list_empty():
    bm = BlockManager(num_pages=4, page_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    bm.free("a")  # page with [1, 2] stays cached
    assert bm.num_cached_pages == 1
    bm.allocate("b", [7, 8, 9, 10, 11])  # needs 3 pages: the free list suffices
    assert bm.num_cached_pages == 1 and bm.evictions == 0
    bm.allocate("c", [5])  # now the cached page is evicted
    assert bm.evictions == 1 and bm.num_cached_pages == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    bm = BlockManager(4, 4)
    bm.allocate("a", [1])
    with pytest.raises(KeyError):
        bm.allocate("a", [1])
    with pytest.raises(ValueError):
        bm.truncate("a", 5)


def test_block_manager_imports_no_jax():
    import subprocess
    import sys

    code = (
        "import sys, jaxgen.cache.block_manager\n"
        "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
