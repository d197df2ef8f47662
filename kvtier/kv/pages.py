"""The block pool: page ids, reference counts, the free ids, the cached-page LRU, and page runs.

A page holds `page_size` consecutive tokens of one sequence (all layers; the tensors live in
`PagedKVStore`). The pool knows only ids, refcounts and hashes:

    state            ref   hash   where
    free             0     None   the free ids (`allocate` takes the lowest)
    in use           >=1   any    some sequences' block tables
    lent             1     None   a run of consecutive ids a tiered store's buffers live in (`lent`)
    cached, idle     0     set    `lru` (oldest first): reusable, but a prefix hit revives it

`allocate` takes the lowest free page first; when there is none it evicts the least recently used
cached page (calling `on_evict(page, hash)` first, so the host tier can save its contents).
`take_run(n)` lends the highest n consecutive unreferenced ids at once (evicting the cached ones
among them): sequences fill the pool from the bottom and runs from the top, so a run finds room
while the batch uses less than the rest. When a sequence that took high ids outlives the ones
below it, the free ids are split; `compaction(n)` then plans the moves of referenced pages down
to free ids that make a stretch of n, and `move` carries one out (the caller copies the page's
tensors and rewrites the block tables that hold it).

    ids   0 ..................................................... N - 1
          [seq pages, lowest first ->   free / cached   <- lent runs, highest first]
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from kvtier.errors import ConfigError

EvictHook = Callable[[int, bytes], object]


class PagePool:
    """Page ids 0 .. num_pages - 1 with refcounts, a hash -> page map (prefix cache) and lent runs."""

    def __init__(self, num_pages: int, on_evict: EvictHook | None = None) -> None:
        if num_pages < 1:
            raise ConfigError(f"the KV pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.on_evict = on_evict
        self.ref = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self._heap: list[int] = list(range(num_pages))  # free ids; stale entries are skipped
        self._is_free = bytearray(b"\x01") * num_pages
        self._num_free = num_pages
        self.lru: OrderedDict[int, None] = OrderedDict()  # idle cached pages, oldest first
        self.cached: dict[bytes, int] = {}
        self.lent: dict[int, int] = {}  # first id of a lent run -> its length
        self.evictions = 0

    # -- counts --------------------------------------------------------------------------------

    @property
    def free(self) -> list[int]:
        """The free ids, lowest first (the order `allocate` takes them in)."""
        return [p for p in range(self.num_pages) if self._is_free[p]]

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: free ones plus idle cached ones."""
        return self._num_free + len(self.lru)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence or lent to a run."""
        return self.num_pages - self._num_free - len(self.lru)

    @property
    def num_lent(self) -> int:
        return sum(self.lent.values())

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self) -> int | None:
        """A page with refcount 1, or None when every page is in use. Mutates the pool."""
        if self.num_free == 0:
            return None
        if self._num_free:
            page = heapq.heappop(self._heap)
            while not self._is_free[page]:  # NOTE: lent since it was freed
                page = heapq.heappop(self._heap)
            self._take_free(page)
        else:
            page, _ = self.lru.popitem(last=False)
            self._evict(page)
        self.ref[page] = 1
        return page

    def _take_free(self, page: int) -> None:
        self._is_free[page] = 0
        self._num_free -= 1

    def _put_free(self, page: int) -> None:
        self._is_free[page] = 1
        self._num_free += 1
        heapq.heappush(self._heap, page)

    def _evict(self, page: int) -> None:
        """Drop idle cached `page`'s hash (saving it through `on_evict`); it is then unowned."""
        h = self.page_hash[page]
        assert h is not None
        if self.on_evict is not None:
            self.on_evict(page, h)
        del self.cached[h]
        self.page_hash[page] = None
        self.evictions += 1

    def touch(self, page: int) -> None:
        """One more reference to `page` (a prefix hit); revives it from the LRU if idle."""
        if self.ref[page] == 0:
            del self.lru[page]
        self.ref[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference. An unreferenced page goes to the LRU if cached, else to the free ids."""
        assert self.ref[page] > 0, f"page {page} released more often than referenced"
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if self.page_hash[page] is not None:
                self.lru[page] = None
            else:
                self._put_free(page)

    # -- runs ----------------------------------------------------------------------------------

    def largest_run(self) -> int:
        """The longest stretch of consecutive unreferenced ids (free or idle cached): the
        largest run `take_run` can lend now."""
        best = here = 0
        for r in self.ref:
            here = here + 1 if r == 0 else 0
            best = max(best, here)
        return best

    def take_run(self, count: int) -> int | None:
        """Lend the highest `count` consecutive unreferenced ids (evicting the cached ones among
        them); returns the first id, or None when no such stretch exists. Mutates the pool."""
        if count < 1 or count > self.num_pages:
            return None
        here = 0
        for first in range(self.num_pages - 1, -1, -1):
            here = here + 1 if self.ref[first] == 0 else 0
            if here == count:
                break
        else:
            return None
        for page in range(first, first + count):
            if self._is_free[page]:
                self._take_free(page)
            else:
                del self.lru[page]
                self._evict(page)
            self.ref[page] = 1
        self.lent[first] = count
        return first

    def compaction(self, count: int) -> list[tuple[int, int]]:
        """Moves (from, to) of referenced pages that leave `count` consecutive unreferenced ids:
        in the window of `count` ids without a lent page that holds the fewest referenced ones
        (the highest among equals), each of those goes to the lowest free id outside the window.
        Empty when a stretch of `count` exists already or no window can be emptied that way."""
        n = self.num_pages
        if count < 1 or count > n or self.largest_run() >= count:
            return []
        lent = bytearray(n)
        for first, length in self.lent.items():
            lent[first : first + length] = b"\x01" * length
        best: tuple[int, int] | None = None  # (moves, -first)
        held = blocked = free = 0  # in the window
        for last in range(n):  # the window [last - count + 1, last]
            held += self.ref[last] > 0 and not lent[last]
            blocked += lent[last]
            free += self._is_free[last]
            if last >= count:
                out = last - count
                held -= self.ref[out] > 0 and not lent[out]
                blocked -= lent[out]
                free -= self._is_free[out]
            first = last - count + 1
            fits = self._num_free - free >= held  # free ids outside the window for its pages
            if first >= 0 and not blocked and fits and (best is None or (held, -first) <= best):
                best = (held, -first)
        if best is None:
            return []
        first = -best[1]
        outside = (p for p in range(n) if self._is_free[p] and not first <= p < first + count)
        sources = [p for p in range(first, first + count) if self.ref[p] > 0]
        return list(zip(sources, outside, strict=False))

    def move(self, src: int, dst: int) -> None:
        """Give referenced page `src`'s references and hash to free page `dst`; `src` is free
        after (one step of a `compaction`). Mutates the pool."""
        assert self.ref[src] > 0 and self._is_free[dst], "a move takes a referenced page to a free id"
        assert all(not (f <= src < f + k) for f, k in self.lent.items()), "a lent page stays put"
        self._take_free(dst)
        self.ref[dst], self.ref[src] = self.ref[src], 0
        h = self.page_hash[src]
        if h is not None:
            self.cached[h] = dst
        self.page_hash[dst], self.page_hash[src] = h, None
        self._put_free(src)

    def return_run(self, first: int) -> None:
        """Take back the run lent at `first`: its ids are free again."""
        count = self.lent.pop(first)
        for page in range(first, first + count):
            self.ref[page] = 0
            self._put_free(page)

    # -- prefix cache --------------------------------------------------------------------------

    def lookup(self, h: bytes) -> int | None:
        """The device page cached under hash `h`, if any. Does not change refcounts."""
        return self.cached.get(h)

    def register(self, page: int, h: bytes) -> bool:
        """Cache the full, in-use `page` under `h`; False if `h` is already cached elsewhere."""
        if h in self.cached or self.page_hash[page] is not None:
            return False
        self.cached[h] = page
        self.page_hash[page] = h
        return True

    def reset_cache(self) -> int:
        """Forget every hash; idle cached pages become free. Returns how many hashes were dropped."""
        dropped = len(self.cached)
        for page in self.lru:
            self._put_free(page)
        self.lru.clear()
        self.cached.clear()
        self.page_hash = [None] * self.num_pages
        return dropped
