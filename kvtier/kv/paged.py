"""Paged KV for many sequences on one device, and the `Attention` of one batch step.

All pages live in ONE tensor, page-major: `storage [num_pages + 1, L, P, 2, H_kv, D]`, so a
page holds its P tokens of every layer in one contiguous block, and a run of consecutive page
ids is one contiguous region of device memory (`page_run`: what a tiered request's buffers are
carved from, `kvtier.kv.page_memory`). Layer l's pages are the strided view `pages[l] =
storage[:, l]` [num_pages + 1, P, 2, H_kv, D]. A sequence's tokens live in the pages of its
block table; token position p is at (block_table[p // P], p % P), i.e. at flat slot
block_table[p // P] * L * P + p % P of layer l's flat view (the storage's [(N + 1) * L * P,
2, H_kv, D] view from row l * P on), here with L = 2 layers:

    block table   [ 7,        2,        9      ]        P = 4, L = 2, start = 9, n_new = 2
    positions      0 1 2 3 | 4 5 6 7 | 8 9 10
    flat slots    56 .. 59 |16 .. 19 | 72 73 74
                                          ^^ ^^  the step writes slots 73, 74 (positions 9, 10)
                                                 and attends over all 11 slots

A batch step concatenates every scheduled sequence's new tokens into one flat stream (prefill
chunks and decode tokens mixed); `begin_step` takes each sequence's (block table, start, n_new)
in that order and precomputes positions, RoPE tables and slot indices once for all layers.
Prefill chunks attend one sequence at a time (`attend`, on the flash kernel, never cuDNN: the
scheduler cuts chunks of ever new lengths, and cuDNN builds a graph and loads a kernel module
per new shape; on the H200 the load waited 150-320 ms a time for the device to drain a tiered
request's queued copies, and 32 short streams beside a 256K-token request ran 2.1-2.7x slower,
1.9-2.3x with flash: bench/results/serve_gpu_24gib_flash.json); the decode tokens of two or more
sequences attend in ONE batched call. On CUDA that call is `paged_decode`, which reads the
pages in place through the block tables; on the CPU their KV is gathered into [B, S_max] (padded
keys masked out) for one SDPA call.

A decode-only batch can instead run from static buffers (`begin_decode` + `decode_prologue`):
positions, write slots, block tables and lengths live in tensors of fixed addresses, padded to
a batch-size bucket with rows that write and read a scratch page, so the step's forward can be
captured once per bucket as a CUDA graph and replayed (`kvtier.engine.batch.graphs`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.attention.dense import attend
from kvtier.config import ModelConfig
from kvtier.model.rope import Rotary


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a batch step: its pages, tokens already stored, tokens added now."""

    block_table: tuple[int, ...]
    start: int
    n_new: int


DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q [B, H_q, D], pages [N, P, 2, H_kv, D], block tables [B, max_blocks], lengths [B]) -> [B, H_q, D]."""


def default_decode_kernel(device: torch.device) -> DecodeKernel | None:
    """The Triton paged-decode kernel on CUDA (None elsewhere: the gather + SDPA path)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from kvtier.attention.paged_decode import paged_decode

    return paged_decode


class PagedKVStore:
    """Page tensors of every layer; callable as `kvtier.attention.Attention` for a batch step.

    `max_batch` and `max_blocks` size the static decode buffers (`begin_decode`); `decode_kernel`
    attends batched decode tokens over pages in place (None: Triton's on CUDA; on the CPU the
    gather path, and `reference_decode` for the static buffers).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_batch: int = 64,
        max_blocks: int | None = None,
        decode_kernel: DecodeKernel | None = None,
        prefill_cudnn: bool = False,
    ) -> None:
        self.page_size = page_size
        # Prefill chunks on cuDNN where `attend` would pick it (Hopper): only for a pool no
        # tiered request shares (`LLM.generate`'s), whose queued copies stall cuDNN's loads.
        self.prefill_cudnn = prefill_cudnn
        self.num_pages = num_pages
        self.device = device
        self.dtype = dtype
        # One page past the pool: the scratch page that padded decode rows write and read.
        self.scratch = num_pages
        self.num_layers = cfg.num_layers
        shape = (num_pages + 1, cfg.num_layers, page_size, 2, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: zeros, not empty: on the CPU untouched pages then cost no resident memory.
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.pages = [self.storage[:, layer] for layer in range(cfg.num_layers)]  # [N + 1, P, 2, H_kv, D]
        self._flat = self.storage.view(-1, *shape[3:])  # [(N + 1) * L * P, 2, H_kv, D]
        self.slot_stride = cfg.num_layers * page_size  # flat slots from one page to the next
        self.decode_kernel = decode_kernel or default_decode_kernel(device)
        blocks = num_pages if max_blocks is None else min(num_pages, max_blocks)
        self.max_batch = max_batch
        # A decode step's token ids and positions in one buffer, one host->GPU copy (each copy
        # from pageable memory is a launch and a wait on the host); slots and lengths follow
        # from them on the device (`decode_prologue`).
        self.dec_in = torch.zeros(2, max_batch, dtype=torch.long, device=device)  # [2, B_max]
        self.dec_ids, self.dec_positions = self.dec_in[0], self.dec_in[1]  # [B_max] each
        self.dec_write = torch.full(
            (max_batch,), self.scratch * self.slot_stride, dtype=torch.long, device=device
        )
        self.dec_tables = torch.full((max_batch, blocks), self.scratch, dtype=torch.int32, device=device)
        self.dec_lens = torch.ones(max_batch, dtype=torch.int32, device=device)  # [B_max]
        self._decode_rows = 0  # > 0: the step runs from the static buffers, this many rows
        self.rotary = Rotary(cfg.rope, cfg.head_dim, device)
        self._cos = self._sin = torch.empty(0)
        self._write = torch.empty(0, dtype=torch.long)  # [T] flat slots of the step's tokens
        self._reads: list[tuple[int, int, torch.Tensor]] = []  # prefills: (offset, n_new, slots)
        self._dec_rows = torch.empty(0, dtype=torch.long)  # [B] stream index of each decode token
        self._dec_slots = torch.empty(0, dtype=torch.long)  # [B, S_max] flat slots, padded with 0
        self._dec_mask = torch.empty(0, dtype=torch.bool)  # [B, 1, 1, S_max] True = a real key
        self._dec_tables = self._dec_lens = torch.empty(0, dtype=torch.int32)  # kernel path, eager

    @property
    def bytes_per_page(self) -> int:
        return self.storage[0].numel() * self.storage.element_size()

    def page_run(self, first: int, count: int) -> torch.Tensor:
        """Pages first .. first + count - 1 of every layer as one flat byte tensor (a view): the
        device memory a run of consecutive page ids holds."""
        assert first >= 0 and first + count <= self.num_pages, "a run past the pool"
        return self.storage[first : first + count].view(-1).view(torch.uint8)

    def move_pages(self, moves: list[tuple[int, int]]) -> None:
        """Copy each (from, to) page's tokens of every layer (a pool `compaction`): one copy per
        run of consecutive ids on both sides, and no temporary beyond the copies themselves.
        Sources and targets must not overlap."""
        i = 0
        while i < len(moves):
            src, dst = moves[i]
            k = 1
            while i + k < len(moves) and moves[i + k] == (src + k, dst + k):
                k += 1
            self.storage[dst : dst + k].copy_(self.storage[src : src + k])
            i += k

    def layer_flat(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s flat view [.., 2, H_kv, D]: slot `page * slot_stride + offset`."""
        return self._flat[layer * self.page_size :]

    def begin_decode(self, steps: list[SeqStep], rows: int, ids: list[int] | None = None) -> None:
        """Fill the static decode buffers for `steps` (one new token each, `ids` [len(steps)]
        its token ids, default 0), padded to `rows`: two host->GPU copies, the ids with the
        positions and the block tables.

        Padded rows write their k/v into the scratch page and attend to its first slot, so a
        forward of `rows` tokens has the same shapes (and tensors) whatever the batch; call
        `decode_prologue(rows)` at the start of that forward (it derives the write slots and
        lengths on the device).
        """
        assert all(s.n_new == 1 for s in steps) and len(steps) <= rows <= self.max_batch
        p, n = self.page_size, len(steps)
        used = [-(-(s.start + 1) // p) for s in steps]  # pages each row reads
        width = max(used)
        assert width <= self.dec_tables.shape[1], "a sequence has more pages than the decode table"
        # NOTE: built as Python lists and made tensors once: two tensor ops a row took ~0.98 ms
        # a step at 64 rows on the development CPU, this ~0.23 ms (host time the GPU waits for)
        pad = [self.scratch] * width
        table_rows = [list(s.block_table[:k]) + pad[k:] for s, k in zip(steps, used, strict=True)]
        tables = torch.tensor(table_rows + [pad] * (rows - n), dtype=torch.int32)  # [rows, width]
        rest = [0] * (self.max_batch - n)
        token_ids = list(ids) if ids is not None else [0] * n
        positions = [s.start for s in steps]
        inputs = torch.tensor([token_ids + rest, positions + rest], dtype=torch.long)  # [2, B_max]
        self.dec_in.copy_(inputs, non_blocking=True)
        self.dec_tables[:rows, :width].copy_(tables, non_blocking=True)
        self._decode_rows = rows

    def decode_prologue(self, rows: int) -> None:
        """From the static positions and tables: each row's write slot and key count, and the
        step's RoPE tables. Part of the captured forward."""
        self._decode_rows = rows
        pos, p = self.dec_positions[:rows], self.page_size  # [rows]
        page = self.dec_tables[:rows].gather(1, (pos // p).unsqueeze(1)).squeeze(1)  # [rows] int32
        torch.add(page.long() * self.slot_stride, pos % p, out=self.dec_write[:rows])
        self.dec_lens[:rows].copy_(pos + 1)
        self._cos, self._sin = self.rotary.cos_sin(pos, self.dtype)

    def begin_step(self, steps: list[SeqStep]) -> None:
        """Set the batch of the next forward: one `SeqStep` per sequence, in token-stream order."""
        self._decode_rows = 0
        p = self.page_size
        positions, writes, reads = [], [], []
        decodes: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for s in steps:
            end = s.start + s.n_new
            assert len(s.block_table) * p >= end, "block table too short for the step"
            pos = torch.arange(end)
            table = torch.tensor(s.block_table, dtype=torch.long)
            slots = table[pos // p] * self.slot_stride + pos % p  # [end]
            positions.append(pos[s.start :])
            writes.append(slots[s.start :])
            if s.n_new == 1:
                decodes.append((offset, slots))
            else:
                reads.append((offset, s.n_new, slots.to(self.device, non_blocking=True)))
            offset += s.n_new
        if len(decodes) == 1:  # a lone decode token takes the exact single-sequence path
            reads.append((decodes[0][0], 1, decodes[0][1].to(self.device, non_blocking=True)))
            decodes = []
        if decodes and self.decode_kernel is not None:
            dec = [s for s in steps if s.n_new == 1]
            width = max(-(-(s.start + 1) // p) for s in dec)
            tables = torch.full((len(dec), width), self.scratch, dtype=torch.int32)
            for b, s in enumerate(dec):
                used = s.block_table[: -(-(s.start + 1) // p)]
                tables[b, : len(used)] = torch.tensor(used, dtype=torch.int32)
            self._dec_tables = tables.to(self.device, non_blocking=True)
            self._dec_lens = torch.tensor([s.start + 1 for s in dec], dtype=torch.int32).to(
                self.device, non_blocking=True
            )
            self._dec_rows = torch.tensor([o for o, _ in decodes]).to(self.device, non_blocking=True)
        elif decodes:
            s_max = max(len(sl) for _, sl in decodes)
            padded = torch.zeros(len(decodes), s_max, dtype=torch.long)
            mask = torch.zeros(len(decodes), 1, 1, s_max, dtype=torch.bool)
            for b, (_, sl) in enumerate(decodes):
                padded[b, : len(sl)] = sl
                mask[b, ..., : len(sl)] = True
            self._dec_rows = torch.tensor([o for o, _ in decodes]).to(self.device, non_blocking=True)
            self._dec_slots, self._dec_mask = (
                padded.to(self.device, non_blocking=True),
                mask.to(self.device, non_blocking=True),
            )
        else:
            self._dec_rows = torch.empty(0, dtype=torch.long, device=self.device)
        pos_all = torch.cat(positions)
        self._cos, self._sin = self.rotary.cos_sin(pos_all.to(self.device, non_blocking=True), self.dtype)
        self._write = torch.cat(writes).to(self.device, non_blocking=True)
        self._reads = reads

    def end_step(self) -> None:
        self._reads = []
        self._decode_rows = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rotate, write the step's k/v into each sequence's pages, attend per sequence.

        q [T, H_q, D], k/v [T, H_kv, D] with T = sum of n_new. Mutates the pages of `layer`.
        """
        q = Rotary.apply(q, self._cos, self._sin)
        k = Rotary.apply(k, self._cos, self._sin)
        flat = self.layer_flat(layer)  # slot page * L * P + offset -> [2, H_kv, D]
        rows = self._decode_rows
        if rows:  # static decode buffers: no host work, nothing depends on values
            flat[self.dec_write[:rows]] = torch.stack((k, v), dim=1)
            kernel = self.decode_kernel or reference_decode
            return kernel(q, self.pages[layer], self.dec_tables[:rows], self.dec_lens[:rows])
        flat[self._write] = torch.stack((k, v), dim=1)
        if len(self._reads) == 1 and self._reads[0][1] == q.shape[0]:
            # one sequence: no copy of the output
            return attend(q, flat[self._reads[0][2]], cudnn=self.prefill_cudnn)
        out = torch.empty_like(q)
        for a, n, slots in self._reads:  # kv [start + n, 2, H_kv, D]
            out[a : a + n] = attend(q[a : a + n], flat[slots], cudnn=self.prefill_cudnn)
        if self._dec_rows.numel():
            dq = q[self._dec_rows]
            if self.decode_kernel is not None:
                out[self._dec_rows] = self.decode_kernel(
                    dq, self.pages[layer], self._dec_tables, self._dec_lens
                )
            else:
                out[self._dec_rows] = self._decode_batch(dq, flat)
        return out

    def _decode_batch(self, q: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """One query per sequence, q [B, H_q, D], over each one's gathered KV -> [B, H_q, D]."""
        b, hq, d = q.shape
        kv = flat[self._dec_slots]  # [B, S_max, 2, H_kv, D]
        hkv = kv.shape[3]
        k = kv[:, :, 0].transpose(1, 2)  # [B, H_kv, S_max, D]
        v = kv[:, :, 1].transpose(1, 2)
        # The r query heads of each KV head fold into the query axis: no K/V expansion needed.
        qf = q.view(b, hkv, hq // hkv, d)  # [B, H_kv, r, D]
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=self._dec_mask)
        return out.reshape(b, hq, d)


def reference_decode(
    q: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """`DecodeKernel` in torch (the CPU's static decode path): each row through `attend` over
    its gathered KV, so it equals the eager path. q [B, H_q, D] -> [B, H_q, D]."""
    p = pages.shape[1]
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device=pages.device)
        out[b] = attend(q[b : b + 1], pages[tables[b, pos // p].long(), pos % p])[0]  # kv [n, 2, H_kv, D]
    return out
