"""`StagePieces`: the pruning stages of `HipKernel` as its prefill and decode steps run them, a mixin.

A step's stages run over a whole slice, a `PositionedKV` view of a slice's GPU block cache, or
a slice's keys on the host (stage 0 alone: `HostKeys` read in ranges, `ExtentKeys` in place);
with `HipConfig.probe_scoring` their chunks are scored on the bisection's probes with Triton.
The mixin holds no state of its own: it declares the attributes of `HipKernel`
(`kvtier.sparse.kernel`) it uses, and `HipKernel` sets them. A base of `CachedDecode`
(`kvtier.sparse.cached_decode`), through which `HipKernel` has it.
"""

from __future__ import annotations

import os
from typing import cast

import torch

from kvtier.attention.interface import ExtentKeys
from kvtier.sparse.block_sparse import use_triton
from kvtier.sparse.config import HipConfig
from kvtier.sparse.decode_buffer import KV
from kvtier.sparse.gpu_cache import PositionedKV
from kvtier.sparse.host_keys import HostKeys
from kvtier.sparse.prefill import prune_blocks
from kvtier.sparse.pruning import run_stages
from kvtier.sparse.rope_ext import RopeTable


class StagePieces:
    """The stage pieces both halves of `HipKernel` run (`_stages`, `_window_start`, `_middle`).
    Reads the kernel's config and RoPE table; mutates nothing."""

    # Of `HipKernel` (see its `__init__`).
    cfg: HipConfig
    rotary: RopeTable | None  # context extension: keys rotated in the kernel

    def _window_start(self, first_query: int) -> int:
        """w0 of a query block: the window covers [w0, query] for every query of the block."""
        return max(self.cfg.sink, first_query - self.cfg.window + 1)

    def _decode_window_start(self, query: int) -> int:
        """w0 of a decode query: `_window_start`, or with `HipConfig.align_window` that rounded
        down to a stage-0 chunk boundary, so [sink, w0) is whole chunks."""
        w0 = self._window_start(query)
        if not self.cfg.align_window:
            return w0
        c0 = self.cfg.chunk_sizes[0]
        return self.cfg.sink + (w0 - self.cfg.sink) // c0 * c0

    def _middle(self, w0: int, device: torch.device) -> torch.Tensor:
        """Stage-0 candidates: every key between the sinks and the window, [max(w0 - sink, 0)]."""
        return torch.arange(self.cfg.sink, w0, device=device)

    def _stages(
        self,
        q: torch.Tensor,
        pos: torch.Tensor,
        kv: KV | HostKeys | ExtentKeys,
        layer: int,
        cand: torch.Tensor,
        first: int,
        upto: int | None = None,
    ) -> list[torch.Tensor]:
        """Stages first..upto - 1 (all by default) over kv: a whole slice, a `PositionedKV` view,
        or a slice's keys on the host (stage 0 alone: read in ranges, or in place by probe)."""
        cfg = self.cfg
        n = len(cfg.chunk_sizes) if upto is None else upto
        if isinstance(kv, ExtentKeys):  # stage 0 alone
            assert first == 0 and n == 1, "keys in place serve stage 0 alone"
            return [self._stage0_probes(q, pos, kv, layer, cand)]
        if not isinstance(kv, HostKeys) and self._probing(q):
            return self._stages_probed(q, pos, kv, layer, cand, first, n)
        whole = not isinstance(kv, PositionedKV)  # stage 0's candidates are a range: `span`
        if isinstance(kv, torch.Tensor):
            keys: object = kv[:, 0]
        else:
            keys = kv if isinstance(kv, HostKeys) else kv.map(lambda t: t[:, 0])
        return run_stages(
            q,
            pos,
            cast(torch.Tensor, keys),  # NOTE: a view is only indexed by positions, host keys by ranges
            cand,
            chunk_sizes=cfg.chunk_sizes[:n],
            budgets=cfg.stage_budgets(layer)[:n],
            strides=cfg.query_strides[:n],
            mode=cfg.scoring_rope(layer),
            rotary=self.rotary,
            window=cfg.window,
            first=first,
            head_score=cfg.head_score,
            span=cfg.sink if first == 0 and whole else None,  # see `_middle`
        )

    def _probing(self, q: torch.Tensor) -> bool:
        """Whether the stages score their chunks on the bisection's probes with Triton
        (`HipConfig.probe_scoring`): on CUDA, or on CPU tensors under Triton's interpreter."""
        if not self.cfg.probe_scoring or not use_triton():
            return False
        return q.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

    def _stages_probed(
        self, q: torch.Tensor, pos: torch.Tensor, kv: KV, layer: int, cand: torch.Tensor, first: int, n: int
    ) -> list[torch.Tensor]:
        """`_stages` first..n - 1 scored on their probes (`bisect_triton`): stage 0 over the
        slice's keys (a range), later stages over their candidates' keys in the slice or, in a
        `PositionedKV` view, where the block cache holds them (by address)."""
        cfg, outs = self.cfg, []
        for i in range(first, n):
            if i == 0:
                assert isinstance(kv, torch.Tensor), "stage 0 needs the whole slice or its keys"
                cand = self._stage0_probes(q, pos, kv[:, 0], layer, cand)
                outs.append(cand)
                continue
            m, chunk, budget = cand.numel(), cfg.chunk_sizes[i], cfg.stage_budgets(layer)[i]
            if -(-m // chunk) > budget // chunk:  # else every candidate is kept (`prune_stage`)
                if isinstance(kv, torch.Tensor):
                    keys, at = kv[:, 0], None
                else:
                    keys, addresses = kv.key_addresses(cand)
                    at = addresses[None]
                valid = torch.full((1,), m, dtype=torch.long, device=q.device)
                kept, _ = prune_blocks(
                    q[None], pos[None], keys, cand[None], valid, chunk, budget,
                    mode=cfg.scoring_rope(layer), rotary=self.rotary, window=cfg.window, triton=True,
                    head_score=cfg.head_score, addresses=at, length=kv.shape[0],
                )  # fmt: skip
                cand = kept[0] if m % chunk == 0 else kept[0][kept[0] >= 0]  # no padding: no sync
            outs.append(cand)
        return outs

    def _stage0_probes(
        self,
        q: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor | ExtentKeys,
        layer: int,
        cand: torch.Tensor,
    ) -> torch.Tensor:
        """Stage 0 of one decode query q [1, H_q, D] at pos [1] over cand == arange(sink, w0),
        its chunks scored on the bisection's probes alone (`prune_blocks` with `bisect_triton`,
        as a prefill block of one query): keys [S, G, D] of the staged slice, or `ExtentKeys`
        read in place from host memory. Returns the kept positions, sorted."""
        cfg = self.cfg
        n, chunk, budget = cand.numel(), cfg.chunk_sizes[0], cfg.stage_budgets(layer)[0]
        valid = torch.full((1,), n, dtype=torch.long, device=q.device)
        kept, _ = prune_blocks(
            q[None], pos[None], keys, None, valid, chunk, budget, mode=cfg.scoring_rope(layer),
            rotary=self.rotary, window=cfg.window, first=cfg.sink, width=n, triton=True,
            head_score=cfg.head_score,
        )  # fmt: skip
        if n % chunk == 0 or -(-n // chunk) <= budget // chunk:  # no padding: no boolean mask (a sync)
            return kept[0]
        return kept[0][kept[0] >= 0]
