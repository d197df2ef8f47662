"""Paged KV for many sequences on one device, and the `Attention` of one batch step.

Each layer owns one page tensor [num_pages, P, 2, H_kv, D]. A sequence's tokens live in the
pages of its block table; token position p is at (block_table[p // P], p % P), i.e. at flat
slot block_table[p // P] * P + p % P of the layer's [num_pages * P, 2, H_kv, D] view:

    block table   [ 7,        2,        9      ]        P = 4, start = 9, n_new = 2
    positions      0 1 2 3 | 4 5 6 7 | 8 9 10
    flat slots    28 .. 31 | 8 .. 11 | 36 37 38
                                          ^^ ^^  the step writes slots 37, 38 (positions 9, 10)
                                                 and attends over all 11 slots

A batch step concatenates every scheduled sequence's new tokens into one flat stream (prefill
chunks and decode tokens mixed); `begin_step` takes each sequence's (block table, start, n_new)
in that order and precomputes positions, RoPE tables and slot indices once for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.attention.dense import attend
from kvtier.config import ModelConfig
from kvtier.model.rope import Rotary


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a batch step: its pages, tokens already stored, tokens added now."""

    block_table: tuple[int, ...]
    start: int
    n_new: int


class PagedKVStore:
    """Page tensors of every layer; callable as `kvtier.attention.Attention` for a batch step."""

    def __init__(
        self, cfg: ModelConfig, *, num_pages: int, page_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = device
        self.dtype = dtype
        shape = (num_pages, page_size, 2, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: zeros, not empty: on the CPU untouched pages then cost no resident memory.
        self.pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.rotary = Rotary(cfg.rope, cfg.head_dim, device)
        self._steps: list[SeqStep] = []
        self._cos = self._sin = torch.empty(0)
        self._write = torch.empty(0, dtype=torch.long)  # [T] flat slots of the step's tokens
        self._reads: list[torch.Tensor] = []  # per sequence [start + n_new] flat slots

    @property
    def bytes_per_page(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.pages)

    def begin_step(self, steps: list[SeqStep]) -> None:
        """Set the batch of the next forward: one `SeqStep` per sequence, in token-stream order."""
        p = self.page_size
        positions, writes, reads = [], [], []
        for s in steps:
            end = s.start + s.n_new
            assert len(s.block_table) * p >= end, "block table too short for the step"
            pos = torch.arange(end)
            table = torch.tensor(s.block_table, dtype=torch.long)
            slots = table[pos // p] * p + pos % p  # [end]
            positions.append(pos[s.start :])
            writes.append(slots[s.start :])
            reads.append(slots.to(self.device))
        pos_all = torch.cat(positions)
        self._cos, self._sin = self.rotary.cos_sin(pos_all.to(self.device), self.dtype)
        self._write = torch.cat(writes).to(self.device)
        self._reads = reads
        self._steps = list(steps)

    def end_step(self) -> None:
        self._steps, self._reads = [], []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rotate, write the step's k/v into each sequence's pages, attend per sequence.

        q [T, H_q, D], k/v [T, H_kv, D] with T = sum of n_new. Mutates the pages of `layer`.
        """
        q = Rotary.apply(q, self._cos, self._sin)
        k = Rotary.apply(k, self._cos, self._sin)
        flat = self.pages[layer].view(-1, *self.pages[layer].shape[2:])  # [num_pages * P, 2, H_kv, D]
        flat[self._write] = torch.stack((k, v), dim=1)
        outs, a = [], 0
        for s, slots in zip(self._steps, self._reads, strict=True):
            kv = flat[slots]  # [start + n_new, 2, H_kv, D]
            outs.append(attend(q[a : a + s.n_new], kv))
            a += s.n_new
        return outs[0] if len(outs) == 1 else torch.cat(outs)
