"""`HipKernel`: InfiniteHiP sparse attention as a `SliceKernel` of the tiered KV store.

Prefill (T > 1): every block of `block_q` queries is pruned from scratch and attends its own
selection. Decode (T == 1): each stage's selection is cached per (layer, group[, head]) and
recomputed only every `refresh[i]` steps (or when an earlier stage was recomputed), so the
expensive first stage, the only one whose work grows with the context, runs rarely.

    decode step:   0   1   2   3   4   5   6   7   8      refresh = (4, 2, 1)
    stage 0        x               x               x
    stage 1        x       x       x       x       x
    stage 2        x   x   x   x   x   x   x   x   x

NOTE: while stage 0's selection is cached, tokens keep leaving the window; to lose none of them
the window of a cached decode step reaches back to where it started when stage 0 last ran (so
it grows by up to refresh[0] - 1 tokens between refreshes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.attention.interface import SliceStep
from kvtier.errors import ConfigError
from kvtier.model.rope import Rotary
from kvtier.sparse.block_sparse import attend_block
from kvtier.sparse.config import HipConfig
from kvtier.sparse.pruning import run_stages
from kvtier.sparse.rope_ext import RopeTable


@dataclass
class HipStats:
    """Counters (mutable, run-time): stage recomputations in decode, pruned query blocks."""

    decode_recomputes: list[int]
    prefill_blocks: int = 0
    attended_keys: int = 0  # sum over prefill query blocks of keys attended (sink + selected + window)


@dataclass
class _DecodeState:
    """Cached stage outputs of one (layer, group, head) during decode."""

    outputs: list[torch.Tensor]  # per stage: kept positions, sorted
    computed_at: list[int]  # decode step of each stage's last recomputation
    window_start: int  # w0 when stage 0 last ran
    step: int = 0
    position: int = 0  # position of the last decoded query


class HipKernel:
    """Sparse attention over one slice: `__call__(q [T, H_q_g, D], kv [S+T, 2, G, D], step)`.

    With `cfg.extend`, q and kv are un-rotated (store built with rotate_keys=False) and `rotary`
    is required; otherwise they arrive rotated at true positions. Mutates only its decode cache
    and stats, never kv.
    """

    def __init__(self, cfg: HipConfig, rotary: Rotary | None = None) -> None:
        if cfg.extend and rotary is None:
            raise ConfigError("hip extend=True needs the model's Rotary: keys are rotated in the kernel")
        self.cfg = cfg
        self.rotary = RopeTable(rotary) if cfg.extend and rotary is not None else None
        self.stats = HipStats(decode_recomputes=[0] * len(cfg.chunk_sizes))
        self._cache: dict[tuple[int, int, int], _DecodeState] = {}

    @property
    def needs_unrotated_keys(self) -> bool:
        """True when the store must keep K and Q un-rotated (`rotate_keys=False`)."""
        return self.cfg.extend

    def reset(self) -> None:
        """Forget every cached decode selection (a new sequence)."""
        self._cache.clear()

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep) -> torch.Tensor:
        if not self.cfg.per_head:
            return self._slice(q, kv, step, -1)
        g = kv.shape[2]
        r = q.shape[1] // g
        outs = [self._slice(q[:, h * r : (h + 1) * r], kv[:, :, h : h + 1], step, h) for h in range(g)]
        return torch.cat(outs, dim=1)

    def _slice(self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep, head: int) -> torch.Tensor:
        t = q.shape[0]
        key = (step.layer, step.group, head)
        if t == 1:
            return self._decode(q, kv, step, key)
        self._cache.pop(key, None)
        bq = self.cfg.block_q
        out = torch.empty_like(q)
        for b in range(0, t, bq):
            e = min(b + bq, t)
            pos = torch.arange(step.start + b, step.start + e, device=q.device)
            w0 = self._window_start(int(pos[0]))
            sel = self._stages(q[b:e], pos, kv, step.layer, self._middle(w0, q.device), 0)[-1]
            out[b:e] = self._attend(q[b:e], pos, kv, sel, w0)
            self.stats.prefill_blocks += 1
            self.stats.attended_keys += (
                min(self.cfg.sink, step.start + e) + sel.numel() + max(0, step.start + e - w0)
            )
        return out

    def _decode(
        self, q: torch.Tensor, kv: torch.Tensor, step: SliceStep, key: tuple[int, int, int]
    ) -> torch.Tensor:
        cfg = self.cfg
        pos = torch.tensor([step.start], device=q.device)
        st = self._cache.get(key)
        if st is None or step.start <= st.position:  # first decode step, or a new sequence
            first = 0
            st = None
        else:
            st.step += 1
            due = [st.step - c >= r for c, r in zip(st.computed_at, cfg.refresh, strict=True)]
            first = due.index(True) if any(due) else len(due)
        if st is None or first == 0:
            w0 = self._window_start(step.start)
            cand = self._middle(w0, q.device)
        else:
            w0 = st.window_start
            cand = st.outputs[first - 1]
        if first < len(cfg.chunk_sizes):
            new = self._stages(q, pos, kv, step.layer, cand, first)
            if st is None:
                st = _DecodeState(outputs=new, computed_at=[0] * len(new), window_start=w0)
            else:
                st.outputs[first:] = new
                st.computed_at[first:] = [st.step] * len(new)
                if first == 0:
                    st.window_start = w0
            for i in range(first, len(cfg.chunk_sizes)):
                self.stats.decode_recomputes[i] += 1
        assert st is not None
        st.position = step.start
        self._cache[key] = st
        return self._attend(q, pos, kv, st.outputs[-1], st.window_start)

    # -- pieces ---------------------------------------------------------------------------------

    def _window_start(self, first_query: int) -> int:
        """w0 of a query block: the window covers [w0, query] for every query of the block."""
        return max(self.cfg.sink, first_query - self.cfg.window + 1)

    def _middle(self, w0: int, device: torch.device) -> torch.Tensor:
        """Stage-0 candidates: every key between the sinks and the window, [max(w0 - sink, 0)]."""
        return torch.arange(self.cfg.sink, w0, device=device)

    def _stages(
        self, q: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, layer: int, cand: torch.Tensor, first: int
    ) -> list[torch.Tensor]:
        cfg = self.cfg
        return run_stages(
            q,
            pos,
            kv[:, 0],
            cand,
            chunk_sizes=cfg.chunk_sizes,
            budgets=cfg.stage_budgets(layer),
            strides=cfg.query_strides,
            mode=cfg.scoring_rope(layer),
            rotary=self.rotary,
            window=cfg.window,
            first=first,
            head_score=cfg.head_score,
        )

    def _attend(
        self, q: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, w0: int
    ) -> torch.Tensor:
        sinks = torch.arange(min(self.cfg.sink, int(pos[-1]) + 1), device=q.device)
        prefix = torch.cat((sinks, sel))
        return attend_block(q, pos, kv, prefix, w0, rotary=self.rotary, mode=self.cfg.attention_rope)
