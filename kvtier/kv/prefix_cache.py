"""Prefix-cache keys (chained page hashes) and the host tier that evicted pages move to.

The hash of page i covers the whole prefix up to the end of that page:

    root = sha256(salt)                      salt: model, dtype, KV policy (+ a request's cache_salt)
    h[0] = sha256(root  || tokens[0 : P])
    h[i] = sha256(h[i-1] || tokens[i*P : (i+1)*P])

so equal hashes mean equal prefixes, and only FULL pages have a hash. The same key finds a page
on the device (`PagePool.cached`) or on the host (`HostPageCache`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import torch

from kvtier.kv.tiers import HostArena, TierAccount, balanced_slab_bytes


def root_hash(salt: str) -> bytes:
    """The parent hash of a sequence's first page."""
    return hashlib.sha256(b"kvtier-prefix\0" + salt.encode()).digest()


def extend_hashes(hashes: list[bytes], tokens: list[int], page_size: int, root: bytes, limit: int) -> None:
    """Append the hashes of the full pages of tokens[:limit] that `hashes` does not have yet."""
    for i in range(len(hashes), limit // page_size):
        parent = hashes[-1] if hashes else root
        chunk = array("q", tokens[i * page_size : (i + 1) * page_size]).tobytes()
        hashes.append(hashlib.sha256(parent + chunk).digest())


class HostPageCache:
    """Pages evicted from the device pool, kept in host memory by hash (LRU; dropped when full).

    A slot holds one page of every layer: per layer an extent [page_size, 2, H_kv, D] of a
    `HostArena` (the tiered store's host memory: pinned slabs on CUDA, allocated whole and not
    zeroed), so a later prefix hit copies a page back instead of recomputing it. Every slot is
    taken at construction; `account` counts their bytes in the host tier.
    """

    def __init__(
        self, device_pages: list[torch.Tensor], num_slots: int, account: TierAccount | None = None
    ) -> None:
        self.device_pages = device_pages  # per layer [num_pages, P, 2, H_kv, D]
        self.num_slots = num_slots
        self.account = account if account is not None else TierAccount()
        pin = device_pages[0].device.type == "cuda" if device_pages else False
        self.arenas = [
            HostArena(
                tuple(t.shape[1:]),
                t.dtype,
                pin,
                self.account,
                slab_bytes=slab_bytes(t[0].numel() * t.element_size(), num_slots, pin),
            )
            for t in (device_pages if num_slots > 0 else [])
        ]
        # slots[layer][slot]: [P, 2, H_kv, D], row slot % per of slab slot // per
        self.slots = [[arena.take() for _ in range(num_slots)] for arena in self.arenas]
        self._slabs = [arena.slabs() for arena in self.arenas]  # per layer [per, P, 2, H_kv, D]
        self._per = self.arenas[0].extents_per_slab if self.arenas else 1
        self.free: deque[int] = deque(range(num_slots))
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.saved = self.loaded = self.dropped = 0
        self._pinned: set[bytes] = set()  # entries `save` must not drop (a subset of lru)
        self._saved: torch.cuda.Event | None = None  # the last save's copies, on CUDA

    @property
    def num_used(self) -> int:
        return len(self.lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru

    def save(self, page: int, h: bytes) -> bool:
        """Copy device `page` to a host slot under `h` (dropping the oldest if full). Mutates."""
        if self.num_slots == 0 or h in self.lru:
            return False
        if self.free:
            slot = self.free.popleft()
        else:
            if len(self._pinned) >= len(self.lru):
                return False  # every entry is about to be loaded: the page is not kept
            victim = next(k for k in self.lru if k not in self._pinned)  # the oldest unpinned
            slot = self.lru.pop(victim)
            self.dropped += 1
        for host, dev in zip(self.slots, self.device_pages, strict=True):
            host[slot].copy_(dev[page], non_blocking=True)  # NOTE: host is a list of extents
        if self.device_pages[0].is_cuda:  # `load_slots` reads host slots on the host: wait for this
            self._saved = torch.cuda.Event()
            self._saved.record()
        self.lru[h] = slot
        self.saved += 1
        return True

    def load(self, h: bytes, page: int) -> None:
        """Copy the page cached under `h` into device `page`, and free its host slot. Mutates."""
        self.load_slots([(self.take(h), page)])

    def pin(self, h: bytes) -> None:
        """Keep `h` from being dropped by `save` until it is taken or `unpin_all` (a prefix
        match pins the host hits it is about to load, as its own evictions save pages here)."""
        self.lru.move_to_end(h)
        self._pinned.add(h)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def take(self, h: bytes) -> int:
        """The slot cached under `h`, out of the cache; `load_slots` copies it and frees it
        (`put_back` returns it untouched)."""
        self._pinned.discard(h)
        return self.lru.pop(h)

    def put_back(self, h: bytes, slot: int) -> None:
        """A slot from `take` that will not be loaded, back in the cache under `h`."""
        self.lru[h] = slot

    def load_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots into device pages, (slot, page) pairs, and free the slots: per layer
        and slab one gather on the host, one copy to the device and one scatter into the pages
        (page by page, a 32K-token prefix of Llama-3-8B is 65,536 copies of 64 KiB, each a
        launch on the host). Asynchronous on CUDA."""
        if not pairs:
            return
        self.loaded += len(pairs)
        by_slab: dict[int, tuple[list[int], list[int]]] = {}
        for slot, page in pairs:
            slab, row = divmod(slot, self._per)
            rows, pages = by_slab.setdefault(slab, ([], []))
            rows.append(row)
            pages.append(page)
        device = self.device_pages[0].device
        pin = device.type == "cuda"
        if self._saved is not None:
            # NOTE: a slot saved since the last step may still be in flight from the device
            self._saved.synchronize()
            self._saved = None
        groups = [
            (slab, torch.tensor(rows), torch.tensor(pages, device=device))
            for slab, (rows, pages) in by_slab.items()
        ]
        for slabs, dev in zip(self._slabs, self.device_pages, strict=True):
            for slab, rows_t, pages_t in groups:
                src = slabs[slab]
                staged = torch.empty((len(rows_t), *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
                torch.index_select(src, 0, rows_t, out=staged)  # [k, P, 2, H_kv, D] on the host
                dev.index_copy_(0, pages_t, staged.to(device, non_blocking=True))
        self.free.extend(slot for slot, _ in pairs)

    def clear(self) -> None:
        """Drop every saved page."""
        self.free.extend(self.lru.values())
        self.lru.clear()
        self._pinned.clear()


def slab_bytes(page_bytes: int, num_slots: int, pinned: bool) -> int:
    """Slabs for `num_slots` pages of `page_bytes` each. Pinned, where PyTorch's pinned allocator rounds
    every request up to a power of two, the largest power-of-two slab (at most 1 GiB) whose
    slabs waste at most 1/32 of the pages' bytes (one tensor of them all could waste half);
    elsewhere slabs split evenly, wasting at most one page each."""
    if not pinned:
        return balanced_slab_bytes(page_bytes, num_slots)
    total = page_bytes * num_slots
    for bits in range(30, 19, -1):  # 1 GiB down to 1 MiB
        size = 1 << bits
        if size < page_bytes:
            break
        slabs = -(-num_slots // (size // page_bytes))
        if slabs * size - total <= total // 32:
            return size
    return 1 << max(20, (page_bytes - 1).bit_length())
