"""`StepProbe`: what each decode step of a request did besides compute, for `generate --json`.

A slow decode step has a few suspects beyond its own kernels: the PCIe bytes it moved (a HiP
refresh refetches the blocks its new selection misses), Python's cyclic garbage collector
(a full collection walks every tracked object of a large heap), and CUDA's caching allocator
(a cudaMalloc, or a retry that frees the cache and syncs). The probe records the first per
step, the second as pauses attributed to the step they fell in, the third over the whole
decode, at the cost of a few host calls a step and no device sync.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from kvtier.kv.tiers import TierAccount

GC_PAUSE_S = 1e-3  # collections at least this long are listed with their step


class StepProbe:
    """Per decode step: H2D bytes (`account`'s counter) and garbage-collector pauses; over the
    decode: the CUDA allocator's cudaMalloc calls and retries. Made right before the first
    step, `step` after each, `close` at the end (also on error: it removes the gc callback)."""

    def __init__(self, account: TierAccount, device: torch.device) -> None:
        self._account = account
        self._device = device
        self._h2d = account.h2d_bytes
        self.step_h2d_bytes: list[int] = []
        self.collections = [0, 0, 0]  # by generation
        self.pause_s = 0.0
        self.long_pauses: list[dict[str, Any]] = []  # {"step", "generation", "s"} >= GC_PAUSE_S
        self._gc_started = 0.0
        self._alloc0 = self._allocator()
        self.allocator: dict[str, int] = {}
        gc.callbacks.append(self._on_gc)

    def _allocator(self) -> dict[str, int]:
        if self._device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self._device)
        mallocs, retries = stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)
        return {"cuda_mallocs": int(mallocs), "alloc_retries": int(retries)}

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_started
        generation = int(info.get("generation", 0))
        self.collections[min(generation, 2)] += 1
        self.pause_s += pause
        if pause >= GC_PAUSE_S:
            step = len(self.step_h2d_bytes)
            self.long_pauses.append({"step": step, "generation": generation, "s": round(pause, 4)})

    def step(self) -> None:
        """The end of a decode step."""
        h2d = self._account.h2d_bytes
        self.step_h2d_bytes.append(h2d - self._h2d)
        self._h2d = h2d

    def close(self) -> None:
        """Stop listening to the collector; take the allocator's counts over the decode."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
            after = self._allocator()
            self.allocator = {k: after[k] - self._alloc0[k] for k in after}

    def gc_summary(self) -> dict[str, Any]:
        """{"collections": [gen0, gen1, gen2], "pause_s", "long_pauses": [...]} over the decode."""
        pause = round(self.pause_s, 4)
        return {"collections": self.collections, "pause_s": pause, "long_pauses": self.long_pauses}
