"""Per-sequence KV pages over the shared pool: allocation, prefix matching, caching, freeing.

Request-level layer on top of `PagePool` (ids and refcounts), `HostPageCache` (host tier) and
`PagedKVStore` (the tensors). None of it touches the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine.batch.sequence import Sequence
from kvtier.kv.paged import PagedKVStore
from kvtier.kv.pages import PagePool
from kvtier.kv.prefix_cache import HostPageCache, extend_hashes


@dataclass
class CacheStats:
    """Prefix-cache counters, in tokens (vLLM's `prefix_cache_queries` / `_hits`)."""

    queries: int = 0
    hits: int = 0
    host_hits: int = 0  # tokens copied back from the host tier instead of recomputed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables of the running sequences over one `PagedKVStore`."""

    def __init__(self, store: PagedKVStore, num_host_pages: int = 0, prefix_caching: bool = True) -> None:
        self.store = store
        self.page_size = store.page_size
        self.prefix_caching = prefix_caching
        # NOTE: the page-major storage as ONE device tensor: a host slot holds a page of every
        # layer, so a run of slots is one copy each way, not one per layer
        self.host = HostPageCache([store.storage], num_host_pages if prefix_caching else 0)
        self.pool = PagePool(store.num_pages, on_evict=self.host.save)
        self.stats = CacheStats()

    def pages_needed(self, seq: Sequence, n_tokens: int) -> int:
        """New pages `seq` needs so that its block table covers `n_tokens` tokens."""
        return max(0, -(-n_tokens // self.page_size) - len(seq.block_table))

    def admit(self, seq: Sequence) -> int:
        """Give a sequence without pages its cached prefix pages; returns the tokens found.

        Matches whole pages of tokens[:-1] (the last token is always computed, for its logits).
        Device hits are shared (refcount + 1); host hits are copied into a fresh page.
        """
        assert not seq.block_table and seq.num_computed == 0
        return self._match(seq) if self.prefix_caching and seq.own is None else 0

    def record_admission(self, seq: Sequence, found: int) -> None:
        """Count a first admission's prefix-cache query (a re-admission after preemption is not one)."""
        if not seq.admitted:
            seq.admitted = True
            seq.cached_tokens = found
            if seq.own is None:  # NOTE: a sequence with its own store never queries the cache
                self.stats.queries += len(seq.prompt)
                self.stats.hits += found

    def _match(self, seq: Sequence) -> int:
        p, limit = self.page_size, len(seq.tokens) - 1
        extend_hashes(seq.hashes, seq.tokens, p, seq.root, limit)
        chain = seq.hashes[: limit // p]
        for h in chain:
            # NOTE: the evictions below save device pages to the host tier; pinned, the host
            # hits they would otherwise push out stay until they are loaded
            if self.pool.lookup(h) is None:
                if h not in self.host:
                    break
                self.host.pin(h)
        from_host: list[tuple[int, int]] = []  # (host slot, device page), copied at the end
        for h in chain:
            page = self.pool.lookup(h)
            if page is not None:
                self.pool.touch(page)
            elif h in self.host:
                slot = self.host.take(h)
                page = self.pool.allocate()
                if page is None:
                    self.host.put_back(h, slot)
                    break
                from_host.append((slot, page))
                self.pool.register(page, h)
                self.stats.host_hits += p
            else:
                break
            seq.block_table.append(page)
        self.host.unpin_all()
        # NOTE: after the loop's evictions (their saves are queued first, so a page saved and
        # then reused here is read before it is overwritten)
        self.host.load_slots(from_host)
        seq.num_computed = len(seq.block_table) * p
        seq.num_registered = len(seq.block_table)
        return seq.num_computed

    def allocate(self, seq: Sequence, n_tokens: int) -> bool:
        """Grow the block table to cover `n_tokens` tokens; False (nothing taken) if pages run out.
        A sequence with a store of its own (`seq.own`) takes no pages."""
        if seq.own is not None:
            return True
        need = self.pages_needed(seq, n_tokens)
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            page = self.pool.allocate()
            assert page is not None
            seq.block_table.append(page)
        return True

    def commit(self, seq: Sequence, n_new: int) -> None:
        """After a step computed `n_new` tokens of `seq`: count them, cache the pages now full."""
        seq.num_computed += n_new
        if not self.prefix_caching or seq.own is not None:
            return
        full = seq.num_computed // self.page_size
        if full > seq.num_registered:
            extend_hashes(seq.hashes, seq.tokens, self.page_size, seq.root, full * self.page_size)
            for i in range(seq.num_registered, full):
                self.pool.register(seq.block_table[i], seq.hashes[i])
            seq.num_registered = full

    def free(self, seq: Sequence) -> None:
        """Release every page of `seq`, tail first (so a chain's tail is evicted before its head)."""
        for page in reversed(seq.block_table):
            self.pool.release(page)
        seq.block_table = []
        seq.num_computed = seq.num_registered = 0

    def reset_prefix_cache(self) -> int:
        """Forget all cached pages, device and host. Returns the device hashes dropped."""
        self.host.clear()
        return self.pool.reset_cache()
