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
Prefill chunks attend one sequence at a time (`attend`); the decode tokens of two or more
sequences attend in ONE batched SDPA call over their KV gathered into [B, S_max] (padded keys
masked out), which is where continuous batching wins on the attention side.
"""

from __future__ import annotations

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
        self._cos = self._sin = torch.empty(0)
        self._write = torch.empty(0, dtype=torch.long)  # [T] flat slots of the step's tokens
        self._reads: list[tuple[int, int, torch.Tensor]] = []  # prefills: (offset, n_new, slots)
        self._dec_rows = torch.empty(0, dtype=torch.long)  # [B] stream index of each decode token
        self._dec_slots = torch.empty(0, dtype=torch.long)  # [B, S_max] flat slots, padded with 0
        self._dec_mask = torch.empty(0, dtype=torch.bool)  # [B, 1, 1, S_max] True = a real key

    @property
    def bytes_per_page(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.pages)

    def begin_step(self, steps: list[SeqStep]) -> None:
        """Set the batch of the next forward: one `SeqStep` per sequence, in token-stream order."""
        p = self.page_size
        positions, writes, reads = [], [], []
        decodes: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for s in steps:
            end = s.start + s.n_new
            assert len(s.block_table) * p >= end, "block table too short for the step"
            pos = torch.arange(end)
            table = torch.tensor(s.block_table, dtype=torch.long)
            slots = table[pos // p] * p + pos % p  # [end]
            positions.append(pos[s.start :])
            writes.append(slots[s.start :])
            if s.n_new == 1:
                decodes.append((offset, slots))
            else:
                reads.append((offset, s.n_new, slots.to(self.device)))
            offset += s.n_new
        if len(decodes) == 1:  # a lone decode token takes the exact single-sequence path
            reads.append((decodes[0][0], 1, decodes[0][1].to(self.device)))
            decodes = []
        if decodes:
            s_max = max(len(sl) for _, sl in decodes)
            padded = torch.zeros(len(decodes), s_max, dtype=torch.long)
            mask = torch.zeros(len(decodes), 1, 1, s_max, dtype=torch.bool)
            for b, (_, sl) in enumerate(decodes):
                padded[b, : len(sl)] = sl
                mask[b, ..., : len(sl)] = True
            self._dec_rows = torch.tensor([o for o, _ in decodes], device=self.device)
            self._dec_slots, self._dec_mask = padded.to(self.device), mask.to(self.device)
        else:
            self._dec_rows = torch.empty(0, dtype=torch.long, device=self.device)
        pos_all = torch.cat(positions)
        self._cos, self._sin = self.rotary.cos_sin(pos_all.to(self.device), self.dtype)
        self._write = torch.cat(writes).to(self.device)
        self._reads = reads

    def end_step(self) -> None:
        self._reads = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rotate, write the step's k/v into each sequence's pages, attend per sequence.

        q [T, H_q, D], k/v [T, H_kv, D] with T = sum of n_new. Mutates the pages of `layer`.
        """
        q = Rotary.apply(q, self._cos, self._sin)
        k = Rotary.apply(k, self._cos, self._sin)
        flat = self.pages[layer].view(-1, *self.pages[layer].shape[2:])  # [num_pages * P, 2, H_kv, D]
        flat[self._write] = torch.stack((k, v), dim=1)
        if len(self._reads) == 1 and self._reads[0][1] == q.shape[0]:
            return attend(q, flat[self._reads[0][2]])  # one sequence: no copy of the output
        out = torch.empty_like(q)
        for a, n, slots in self._reads:
            out[a : a + n] = attend(q[a : a + n], flat[slots])  # kv [start + n, 2, H_kv, D]
        if self._dec_rows.numel():
            out[self._dec_rows] = self._decode_batch(q[self._dec_rows], flat)
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
