"""A GPU cache of one streamed slice's KV in token blocks, with LRU eviction (HiP offload).

Between stage-0 refreshes a HiP decode step reads only a few known tokens of a slice: the
sinks, the cached candidates of the earliest due stage and the window. `BlockCache` keeps those
tokens on the GPU in blocks of `block` tokens, so such a step streams nothing:

    bank   [slots, block, 2, G, D]   token rows of cached blocks
    ids    [slots]                   block id (first token // block) held by each slot, -1 = free
    used   [slots]                   tick of the slot's last use, -1 = never

`ensure(blocks, load)` makes a step's blocks readable: hits are touched, misses are `load`ed and
stored in the least-recently-used slots not used this tick (those that do not fit stay in a
step-local overflow). It returns a `BlockTable`, through which `PositionedKV` reads token rows
by *position*, the way the pruning and attention code index a whole slice. Everything is
proportional to the number of slots, never to the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.attention.interface import Alloc


@dataclass
class CacheStats:
    """Counters (mutable, run-time) of every slice's block cache.

    Cached steps (nothing streamed) look blocks up: `hits` + `misses` == `lookups`, and each miss
    reads its stored tokens from the host (`fetched_bytes`). Refresh steps (the slice streamed in
    whole) only fill the cache: blocks already there are `refresh_reused`, others
    `refresh_inserted`. A block a new token starts is `appended`, neither hit nor miss. A cache
    whose capacity covers a whole refresh interval cannot miss: its steps skip the lookup (a
    host sync) and count as `cached_steps` only.
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    fetched_bytes: int = 0
    refresh_reused: int = 0
    refresh_inserted: int = 0
    appended: int = 0
    cached_steps: int = 0  # slice steps served by a cache that cannot miss (no lookups counted)

    @property
    def hit_rate(self) -> float:
        """Hits per lookup on cached steps (1.0 before any lookup, or when none can miss)."""
        return self.hits / self.lookups if self.lookups else 1.0


@dataclass
class BlockTable:
    """Where a step's blocks are: sorted block ids [m], each in the bank or the overflow.

    `base[j]` is the first row of block `blocks[j]` in the flattened bank (`in_bank[j]`) or in
    the flattened overflow `extra` [E * block, 2, G, D].
    """

    blocks: torch.Tensor  # [m] sorted block ids
    base: torch.Tensor  # [m] first row of each block in its source
    in_bank: torch.Tensor  # [m] bool
    extra: torch.Tensor | None  # [E * block, 2, G, D] blocks that did not fit the cache
    hits: int
    stored: int  # misses stored in the bank
    # Whether blocks[-1] is in the bank (`ensure` reads it with its counts; None: a table of
    # every slot, `BlockCache.table`, which nothing writes through).
    last_in_bank: bool | None = None


class BlockCache:
    """LRU cache of `slots` blocks of `block` token rows [2, G, D] of one slice, on `device`
    (the bank from `alloc` when given)."""

    def __init__(
        self,
        slots: int,
        block: int,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        alloc: Alloc | None = None,
    ) -> None:
        self.block = block
        shape = (slots, block, *row_shape)
        # The bank from `alloc` (a server's lent pages) when given, else the caching allocator.
        self.bank = torch.empty(shape, dtype=dtype, device=device) if alloc is None else alloc(shape, dtype)
        self.ids = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.used = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.tick = 0
        self.end = 0  # tokens of the slice the cache is up to date with (0 = nothing cached)
        # [1] slot of the block of position end - 1, one tensor for the cache's life (a CUDA
        # graph that appends reads it: `append_at`); `_has_tail` False: not in the bank.
        self._tail = torch.zeros(1, dtype=torch.long, device=device)
        self._has_tail = False
        self._tail_rows: torch.Tensor | None = None  # [block] its rows in the flat bank
        self._table: BlockTable | None = None  # every slot's block, sorted (see `table`)
        self._slot_table: BlockTable | None = None  # its tensors, made once

    @property
    def tail(self) -> torch.Tensor | None:
        """[1] the slot of the block of position end - 1 (None: not in the bank). The same
        tensor whenever there is one: setting a slot copies it in."""
        return self._tail if self._has_tail else None

    @tail.setter
    def tail(self, slot: torch.Tensor | None) -> None:
        if slot is not None:
            self._tail.copy_(slot.reshape(1))
        self._has_tail, self._tail_rows = slot is not None, None

    @property
    def slots(self) -> int:
        return self.bank.shape[0]

    def nbytes(self) -> int:
        """GPU bytes held by the bank and its bookkeeping."""
        return sum(t.numel() * t.element_size() for t in (self.bank, self.ids, self.used))

    def clear(self) -> None:
        """Forget every block (the slice's stored tokens changed). Mutates the cache."""
        self.ids.fill_(-1)
        self.used.fill_(-1)
        self.end = 0
        self.tail = None
        self._table = None

    def invalidate(self) -> None:
        """Mark what the cache holds stale without touching its tensors (a store's prefill step
        may run outside the inference mode they were made in): the next step that uses it finds
        `end` matching no position and clears it first."""
        self.end = -1
        self.tail = None
        self._table = None

    def lookup(self, blocks: torch.Tensor) -> torch.Tensor:
        """Slot of each block id in blocks [m] (-1 when absent). Pure."""
        order = torch.argsort(self.ids)
        ids = self.ids[order]
        i = torch.searchsorted(ids, blocks).clamp(max=self.slots - 1)
        return torch.where(ids[i] == blocks, order[i], torch.full_like(blocks, -1))

    def ensure(self, blocks: torch.Tensor, load: Callable[[torch.Tensor], torch.Tensor]) -> BlockTable:
        """Make blocks [m] (sorted, unique) readable this tick; mutates the cache.

        `load(missing [k]) -> [k, block, 2, G, D]` supplies the absent blocks. They go to the
        least-recently-used slots not used this tick; any that do not fit stay in the overflow.
        One host-device sync (the miss and free-slot counts, read together) besides `load`'s.
        """
        self.tick += 1
        self._table = None
        slot = self.lookup(blocks)
        hit = slot >= 0
        # Hits are used this tick; a miss adds -1 to slot 0's max, which changes nothing.
        self.used.scatter_reduce_(0, slot.clamp(min=0), torch.where(hit, self.tick, -1), "amax")
        last_hit = hit[-1:] if blocks.numel() else torch.ones(1, dtype=torch.bool, device=hit.device)
        k, free, was_hit = torch.cat(
            ((~hit).sum()[None], (self.used < self.tick).sum()[None], last_hit)
        ).tolist()
        base = slot * self.block
        in_bank = hit.clone()
        extra = None
        stored = 0
        if k:
            where = torch.nonzero_static(~hit, size=k).flatten()  # [k] indices of the misses in `blocks`
            missing = blocks[where]
            data = load(missing)  # [k, block, 2, G, D]
            stored = min(k, free)
            victims = torch.argsort(self.used, stable=True)[:stored]  # least recently used first
            self.bank[victims] = data[:stored]
            self.ids[victims] = missing[:stored]
            self.used[victims] = self.tick
            base[where[:stored]] = victims * self.block
            in_bank[where[:stored]] = True
            if stored < k:
                extra = data[stored:].flatten(0, 1)
                base[where[stored:]] = torch.arange(k - stored, device=blocks.device) * self.block
        # The last block, if missed, is the last miss: in the bank when every miss fit.
        last = bool(was_hit) or stored == k
        return BlockTable(
            blocks, base, in_bank, extra, hits=blocks.numel() - k, stored=stored, last_in_bank=last
        )

    def write(self, table: BlockTable, position: int, row: torch.Tensor) -> None:
        """Store token row [2, G, D] at `position`, whose block is the last of `table` (an
        `ensure`'s: a step writes its newest token, the largest position it reads). Mutates the
        cache, without a sync (`ensure` read where that block went).

        The block's slot becomes the `tail` that `append` writes next, or None when the block is
        in the step's overflow (not in the bank)."""
        assert table.last_in_bank is not None, "write after ensure: it knows where the last block is"
        r = position % self.block
        if table.last_in_bank:
            at = table.base[-1:] + r  # [1]
            self.bank.view(-1, *self.bank.shape[2:]).index_copy_(0, at, row[None])
            self.tail = table.base[-1:] // self.block
        else:  # the last miss, after the `stored` ones, in the overflow
            assert table.extra is not None
            misses = table.blocks.numel() - table.hits
            table.extra[(misses - 1 - table.stored) * self.block + r] = row
            self.tail = None

    # -- sync-free decode steps -----------------------------------------------------------------

    def table(self) -> BlockTable:
        """Every slot as a `BlockTable` (free slots sort first as id -1), built without a sync.

        NOTE: valid only for positions whose blocks are cached; a `PositionedKV` over it reads
        any cached position. Rebuilt only after the cache's blocks change.
        """
        if self._table is None:
            order = torch.argsort(self.ids)  # [slots]
            t = self._slot_table
            if t is None:  # NOTE: one set of tensors, rewritten: a CUDA graph reads them (`decode_graph`)
                ones = torch.ones(self.slots, dtype=torch.bool, device=self.ids.device)
                t = self._slot_table = BlockTable(self.ids[order], order * self.block, ones, None, 0, 0)
            else:
                t.blocks.copy_(self.ids[order])
                torch.mul(order, self.block, out=t.base)
            self._table = t
        return self._table

    def refill(self, blocks: torch.Tensor, load: Callable[[torch.Tensor], torch.Tensor], tail: int) -> None:
        """Hold exactly blocks [m] (m <= slots; duplicates allowed, each a copy) after a refresh.

        Static shapes, no host sync: slots 0..m-1 get `load(blocks)` [m, block, 2, G, D] at a
        new tick, the rest are freed. `tail` (host-known) is the index in `blocks` of the block
        that `append` writes next. Mutates the cache (every slot's previous block is dropped).
        """
        m = blocks.shape[0]
        assert m <= self.slots, "refill needs one slot per block"
        self.tick += 1
        self._table = None
        self.bank[:m] = load(blocks)
        # NOTE: `append` writes only the tail slot, so other copies of the tail's block would go
        # stale: free them (static shapes, no sync).
        idx = torch.arange(m, device=blocks.device)
        stale = (blocks == blocks[tail]) & (idx != tail)
        self.ids[:m] = torch.where(stale, -1, blocks)
        self.ids[m:] = -1
        self.used[:m] = torch.where(stale, -1, self.tick)
        self.used[m:] = -1
        self._tail.fill_(tail)
        self._has_tail, self._tail_rows = True, None

    def append(self, position: int, row: torch.Tensor) -> None:
        """Store the token row [2, G, D] at `position` == `end` without a host sync; mutates.

        A position that starts a block takes the least-recently-used slot (ties: the lowest);
        otherwise the row goes to the tail block. NOTE: the LRU slot may hold a block a later step
        reads: a cache that covers a whole refresh interval has none, a smaller one looks its
        blocks up before such a step and fetches misses.
        """
        assert position == self.end, "append writes the next token only"
        b = self.block
        if position % b == 0:
            self.start_block(position)
        assert self.tail is not None, "the block of the last position must be in the bank to append"
        if self._tail_rows is None:  # NOTE: once a block: a step then launches one copy
            self._tail_rows = self.tail * b + torch.arange(b, device=self.tail.device)
        flat = self.bank.view(-1, *self.bank.shape[2:])
        at = position % b
        flat.index_copy_(0, self._tail_rows[at : at + 1], row[None])
        self.end = position + 1

    def start_block(self, position: int) -> None:
        """`append`'s bookkeeping at a position that starts a block, without a host sync: the
        least-recently-used slot (ties: the lowest) takes the block and becomes the tail; the
        slot table is stale until `table` remakes it (in place)."""
        assert position == self.end and position % self.block == 0, "a block starts at the next token"
        self.tick += 1
        slot = torch.argmin(self.used, dim=0, keepdim=True)  # [1]
        self.ids.index_fill_(0, slot, position // self.block)
        self.used.index_fill_(0, slot, self.tick)
        self.tail = slot
        self._table = None

    def append_at(self, position: torch.Tensor, row: torch.Tensor) -> None:
        """`append`'s write, the position [1] int64 read on the device (what a CUDA graph
        replays step after step: `decode_graph`). The caller checks that `position` == `end`
        and that there is a tail (at a block's first position: `start_block` first), and then
        moves `end` (`advance`)."""
        flat = self.bank.view(-1, *self.bank.shape[2:])
        flat.index_copy_(0, self._tail * self.block + position % self.block, row[None])

    def advance(self, position: int) -> None:
        """The host's half of `append_at` at `position` (== `end`, its block the tail)."""
        assert position == self.end and self._has_tail, "append_at's position"
        self.end = position + 1


class PositionedKV:
    """Rows of a slice at sorted, known positions, indexed by position like the whole slice.

    `view[pos]` and `view[pos, j]` give what `kv[pos]` and `kv[pos, j]` would for a slice
    kv [length, ...]; `shape` is that slice's shape. Reading a position the table lacks is
    undefined. NOTE: values are copied bit for bit, so code run on a view computes exactly what
    it would on the whole slice.
    """

    def __init__(
        self, bank: torch.Tensor, table: BlockTable, block: int, length: int, extra: torch.Tensor | None
    ) -> None:
        self.bank = bank  # [slots * block, ...]
        self.extra = extra  # [E * block, ...] or None
        self.table = table
        self.block = block
        self.length = length

    @classmethod
    def of(cls, cache: BlockCache, table: BlockTable, length: int) -> PositionedKV:
        """The view of `length` positions of a slice through `cache` and a step's `table`."""
        bank = cache.bank.view(-1, *cache.bank.shape[2:])
        return cls(bank, table, cache.block, length, table.extra)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.length, *self.bank.shape[1:]))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PositionedKV:
        """The same positions with `fn` applied to every row tensor (e.g. one head, keys only)."""
        extra = fn(self.extra) if self.extra is not None else None
        return PositionedKV(fn(self.bank), self.table, self.block, self.length, extra)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Rows at positions [n] -> [n, ...]."""
        t = self.table
        j = torch.searchsorted(t.blocks, torch.div(positions, self.block, rounding_mode="floor"))
        r = t.base[j] + positions % self.block
        if self.extra is None:
            return self.bank[r]
        inb = t.in_bank[j]
        a = self.bank[torch.where(inb, r, 0)]
        b = self.extra[torch.where(inb, 0, r)]
        return torch.where(inb.view(-1, *[1] * (a.dim() - 1)), a, b)

    def key_addresses(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys for a kernel that reads them by address: the bank's keys [slots * block, G, D]
        (a view, last dim contiguous) and the key of each of positions [n] as an element offset
        from its first element (rows of the overflow too, another allocation). Rows [.., 2, G, D]."""
        t = self.table
        j = torch.searchsorted(t.blocks, torch.div(positions, self.block, rounding_mode="floor"))
        r = t.base[j] + positions % self.block
        keys = self.bank[:, 0]
        at = r * keys.stride(0)
        if self.extra is not None:
            more = self.extra[:, 0]
            delta = (more.data_ptr() - keys.data_ptr()) // keys.element_size()
            at = torch.where(t.in_bank[j], at, delta + r * more.stride(0))
        return keys, at

    def __getitem__(self, index: torch.Tensor | tuple[torch.Tensor, int]) -> torch.Tensor:
        if isinstance(index, tuple):
            positions, j = index
            return self.rows(positions)[:, j]
        return self.rows(index)


def layer_key_addresses(
    views: list[PositionedKV], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`PositionedKV.key_addresses` of several slices' caches at once, for one pruning launch
    over them: the first view's keys, and each view e's keys of positions[e] [E, n] as element
    offsets from that tensor's first element (another slice's bank is another allocation, read
    by address as an overflow is). The banks must share strides and dtype."""
    keys, at = views[0].key_addresses(positions[0])
    rows = [at]
    for view, pos in zip(views[1:], positions[1:], strict=True):
        other, a = view.key_addresses(pos)
        assert other.stride() == keys.stride() and other.dtype == keys.dtype, "banks of one layout"
        rows.append(a + (other.data_ptr() - keys.data_ptr()) // keys.element_size())
    return keys, torch.stack(rows)


def block_ids(positions: torch.Tensor, block: int) -> torch.Tensor:
    """Sorted unique blocks [m] holding positions [n]."""
    return torch.unique(torch.div(positions, block, rounding_mode="floor"))
