"""Slice kernels that policies plug into the store: attention-mass scoring and cache-index RoPE.

Both wrap the exact dense kernel, so the attention output is the lossless one; what they add is
what an eviction policy needs to decide (`ScoringKernel`) or how positions are counted
(`CacheRopeKernel`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kvtier.attention.dense import attend
from kvtier.attention.interface import SliceStep
from kvtier.config import ModelConfig
from kvtier.model.rope import Rotary

SCORE_ROWS = 256  # queries per block when computing attention probabilities


class ScoreSink(Protocol):
    """Receives the attention mass a step's queries give each stored token of a slice."""

    def rows(self, t: int) -> range:
        """Which of the step's `t` queries to score (an empty range scores none)."""
        ...

    def observe(self, step: SliceStep, mass: torch.Tensor) -> None:
        """mass [G, S]: softmax attention summed over the scored queries and the query heads of
        each KV head, for the slice's S stored tokens (the step's own included)."""
        ...


def attention_mass(q: torch.Tensor, kv: torch.Tensor, start: int, rows: range) -> torch.Tensor:
    """Causal softmax attention of queries `rows` of q [T, H_q, D] over kv [S, 2, G, D] (query i
    sits at cache index start + i), summed over those queries and each KV head's query heads.

    Returns [G, S] float32. Computed in blocks of SCORE_ROWS queries, so memory stays
    O(H_q x SCORE_ROWS x S).
    """
    _, hq, d = q.shape
    s, _, g, _ = kv.shape
    r = hq // g
    keys = kv[:, 0].float()  # [S, G, D]
    mass = torch.zeros(g, s, dtype=torch.float32, device=kv.device)
    cols = torch.arange(s, device=kv.device)
    for a in range(rows.start, rows.stop, SCORE_ROWS):
        b = min(a + SCORE_ROWS, rows.stop)
        qq = q[a:b].float().view(b - a, g, r, d)  # [t, G, r, D]
        logits = torch.einsum("tgrd,sgd->grts", qq, keys) / math.sqrt(d)  # [G, r, t, S]
        pos = start + torch.arange(a, b, device=kv.device)
        logits.masked_fill_(cols[None, :] > pos[:, None], float("-inf"))
        mass += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
    return mass


class ScoringKernel:
    """Dense attention that also reports attention mass to a `ScoreSink` (H2O, SnapKV)."""

    def __init__(self, sink: ScoreSink) -> None:
        self.sink = sink

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        out = attend(q, kv)
        rows = self.sink.rows(q.shape[0])
        if len(rows):
            self.sink.observe(step, attention_mass(q, kv, step.start, rows))
        return out


class CacheRopeKernel:
    """Dense attention over un-rotated keys, rotated at their *cache* indices (StreamingLLM).

    The store runs with `rotate_keys=False`; keys and queries are rotated here at positions
    0 .. S - 1 inside the cache, so distances stay within the trained window after eviction.
    Without eviction, cache index = absolute position and the result equals the default path.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.rotary = Rotary(cfg.rope, cfg.head_dim, device)
        self._cos = self._sin = torch.empty(0)

    def _table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.dtype != dtype:
            size = max(n, 2 * self._cos.shape[0])
            self._cos, self._sin = self.rotary.cos_sin(torch.arange(size), dtype)  # [size, D]
        return self._cos[:n], self._sin[:n]

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        s, t = kv.shape[0], q.shape[0]
        cos, sin = self._table(s, q.dtype)
        keys = Rotary.apply(kv[:, 0], cos, sin)  # [S, G, D]
        rq = Rotary.apply(q, cos[s - t :], sin[s - t :])  # [T, H_q, D]
        return attend(rq, torch.stack((keys, kv[:, 1]), dim=1))
