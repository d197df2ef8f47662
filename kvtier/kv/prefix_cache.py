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

    Holds one tensor per layer, [num_slots, page_size, 2, H_kv, D], pinned when the device is
    CUDA, so a later prefix hit copies a page back instead of recomputing it.
    """

    def __init__(self, device_pages: list[torch.Tensor], num_slots: int) -> None:
        self.device_pages = device_pages  # per layer [num_pages, P, 2, H_kv, D]
        self.num_slots = num_slots
        pin = device_pages[0].device.type == "cuda" if device_pages else False
        self.slots = (
            [torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in device_pages]
            if num_slots > 0
            else []
        )
        self.free: deque[int] = deque(range(num_slots))
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.saved = self.loaded = self.dropped = 0

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
            _, slot = self.lru.popitem(last=False)
            self.dropped += 1
        for host, dev in zip(self.slots, self.device_pages, strict=True):
            host[slot].copy_(dev[page], non_blocking=True)
        self.lru[h] = slot
        self.saved += 1
        return True

    def load(self, h: bytes, page: int) -> None:
        """Copy the page cached under `h` into device `page`, and free its host slot. Mutates."""
        slot = self.lru.pop(h)
        for host, dev in zip(self.slots, self.device_pages, strict=True):
            dev[page].copy_(host[slot], non_blocking=True)
        self.free.append(slot)
        self.loaded += 1

    def clear(self) -> None:
        """Drop every saved page."""
        self.free.extend(self.lru.values())
        self.lru.clear()
