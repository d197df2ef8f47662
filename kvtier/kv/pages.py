"""The block pool: page ids, reference counts, an O(1) free list and the cached-page LRU.

A page holds `page_size` consecutive tokens of one sequence (all layers; the tensors live in
`PagedKVStore`). The pool knows only ids, refcounts and hashes:

    state            ref   hash   where
    free             0     None   `free` deque (allocated from the left, returned on the right)
    in use           >=1   any    some sequences' block tables
    cached, idle     0     set    `lru` (oldest first): reusable, but a prefix hit revives it

`allocate` takes a free page first; when there is none it evicts the least recently used
cached page (calling `on_evict(page, hash)` first, so the host tier can save its contents).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from kvtier.errors import ConfigError

EvictHook = Callable[[int, bytes], object]


class PagePool:
    """Page ids 0 .. num_pages - 1 with refcounts and a hash -> page map (prefix cache)."""

    def __init__(self, num_pages: int, on_evict: EvictHook | None = None) -> None:
        if num_pages < 1:
            raise ConfigError(f"the KV pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.on_evict = on_evict
        self.ref = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.lru: OrderedDict[int, None] = OrderedDict()  # idle cached pages, oldest first
        self.cached: dict[bytes, int] = {}
        self.evictions = 0

    # -- counts --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: free ones plus idle cached ones."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.num_free

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self) -> int | None:
        """A page with refcount 1, or None when every page is in use. Mutates the pool."""
        if self.free:
            page = self.free.popleft()
        elif self.lru:
            page, _ = self.lru.popitem(last=False)
            h = self.page_hash[page]
            assert h is not None
            if self.on_evict is not None:
                self.on_evict(page, h)
            del self.cached[h]
            self.page_hash[page] = None
            self.evictions += 1
        else:
            return None
        self.ref[page] = 1
        return page

    def touch(self, page: int) -> None:
        """One more reference to `page` (a prefix hit); revives it from the LRU if idle."""
        if self.ref[page] == 0:
            del self.lru[page]
        self.ref[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference. An unreferenced page goes to the LRU if cached, else to the free list."""
        assert self.ref[page] > 0, f"page {page} released more often than referenced"
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if self.page_hash[page] is not None:
                self.lru[page] = None
            else:
                self.free.append(page)

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
            self.free.append(page)
        self.lru.clear()
        self.cached.clear()
        self.page_hash = [None] * self.num_pages
        return dropped
