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

    A slot holds one page of every device tensor in `device_pages` (each [num_pages, ...], pages
    along dim 0): per tensor an extent of a `HostArena` (the tiered store's host memory: pinned
    slabs on CUDA, allocated whole and not zeroed), so a later prefix hit copies a page back
    instead of recomputing it. The server passes its page-major storage [N, L, P, 2, H_kv, D] as
    the one tensor, so a slot is a page of every layer and a run of slots one copy. Every slot
    is taken at construction; `account` counts their bytes in the host tier.
    """

    def __init__(
        self, device_pages: list[torch.Tensor], num_slots: int, account: TierAccount | None = None
    ) -> None:
        self.device_pages = device_pages  # each [num_pages, ...]: e.g. [N, L, P, 2, H_kv, D]
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
        self._pending: dict[int, int] = {}  # host slot -> device page, saved but not copied yet
        self._saved: torch.cuda.Event | None = None  # the last save's copies, on CUDA
        self._pin = pin
        self._staging: torch.Tensor | None = None  # `load_slots`' host gathers, bytes
        self._staged: torch.cuda.Event | None = None  # the last copy out of _staging, on CUDA
        self.gathered = 0  # `load_slots` calls whose slots were too scattered to copy by runs

    @property
    def num_used(self) -> int:
        return len(self.lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru

    def save(self, page: int, h: bytes) -> bool:
        """Keep device `page` in a host slot under `h` (dropping the oldest if full); the copy is
        queued by the next `flush`, which must come before anything writes the page again (the
        batch step flushes after scheduling; `load_slots` flushes first). Mutates."""
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
        self._pending[slot] = page  # NOTE: a dropped entry's pending copy is replaced
        self.lru[h] = slot
        self.saved += 1
        return True

    @property
    def chunk_pages(self) -> int:
        """Pages one gather on the device moves at most (its temporary is at most CHUNK_BYTES)."""
        page = sum(t[0].numel() * t.element_size() for t in self.device_pages)
        return max(1, CHUNK_BYTES // max(1, page))

    def flush(self) -> None:
        """Queue the copies of the pages `save` took since the last flush: per device tensor and
        at most `chunk_pages` pages, one gather on the device and one copy per run of
        consecutive host slots (page by page, evicting 2,048 pages of Llama-3-8B was 65,536
        copies of 64 KiB, each a launch on the host). Asynchronous on CUDA."""
        if not self._pending:
            return
        pairs = sorted(self._pending.items())  # (slot, page)
        self._pending.clear()
        device = self.device_pages[0].device
        step = self.chunk_pages
        for start in range(0, len(pairs), step):
            runs, pages = slot_runs(pairs[start : start + step], self._per)
            pages_t = torch.tensor(pages).to(device, non_blocking=True)  # [k]
            for slabs, dev in zip(self._slabs, self.device_pages, strict=True):
                staged = dev.index_select(0, pages_t)  # [k, P, 2, H_kv, D] on the device
                off = 0
                for slab, r0, r1 in runs:  # device -> pinned slab: an asynchronous copy each
                    slabs[slab][r0:r1].copy_(staged[off : off + r1 - r0], non_blocking=True)
                    off += r1 - r0
        if device.type == "cuda":  # `load_slots` reads host slots on the host: wait for this
            self._saved = torch.cuda.Event()
            self._saved.record()

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
        """Copy host slots into device pages, (slot, page) pairs, and free the slots. Mutates;
        asynchronous on CUDA.

        The slots, sorted, go `chunk_pages` at a time; they form runs of consecutive rows of a
        slab, and per device tensor (the server's one: every layer at once) each run is one copy
        from the pinned slab straight into a device buffer [k, ...], and one `index_copy_` puts
        the buffer's rows into their pages. Slots scattered into many short
        runs (more than max(8, k // 8)) are gathered on the host instead, into one pinned
        buffer the cache keeps across layers and calls. Gathered on the host into a fresh pinned
        buffer per layer and slab (512 of them for 2,047 pages in 8 MiB slabs), a 32K-token
        prefix hit of Llama-3-8B took 1.94 s on the H200, against ~0.08 s for its 4.3 GB at
        PCIe speed (bench/results/serve_gpu_24gib_b7512d8.json)."""
        self.flush()  # NOTE: a page saved this step may be one these loads overwrite
        if not pairs:
            return
        self.loaded += len(pairs)
        ordered, step = sorted(pairs), self.chunk_pages
        for start in range(0, len(ordered), step):
            self._load_chunk(ordered[start : start + step])
        self.free.extend(slot for slot, _ in pairs)

    def _load_chunk(self, pairs: list[tuple[int, int]]) -> None:
        """`load_slots` for at most `chunk_pages` pairs (a temporary of at most CHUNK_BYTES)."""
        device = self.device_pages[0].device
        runs, pages = slot_runs(pairs, self._per)
        k = len(pages)
        pages_t = torch.tensor(pages).to(device, non_blocking=True)  # [k] the page of each staged row
        rows: dict[int, list[int]] = {}  # slab -> its rows in the runs' order, if scattered
        if len(runs) > max(8, k // 8):
            self.gathered += 1
            if self._saved is not None:
                # NOTE: the host reads the slots, which saves queued on the stream may still be
                # writing (the device copies below are ordered after them on the stream)
                self._saved.synchronize()
                self._saved = None
            for slab, r0, r1 in runs:
                rows.setdefault(slab, []).extend(range(r0, r1))
        gathers = [(slab, torch.tensor(r)) for slab, r in rows.items()]
        for slabs, dev in zip(self._slabs, self.device_pages, strict=True):
            if gathers:
                staged = self._host_buffer(k, slabs[0])  # [k, P, 2, H_kv, D] on the host
                off = 0
                for slab, rows_t in gathers:
                    torch.index_select(slabs[slab], 0, rows_t, out=staged[off : off + len(rows_t)])
                    off += len(rows_t)
                staged = staged.to(device, non_blocking=True)
                if self._pin:
                    self._staged = torch.cuda.Event()
                    self._staged.record()
            else:
                staged = torch.empty((k, *dev.shape[1:]), dtype=dev.dtype, device=device)
                off = 0
                for slab, r0, r1 in runs:  # pinned slab -> device: an asynchronous copy each
                    staged[off : off + r1 - r0].copy_(slabs[slab][r0:r1], non_blocking=True)
                    off += r1 - r0
            dev.index_copy_(0, pages_t, staged)

    def _host_buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """The cache's host staging buffer as [rows, *like.shape[1:]] of like's dtype (pinned on
        CUDA; grown when too small, never shrunk), once the last copy out of it has finished."""
        if self._staged is not None:  # NOTE: the DMA reads pinned memory the host is about to overwrite
            self._staged.synchronize()
            self._staged = None
        nbytes = rows * like[0].numel() * like.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        return self._staging[:nbytes].view(like.dtype).view(rows, *like.shape[1:])

    def clear(self) -> None:
        """Drop every saved page."""
        self.free.extend(self.lru.values())
        self.lru.clear()
        self._pinned.clear()
        self._pending.clear()


CHUNK_BYTES = 64 << 20  # the most one gather of pages (a save or a load) stages on the device


def slot_runs(pairs: list[tuple[int, int]], per: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(slot, page) pairs, sorted by slot, as runs (slab, first row, end row) of consecutive
    rows of one slab (slot s is row s % per of slab s // per), and each sorted slot's page."""
    ordered = sorted(pairs)
    spans: list[list[int]] = []  # [first slot, end slot]
    for slot, _ in ordered:
        if spans and spans[-1][1] == slot and slot % per != 0:  # NOTE: a slab starts a new run
            spans[-1][1] += 1
        else:
            spans.append([slot, slot + 1])
    runs = [(first // per, first % per, first % per + end - first) for first, end in spans]
    return runs, [page for _, page in ordered]


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
