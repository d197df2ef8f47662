"""`HipStats`: the run-time counters of a `HipKernel` (stage recomputations, attended keys, and
the block caches' `CacheStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.sparse.gpu_cache import CacheStats


@dataclass
class HipStats:
    """Counters (mutable, run-time): stage recomputations in decode, pruned query blocks."""

    decode_recomputes: list[int]
    prefill_blocks: int = 0
    prompt_landmarks: int = 0  # decode queries (a slice's) whose stage 0 ran on the prompt's landmarks
    keys_read: int = 0  # attended keys counted on the host so far (see `attended_keys`)
    keys_pending: list[torch.Tensor] = field(default_factory=list)  # device counts, not yet read
    cache: CacheStats = field(default_factory=CacheStats)  # GPU block caches of streamed slices

    def count_keys(self, n: int | torch.Tensor) -> None:
        """Add attended keys: a host int, or a device count that prefill does not wait for."""
        if isinstance(n, int):
            self.keys_read += n
            return
        self.keys_pending.append(n)
        if len(self.keys_pending) >= 256:  # folded on the device, still no sync
            self.keys_pending[:] = [torch.stack(self.keys_pending).sum()]

    @property
    def attended_keys(self) -> int:
        """Sum over prefill query blocks of keys attended (sink + selected + window). Reads the
        device counts prefill left (a sync), once."""
        if self.keys_pending:
            self.keys_read += int(torch.stack(self.keys_pending).sum())
            self.keys_pending.clear()
        return self.keys_read

    @property
    def hit_rate(self) -> float:
        """Block-cache hits per lookup on decode steps served without streaming (1.0 if none)."""
        return self.cache.hit_rate
