"""Host-side page bookkeeping for the paged KV cache (pure Python and numpy; no JAX).

- A free list and a reference count per page; a block table per sequence.
- `fork` shares every page of the parent (the partly filled last page too); the first write
  into a shared page copies it first (copy-on-write), which is what makes n > 1 sampling and
  beam search cheap. `share_on_fork=False` turns that off, for measuring what it saves
  (`python -m benchmarks sharing`): the child gets fresh pages and the parent's are copied into
  them.
- Prefix caching: once a full page's keys/values are computed its content is named by a chain
  hash (hash of the parent page's hash and the page's token ids; the first page's parent is the
  sequence's salt, e.g. its LoRA adapter, whose K/V differ for the same tokens). A new sequence
  reuses the pages of its longest cached prefix. Cached pages nobody references stay cached and are
  evicted least-recently-used, only when the free list is empty.
- A slot may be reserved before its token is known (`PENDING`: the overlapped engine loop
  schedules step N+1 while step N, which samples that token, still runs); `set_token` fills it
  in, and a page holding a pending token is not hashed until then.
- Running out of pages is a normal answer (`None`), never an exception or an overwrite: the
  scheduler preempts and retries.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Hashable

import numpy as np

PENDING = -1  # a token whose slot is reserved but whose value is still being sampled


@dataclasses.dataclass
class Append:
    """Where one token goes: its pool slot, and a page copy to do first (copy-on-write)."""

    slot: int
    copy: tuple[int, int] | None  # (src page, dst page)


def chain_hash(parent: Hashable, page_tokens) -> int:
    """The hash of one full page given its parent's (or the salt, for the first page): stable
    across processes (blake2b, not Python's salted `hash`), so the disk and shared tiers find a
    block again after a restart or on another instance."""
    h = hashlib.blake2b(repr(parent).encode(), digest_size=8)
    h.update(np.asarray(page_tokens, np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def page_hashes(tokens: list[int], page_size: int, parent: Hashable = None) -> list[int]:
    """Chain hashes of the full pages of `tokens` (`parent`: the first page's, e.g. a salt)."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = chain_hash(parent, tokens[start : start + page_size])
        hashes.append(parent)
    return hashes


EVICTION_POLICIES = ("lru", "lfu")


class BlockManager:
    """The pages of one KV pool: free list, reference counts, block tables, prefix hashes.

    Args:
      eviction_policy: which cached, unreferenced page a new page displaces when none is free
        (and the tiers below receive): "lru" (least recently used, the default) or "lfu" (the
        one reused least often since it was cached, least recently used among equals).
      share_on_fork: `fork` shares the parent's pages (the default). False: it copies them
        into fresh pages (an engine that cannot share, kept only for the comparison; set it
        while no sequence runs).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        share_on_fork: bool = True,
        store=None,
        eviction_policy: str = "lru",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1: {num_pages=} {page_size=}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction policy {eviction_policy!r} is not one of {list(EVICTION_POLICIES)}"
            )
        self.eviction_policy = eviction_policy
        self._uses: dict[int, int] = {}  # cached page -> prefix hits since it was cached (lfu)
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_on_fork = share_on_fork
        self.ref_counts = np.zeros(num_pages, np.int32)
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._hash_to_page: dict[int, int] = {}
        self._page_hash: dict[int, int] = {}
        self.tables: dict[Hashable, list[int]] = {}
        self.tokens: dict[Hashable, list[int]] = {}  # tokens that have (or will have) a slot
        self.computed: dict[Hashable, int] = {}  # tokens whose K/V are written
        self._chains: dict[Hashable, list[int]] = {}  # chain hashes of computed full pages
        self._salts: dict[Hashable, Hashable] = {}  # the first page's parent in each chain
        # Fork copies (share_on_fork=False) no step has done yet: child -> [(src, dst) pages].
        self._fork_copies: dict[Hashable, list[tuple[int, int]]] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0
        self.fork_pages_copied = 0
        self.fork_pages_shared = 0  # shared by a fork with sharing off: no page was free
        # Tiers below the device (cache.tiers.TieredStore): an evicted cached page is written
        # down (`pending_offload`: (page, hash) whose contents the engine reads off the device
        # before its next step writes the pool), and a prefix found there is loaded into fresh
        # pages (`pending_load`: (page, block) the engine writes before the next step).
        self.store = store
        self.pending_offload: list[tuple[int, int]] = []
        self.pending_load: list[tuple[int, tuple]] = []
        self.tier_hit_tokens = 0
        # Prefetches (`prefetch`): seq -> (future of ({hash: block}, missed hash), pages). The
        # staged blocks of all of them together stay within the pool's size.
        self._prefetch: dict[Hashable, tuple] = {}
        self._prefetch_pages = 0
        self._prompt_hashes: dict[Hashable, list[int]] = {}  # of sequences `prefetch` was asked
        # Write-through (a disaggregated prefill instance): a finished sequence's full pages are
        # queued for the tiers when it is freed, not when the pool evicts them.
        self.write_through = False
        # Which weights computed the pages (`set_weights_key`): part of every chain's root, so
        # K/V of older weights are never found again, on the device or in the tiers below.
        self.weights_key: Hashable = None

    # ------------------------------------------------------------------------------------------
    # Counts and stats
    # ------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free, or cached and unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return int(np.count_nonzero(self.ref_counts))

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_hash)

    def stats(self) -> dict:
        queried = self.prefix_query_tokens
        return {
            "pages_total": self.num_pages,
            "pages_used": self.num_used_pages,
            "pages_free": self.num_free_pages,
            "pages_cached": self.num_cached_pages,
            "prefix_query_tokens": queried,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / queried if queried else 0.0,
            "evictions": self.evictions,
            "fork_pages_copied": self.fork_pages_copied,
            "fork_pages_shared": self.fork_pages_shared,
            "tier_hit_tokens": self.tier_hit_tokens,
        }

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (pages in use keep their contents); later requests
        compute their prompts afresh. Returns the number of pages that were cached."""
        dropped = len(self._page_hash)
        for page in list(self._page_hash):
            self._forget(page)
        self._free.extend(self._evictable)
        self._evictable.clear()
        return dropped

    def root(self, salt: Hashable = None) -> Hashable:
        """The parent of a sequence's first page hash: its salt, under the current weights."""
        return salt if self.weights_key is None else ("weights", self.weights_key, salt)

    def set_weights_key(self, key: Hashable) -> int:
        """New weights from now on (`LLMEngine.replace_params`): cached prefixes are dropped and
        later chains hash under `key`, so no page (or tier block) of the old weights is reused.
        Sequences already holding pages keep them. Returns the pages that were cached."""
        self.weights_key = key
        for seq in list(self._prefetch):
            self.cancel_prefetch(seq)
        self._prompt_hashes.clear()
        return self.reset_prefix_cache()

    def offload_cached(self) -> int:
        """Queues every cached page the tiers below do not hold yet for writing down (the
        engine's `flush_kv_tiers`, e.g. before a restart). Returns how many."""
        if self.store is None:
            return 0
        queued = {p for p, _ in self.pending_offload}
        new = [
            (p, h) for p, h in self._page_hash.items() if p not in queued and h not in self.store
        ]
        self.pending_offload.extend(new)
        return len(new)

    def cached_prefix_tokens(self, prompt: list[int], salt: Hashable = None) -> int:
        """How many leading tokens of `prompt` an `allocate` now would find cached, on the
        device or in the tiers below (a router's question; changes nothing, reads no block)."""
        if not self.enable_prefix_caching:
            return 0
        found = 0
        for h in page_hashes(prompt, self.page_size, self.root(salt)):
            if h not in self._hash_to_page and (self.store is None or h not in self.store):
                break
            found += 1
        usable = len(prompt) // self.page_size - (len(prompt) % self.page_size == 0)
        return min(found, max(usable, 0)) * self.page_size

    def prefetch(
        self, seq: Hashable, prompt: list[int], salt: Hashable = None, wait: bool = False
    ) -> bool:
        """Whether `allocate(seq, prompt)` can run now without waiting on the tiers below.
        The first call for a sequence starts reading the prompt's cached prefix pages that the
        device does not hold (`TieredStore.prefetch`, a background thread for a disk or shared
        store) and `allocate` takes them from there. False while those reads run (the scheduler
        admits other requests meanwhile); `wait=True` waits for them instead (nothing else
        would run). Staged blocks stay within the pool's size: past that, a prefetch waits its
        turn (False), or with `wait=True` `allocate` reads synchronously."""
        if self.store is None or not self.enable_prefix_caching:
            return True
        entry = self._prefetch.get(seq)
        if entry is not None and entry[1] == 0:
            del self._prefetch[seq]  # an earlier "nowhere below" (not admitted then): ask again
            entry = None
        if entry is None:
            hashes = self._prompt_hashes.get(seq)
            if hashes is None:  # a waiting sequence's prompt does not change: hashed once
                hashes = page_hashes(prompt, self.page_size, self.root(salt))
                hashes = hashes[: len(hashes) - (len(prompt) % self.page_size == 0)]
                self._prompt_hashes[seq] = hashes
            start = next((i for i, h in enumerate(hashes) if h not in self._hash_to_page), None)
            if start is None:
                return True  # every usable page is on the device
            if hashes[start] not in self.store:
                # Nowhere below either: `allocate` stops there without reading the store.
                nowhere = concurrent.futures.Future()
                nowhere.set_result(({}, hashes[start]))
                self._prefetch[seq] = (nowhere, 0)
                return True
            keys = hashes[start:]
            if self._prefetch_pages and self._prefetch_pages + len(keys) > self.num_pages:
                return wait
            entry = (self.store.prefetch(keys), len(keys))
            self._prefetch[seq] = entry
            self._prefetch_pages += len(keys)
        future = entry[0]
        if wait and not future.done():
            t0 = time.perf_counter()
            future.result()
            self.store.lookup_seconds += time.perf_counter() - t0
        return future.done()

    def prefetch_started(self, seq: Hashable) -> bool:
        """Whether `prefetch` has been asked about this waiting sequence (and not cancelled)."""
        return seq in self._prefetch

    def cancel_prefetch(self, seq: Hashable) -> None:
        """Drops a waiting sequence's prefetch (aborted, or admitted): its blocks are let go
        when read."""
        self._prompt_hashes.pop(seq, None)
        entry = self._prefetch.pop(seq, None)
        if entry is not None:
            entry[0].cancel()
            self._prefetch_pages -= entry[1]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------------------------------
    # Page pool
    # ------------------------------------------------------------------------------------------
    def _take_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            if self.eviction_policy == "lfu":  # min() keeps the least recent of equals
                page = min(self._evictable, key=lambda p: self._uses.get(p, 0))
                del self._evictable[page]
            else:
                page, _ = self._evictable.popitem(last=False)
            h = self._page_hash.get(page)
            if self.store is not None and h is not None and h not in self.store:
                self.pending_offload.append((page, h))
            self._forget(page)
            self.evictions += 1
        assert self.ref_counts[page] == 0
        self.ref_counts[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        assert self.ref_counts[page] >= 0, f"page {page} released twice"
        if self.ref_counts[page] == 0:
            if page in self._page_hash:
                self._evictable[page] = None  # most recently used at the end
            else:
                self._free.append(page)

    def _forget(self, page: int) -> None:
        self._uses.pop(page, None)
        h = self._page_hash.pop(page, None)
        if h is not None and self._hash_to_page.get(h) == page:
            del self._hash_to_page[h]

    # ------------------------------------------------------------------------------------------
    # Sequences
    # ------------------------------------------------------------------------------------------
    def allocate(
        self, seq: Hashable, prompt: list[int], reuse: bool = True, salt: Hashable = None
    ) -> int | None:
        """Reserves pages for a new sequence's prompt (`reuse=False`: cached prefix pages are
        not reused, every token is computed again). Only sequences of the same `salt` share
        cached pages.

        Returns:
          the number of leading prompt tokens whose K/V are already cached (the caller computes
          only the rest), or None if the prompt does not fit now (nothing changed).
        """
        if seq in self.tables:
            raise KeyError(f"sequence {seq!r} already has pages")
        n = len(prompt)
        # The longest cached prefix, page by page: on the device, or else (after an eviction)
        # in the tiers below, whose blocks are loaded into fresh pages.
        found: list[tuple[int, int | None, tuple | None]] = []  # (hash, device page, block)
        staged, missed = {}, None  # what a prefetch read (`prefetch`)
        entry = self._prefetch.get(seq)
        if entry is not None:
            staged, missed = entry[0].result()
        if self.enable_prefix_caching and reuse:
            hashes = page_hashes(prompt, self.page_size, self.root(salt))
            # The last prompt token is always computed: its logits are needed.
            usable = len(hashes) - (n % self.page_size == 0)
            for h in hashes[:usable]:
                page = self._hash_to_page.get(h)
                if page is not None:
                    found.append((h, page, None))
                    continue
                if h in staged:
                    block = staged[h]
                elif h == missed or self.store is None:
                    block = None  # the prefetch found no tier holding it
                else:
                    block = self.store.get(h)
                if block is None:
                    break
                found.append((h, None, block))
        hits = [page for _, page, _ in found if page is not None]
        chain = [h for h, _, _ in found]
        fresh = self.pages_needed(n) - len(hits)
        revived = sum(1 for p in hits if self.ref_counts[p] == 0)
        if fresh > self.num_free_pages - revived:
            return None  # the prefetched blocks stay staged for the next try
        self.cancel_prefetch(seq)
        for page in hits:
            if self.ref_counts[page] == 0:
                del self._evictable[page]
            self.ref_counts[page] += 1
            self._uses[page] = self._uses.get(page, 0) + 1
        table = []
        for h, page, block in found:
            if page is None:
                page = self._take_page()
                self.pending_load.append((page, block))
                self._page_hash[page] = h
                self._hash_to_page[h] = page
                self.tier_hit_tokens += self.page_size
            table.append(page)
        rest = self.pages_needed(n) - len(found)
        self.tables[seq] = table + [self._take_page() for _ in range(rest)]
        self.tokens[seq] = list(prompt)
        cached = len(found) * self.page_size
        self.computed[seq] = cached
        self._chains[seq] = chain
        self._salts[seq] = self.root(salt)
        self.prefix_query_tokens += n
        self.prefix_hit_tokens += cached
        return cached

    def append(self, seq: Hashable, token: int) -> Append | None:
        """Reserves the slot of one more token; None if a page is needed and none is free."""
        table = self.tables[seq]
        pos = len(self.tokens[seq])
        index = pos // self.page_size
        copy = None
        if index == len(table):
            if not self.num_free_pages:
                return None
            table.append(self._take_page())
        elif self.ref_counts[table[index]] > 1:
            # Shared page (fork): copy it before the first write into it.
            if not self.num_free_pages:
                return None
            src = table[index]
            table[index] = self._take_page()
            self._release(src)
            copy = (src, table[index])
        elif table[index] in self._page_hash:
            self._forget(table[index])  # a truncated cached page is about to change
        self.tokens[seq].append(token)
        return Append(table[index] * self.page_size + pos % self.page_size, copy)

    def can_append(self, seq: Hashable, num_tokens: int = 1) -> bool:
        """Whether `num_tokens` more tokens (with any copy-on-write) fit right now."""
        table, pos = self.tables[seq], len(self.tokens[seq])
        need = self.pages_needed(pos + num_tokens) - len(table)
        if pos % self.page_size and self.ref_counts[table[pos // self.page_size]] > 1:
            need += 1
        return need <= self.num_free_pages

    def append_pages_needed(self, seq: Hashable) -> int:
        """Pages one more token of `seq` takes now: a fresh page or a copy-on-write (0 or 1)."""
        table, pos = self.tables[seq], len(self.tokens[seq])
        if pos // self.page_size == len(table):
            return 1
        return int(self.ref_counts[table[pos // self.page_size]] > 1)

    def set_token(self, seq: Hashable, position: int, token: int) -> None:
        """The value of a token reserved as `PENDING` (a no-op if no slot holds `position`)."""
        tokens = self.tokens[seq]
        if position < len(tokens):
            tokens[position] = token

    def mark_computed(self, seq: Hashable, num_tokens: int) -> None:
        """Records that the first `num_tokens` tokens' K/V are written (or being written by a
        step already dispatched); their full pages become reusable by prefix caching, except
        one holding a `PENDING` token (call again once it is set)."""
        if num_tokens > self.computed[seq]:
            self.computed[seq] = num_tokens
        chain, ps = self._chains[seq], self.page_size
        if not self.enable_prefix_caching or self.computed[seq] // ps <= len(chain):
            return  # no full page to name
        tokens, table = self.tokens[seq], self.tables[seq]
        for i in range(len(chain), self.computed[seq] // ps):
            page_tokens = tuple(tokens[i * ps : (i + 1) * ps])
            if PENDING in page_tokens:
                break
            h = chain_hash(chain[-1] if chain else self._salts[seq], page_tokens)
            chain.append(h)
            page = table[i]
            if page not in self._page_hash and h not in self._hash_to_page:
                self._page_hash[page] = h
                self._hash_to_page[h] = page

    def fork(self, parent: Hashable, child: Hashable) -> list[tuple[int, int]]:
        """The child starts with the parent's tokens and pages.

        With `share_on_fork` it shares every page, counted by reference. Without, each page is
        copied into a fresh one; a page that finds no free page is shared after all (counted in
        `fork_pages_shared`; copy-on-write still guards it), so a fork never fails.

        Returns:
          the (parent page, child page) copies (none when sharing). They must run before the
          next step, not the current one (the current one may still be writing the parent's
          K/V): they wait in the block manager until `take_copies()` hands them to a step, and
          are dropped if the child releases the pages first.
        """
        if child in self.tables:
            raise KeyError(f"sequence {child!r} already has pages")
        # The copies of one step all read the pool as it was before the step, so a page still
        # waiting for its copy can be neither copied nor shared (no engine path forks so).
        assert not self._fork_copies.get(parent), "fork of a sequence whose copies wait"
        table, copies = [], []
        for page in self.tables[parent]:
            if self.share_on_fork or not self.num_free_pages:
                self.ref_counts[page] += 1
                table.append(page)
                self.fork_pages_shared += not self.share_on_fork
            else:
                table.append(self._take_page())
                copies.append((page, table[-1]))
        self.tables[child] = table
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self._chains[child] = list(self._chains[parent])
        self._salts[child] = self._salts[parent]
        if copies:
            self._fork_copies[child] = copies
            self.fork_pages_copied += len(copies)
        return list(copies)

    def take_copies(self) -> list[tuple[int, int]]:
        """The fork copies (share_on_fork=False) waiting for a step, oldest first; they are the
        caller's to do from now on. Call it once per step, after the step's last `free` and
        before its forks (`fork`)."""
        copies = [c for waiting in self._fork_copies.values() for c in waiting]
        self._fork_copies.clear()
        return copies

    def truncate(self, seq: Hashable, length: int) -> None:
        """Forgets tokens from `length` on (speculative rollback); whole pages are released."""
        tokens, table = self.tokens[seq], self.tables[seq]
        if not 0 <= length <= len(tokens):
            raise ValueError(f"cannot truncate {len(tokens)} tokens to {length}")
        del tokens[length:]
        keep = self.pages_needed(length)
        for page in table[keep:]:
            self._release(page)
        if seq in self._fork_copies:  # a released page needs no copy (it may be reused)
            kept = set(table[:keep])
            self._fork_copies[seq] = [c for c in self._fork_copies[seq] if c[1] in kept]
        del table[keep:]
        self.computed[seq] = min(self.computed[seq], length)
        del self._chains[seq][length // self.page_size :]

    def free(self, seq: Hashable) -> None:
        if self.write_through and self.store is not None:
            queued = {p for p, _ in self.pending_offload}
            for page in self.tables[seq]:
                h = self._page_hash.get(page)
                if h is not None and page not in queued and h not in self.store:
                    self.pending_offload.append((page, h))
        for page in self.tables.pop(seq):
            self._release(page)
        self._fork_copies.pop(seq, None)  # its pages may be handed out again in this step
        del self.tokens[seq], self.computed[seq], self._chains[seq], self._salts[seq]

    def slots(self, seq: Hashable, start: int, end: int) -> np.ndarray:
        """Pool slots of the sequence's token positions [start, end)."""
        pos = np.arange(start, end)
        table = np.asarray(self.tables[seq], np.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def check_invariants(self) -> None:
        """Asserts the bookkeeping is consistent (used by the property tests)."""
        counts = np.zeros(self.num_pages, np.int64)
        for table in self.tables.values():
            for page in table:
                counts[page] += 1
        assert np.array_equal(counts, self.ref_counts), "ref counts != table memberships"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "page twice in the free list"
        assert not free & evictable
        referenced = set(np.flatnonzero(self.ref_counts).tolist())
        assert not referenced & (free | evictable), "a referenced page is free"
        assert len(free) + len(evictable) + len(referenced) == self.num_pages, "pages leaked"
        assert evictable <= set(self._page_hash), "evictable page without a hash"
        for page, h in self._page_hash.items():
            assert self._hash_to_page.get(h) == page
        for seq, table in self.tables.items():
            assert len(table) == self.pages_needed(len(self.tokens[seq]))
        for seq, copies in self._fork_copies.items():
            for src, dst in copies:
                assert dst in self.tables[seq] and self.ref_counts[dst] == 1, "fork copy target"
                assert src != dst
