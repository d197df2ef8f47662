"""Quantized host tier: the coded tokens of streamed slices kept as packed rows in host memory.

With a codec (`--kv-quant`), a streamed slice's tokens older than the codec's full-precision
window are stored as packed rows (codes + fp16 scales, `codec.group` tokens a row). A load sends
those rows over PCIe and the GPU unpacks them into the staging buffer; the rest comes from the
full-precision host slice as before. So offloaded decode moves the packed bytes (int4: ~1/3.2,
int8: ~1/1.8, fp8: ~1/2 of bf16), and the values attended are exactly `codec.roundtrip`'s.

```
 tokens of a slice:  [ 0 ............................ coded )[ coded ........ length )
 host:               packed rows (PackedTier)                 bf16 HostSlice (write-backs)
 load to GPU:        rows -> scratch -> unpack -> buf[0:coded]  copy -> buf[coded:length]
```

With `StoreOptions.unpack_stream` a staging load (`load_into`) puts only the rows' copy on the
H2D stream, into one of two scratches, and unpacks on the unpack stream; a slice packed on the
device is unpacked there straight from its rows. Without it the unpack runs on the H2D stream
between two copies, and the link waits for it (~55 ms a token at 512K int4 on an H100:
bench/results/int4_512k_g1_trace.json).

The full-precision host copy keeps only the uncoded tail (`TailHostSlice`, a ring of two
extents), so host RAM holds the packed rows plus a few thousand tokens per slice: the longest
context grows with the byte ratio too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.attention.interface import ExtentKeys
from kvtier.attention.row_formats import KIVI_GROUP, ROW_KINDS, native_row_format
from kvtier.kv.device_memory import DeviceMemory
from kvtier.kv.hooks import KVCodec
from kvtier.kv.host_slice import HostSlice
from kvtier.kv.layout import KVLayout
from kvtier.kv.streams import Event, Streams
from kvtier.kv.tiers import GPU, HostArena, TierAccount, device_slab_bytes
from kvtier.planner.packed import PackedSizing


class TailHostSlice(HostSlice):
    """A host slice that keeps only its newest tokens: a ring of `ring` extents.

    Token t lives in extent (t // extent_tokens) % ring. A step may touch any span of at most
    `extent_tokens` tokens ending at the newest one (its uncoded tail plus its own tokens);
    older tokens are overwritten, which is safe because they are read from packed rows.
    """

    def __init__(self, arena: HostArena, extent_tokens: int, ring: int = 2) -> None:
        super().__init__(arena, extent_tokens)
        self.ring = ring

    def extents_for(self, tokens: int) -> int:
        return max(0, self.ring - len(self.extents))

    def reserve(self, tokens: int) -> None:
        while len(self.extents) < self.ring:
            self.extents.append(self.arena.take())

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        if end - start > self.extent_tokens * (self.ring - 1):
            raise ValueError(
                f"tokens [{start}, {end}) do not fit the {self.ring}-extent tail of "
                f"{self.extent_tokens} tokens"
            )
        return [(e % self.ring, off, at, n) for e, off, at, n in super()._pieces(start, end)]

    def _ring(self) -> int:
        return self.ring

    def read_runs_into(self, dst: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        for start, end, _ in spans:
            self._pieces(start, end)  # refuses a span longer than the tail holds
        super().read_runs_into(dst, spans)

    def gather_into(self, dst: torch.Tensor, positions: torch.Tensor) -> None:
        raise NotImplementedError("a quantized host tier keeps only its tail in full precision")


class PackedTier:
    """Packed rows of every packed slice, and the GPU scratches that loads unpack from.

    Rows of `slices` live in host memory (pinned on CUDA); rows of `device_slices` live in GPU
    memory: the GPU tier of a quantized cache, unpacked on the device and never crossing PCIe.
    Those rows and the scratches come from `memory` when given (the store's `DeviceMemory`).
    """

    def __init__(
        self,
        codec: KVCodec,
        layout: KVLayout,
        slices: list[int],
        capacity: int,
        *,
        scratch_tokens: int,
        device: torch.device,
        account: TierAccount,
        device_slices: frozenset[int] = frozenset(),
        memory: DeviceMemory | None = None,
        scratches: int = 1,
    ) -> None:
        self.codec = codec
        self.layout = layout
        self.device = device
        self.account = account
        self.device_slices = device_slices
        self.row_bytes = codec.row_bytes(layout.group_size, layout.head_dim)
        g = codec.group
        rows = -(-capacity // g)
        extent_rows = PackedSizing.of(codec, layout.group_size, layout.head_dim).extent_rows(capacity)
        extent_bytes = extent_rows * self.row_bytes
        self.arenas: list[HostArena] = []
        self.rows: dict[int, HostSlice] = {}
        for where in (None, device):
            group = [sid for sid in slices if (sid in device_slices) == (where is not None)]
            if not group:
                continue
            extents = len(group) * -(-rows // extent_rows)
            if where is None:
                slab = max(extent_bytes, min(extents * extent_bytes, 1 << 30))
            else:
                slab = device_slab_bytes(extent_bytes, extents)
            arena = HostArena(
                (extent_rows, self.row_bytes),
                torch.uint8,
                pin=device.type == "cuda",
                account=account,
                slab_bytes=slab,
                device=where,
                alloc=None if memory is None else memory.empty,
            )
            self.arenas.append(arena)
            self.rows.update({sid: HostSlice(arena, extent_rows) for sid in group})
        self.reserve(capacity)
        self.coded = 0  # leading tokens of every streamed slice stored packed
        # Loads unpack from here, in order on the H2D stream; `load_into` alternates between
        # `scratches` of them (one fills while the other is unpacked).
        shape = (scratch_tokens // g + 2, self.row_bytes)
        self.scratches = [
            memory.empty(shape, torch.uint8)
            if memory is not None
            else torch.empty(shape, dtype=torch.uint8, device=device)
            for _ in range(scratches)
        ]
        self._unpacked: list[Event | None] = [None] * scratches  # the last unpack from each
        self._next = 0
        account.alloc(GPU, sum(s.numel() for s in self.scratches))

    def key_extents(
        self, sid: int, length: int, device: torch.device, on_read: Callable[[int], None] | None
    ) -> ExtentKeys | None:
        """Slice `sid`'s coded keys where a kernel on `device` reads them in place from its KIVI
        rows (`ExtentKeys` with the codec's bits), or None: another codec, or rows not mapped."""
        fmt = native_row_format(self.codec)  # KIVI rows are recognised by their layout
        where = self.rows[sid].mapped(device)
        if fmt is None or not fmt.startswith("kivi") or where is None:
            return None
        extents, offsets, ring = where
        lay, g = self.layout, KIVI_GROUP
        return ExtentKeys(
            extents, offsets, self.rows[sid].extent_tokens * g, ring, length, device, lay.group_size,
            lay.head_dim, lay.dtype, on_read=on_read, bits=ROW_KINDS[fmt], group=g,
        )  # fmt: skip

    def reserve(self, tokens: int) -> None:
        rows = -(-tokens // self.codec.group)
        for r in self.rows.values():
            r.reserve(rows)

    def read_into(
        self, sid: int, host: HostSlice, dst: torch.Tensor, start: int, end: int, *, scratch: bool = True
    ) -> int:
        """Tokens [start, end) of slice `sid` into dst[: end - start] on the current stream: coded
        ones unpacked from rows, the rest copied from `host`. Returns the bytes sent over PCIe
        (0 for a slice kept on the device).

        `scratch`: unpack from the shared scratch; only for loads issued in order on one stream
        (the staging ring's). Other callers get a fresh buffer."""
        g = self.codec.group
        c = min(max(self.coded, start), end)
        moved = 0
        if c > start:
            r0, r1 = start // g, -(-c // g)
            if scratch and r1 - r0 <= self.scratches[0].shape[0]:
                rows = self.scratches[0][: r1 - r0]
            else:
                rows = torch.empty(r1 - r0, self.row_bytes, dtype=torch.uint8, device=self.device)
            self.rows[sid].read_into(rows, r0, r1)
            out = dst[: c - start]
            whole = start % g == 0 and (c - start) % g == 0  # out is exactly the rows' tokens
            if not (whole and self.codec.unpack_into(rows, out)):
                lay = self.layout
                kv = self.codec.unpack(rows, lay.group_size, lay.head_dim, lay.dtype)  # [(r1 - r0) g, ...]
                out.copy_(kv[start - r0 * g : c - r0 * g])
            moved += (r1 - r0) * self.row_bytes
        if end > c:
            host.read_into(dst[c - start : end - start], c, end)
            moved += (end - c) * self.layout.token_bytes
        return 0 if sid in self.device_slices else moved

    def load_into(
        self,
        sid: int,
        host: HostSlice,
        dst: torch.Tensor,
        start: int,
        end: int,
        streams: Streams,
        free: list[Event | None],
    ) -> tuple[int, Event | None]:
        """`read_into` for a staging load issued on the H2D stream, writing dst only after the
        `free` events: the H2D stream copies the rows of a streamed slice into the next scratch
        (after the last unpack from it), and the unpack stream unpacks them and copies the
        uncoded tail; a slice packed on the device is unpacked on the unpack stream straight
        from its rows. Returns the bytes sent over PCIe and the event of the unpack stream's
        work (None: all on the current stream)."""
        g = self.codec.group
        c = min(max(self.coded, start), end)
        r0, r1 = start // g, -(-c // g)
        on_device = sid in self.device_slices
        if c <= start or start % g or (not on_device and r1 - r0 > self.scratches[0].shape[0]):
            streams.wait([*free, *self._unpacked])  # read_into may fill scratch 0
            return self.read_into(sid, host, dst, start, end), None
        moved = 0
        if not on_device:
            k = self._next
            self._next = (k + 1) % len(self.scratches)
            rows = self.scratches[k][: r1 - r0]
            streams.wait([self._unpacked[k], host.last_write])  # the rows' last encode, too
            self.rows[sid].read_into(rows, r0, r1)
            moved = (r1 - r0) * self.row_bytes
            free = [*free, streams.record()]
        with streams.on_unpack():
            streams.wait(free)
            if on_device:  # unpacked where they lie: one unpack per run of adjacent extents
                at = 0
                for piece, _, _ in self.rows[sid].runs(r0, r1):
                    n = min(piece.shape[0] * g, c - start - at)
                    self._unpack(piece, dst[at : at + n])
                    at += n
            else:
                self._unpack(rows, dst[: c - start])
            if end > c:
                host.read_into(dst[c - start : end - start], c, end)
                moved += (end - c) * self.layout.token_bytes
            done = streams.record()
        if not on_device:
            self._unpacked[k] = done
        return (0 if on_device else moved), done

    def _unpack(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Unpack rows [m, row_bytes] into out, the first out.shape[0] tokens of the rows, on
        the current stream."""
        if not (out.shape[0] == rows.shape[0] * self.codec.group and self.codec.unpack_into(rows, out)):
            lay = self.layout
            kv = self.codec.unpack(rows, lay.group_size, lay.head_dim, lay.dtype)  # [m g, 2, G, D]
            out.copy_(kv[: out.shape[0]])

    def read_runs_into(
        self, sid: int, host: HostSlice, dst: torch.Tensor, spans: list[tuple[int, int, int]]
    ) -> int:
        """`read_into` of every (start, end, at) span into dst[at : at + end - start]: the coded
        rows of all spans in one copy and one unpack, placed by one index copy; the uncoded
        tails in one `read_runs_into` of `host`. Returns the bytes sent over PCIe."""
        g, lay = self.codec.group, self.layout
        row_spans: list[tuple[int, int, int]] = []  # packed rows [r0, r1) of a span, at row `at`
        places: list[tuple[int, int, int]] = []  # (dst row, unpacked row, tokens) of each span
        tails: list[tuple[int, int, int]] = []
        rows = 0
        for start, end, at in spans:
            c = min(max(self.coded, start), end)
            if c > start:
                r0, r1 = start // g, -(-c // g)
                row_spans.append((r0, r1, rows))
                places.append((at, rows * g + start - r0 * g, c - start))
                rows += r1 - r0
            if end > c:
                tails.append((c, end, at + c - start))
        moved = 0
        if row_spans:
            packed = torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=self.device)
            self.rows[sid].read_runs_into(packed, row_spans)
            kv = self.codec.unpack(packed, lay.group_size, lay.head_dim, lay.dtype)  # [rows g, 2, G, D]
            to, src = _run_rows(places, self.device)
            dst.index_copy_(0, to, kv[src])
            moved += rows * self.row_bytes
        if tails:
            host.read_runs_into(dst, tails)
            moved += sum(end - start for start, end, _ in tails) * lay.token_bytes
        return 0 if sid in self.device_slices else moved

    def encode(self, hosts: dict[int, HostSlice], upto: int, streams: Streams) -> tuple[int, int]:
        """Pack tokens [coded, upto) of every slice from its full-precision host copy (through
        the GPU, where packing runs). Returns the bytes moved (to the GPU, back to the host)."""
        a = self.coded
        if upto <= a:
            return 0, 0
        lay, g = self.layout, self.codec.group
        assert a % g == 0 and upto % g == 0
        tmp = torch.empty(upto - a, 2, lay.group_size, lay.head_dim, dtype=lay.dtype, device=self.device)
        for sid, host in hosts.items():
            streams.wait([host.last_write])  # the step's write-backs land first
            host.read_into(tmp, a, upto)
            self.rows[sid].write(a // g, self.codec.pack(tmp))
            host.last_write = streams.record()  # loads of these rows wait for it
        self.coded = upto
        n = sum(sid not in self.device_slices for sid in hosts)  # the others never cross PCIe
        return n * (upto - a) * lay.token_bytes, n * (upto - a) // g * self.row_bytes

    def stored_bytes(self, sid: int, length: int) -> int:
        """Bytes slice `sid` holds for `length` tokens: packed rows, then the uncoded tokens."""
        coded = min(self.coded, length)
        return coded // self.codec.group * self.row_bytes + (length - coded) * self.layout.token_bytes

    def close(self) -> None:
        self.account.free(GPU, sum(s.numel() for s in self.scratches))
        self.rows.clear()
        for arena in self.arenas:
            arena.close()


def _run_rows(places: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of (dst row, src row, tokens) runs, one entry a token: (to, src) [n] int64 on
    `device`, built there from the runs alone (~126K tokens in ~450 runs took ~1.4 ms on the
    host, and two pageable copies; a 1M refresh that turns a 4-head slice's one selection over
    places up to ~32K tokens). No host sync."""
    p = torch.tensor(places, dtype=torch.int64)  # [P, 3]
    total = int(p[:, 2].sum())
    if device.type == "cuda":
        p = p.pin_memory().to(device, non_blocking=True)
    n = p[:, 2]
    run = torch.repeat_interleave(torch.arange(p.shape[0], device=device), n, output_size=total)
    offset = torch.arange(total, device=device) - (torch.cumsum(n, 0) - n)[run]
    return p[run, 0] + offset, p[run, 1] + offset
