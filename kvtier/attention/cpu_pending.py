"""The handle of CPU decode attention once started (`CpuDecoder.start` returns it): its result
waits for the start's tasks, then merges them (the torch backend) or returns what the native
kernel merged.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from kvtier.attention.cpu_torch import merge


class PendingDecode:
    """CPU attention started by `CpuDecoder.start`; `result()` waits for it and merges."""

    def __init__(
        self,
        futures: list[Future[None]],
        out: torch.Tensor,
        lse: torch.Tensor,
        heads: int,
        merged: tuple[torch.Tensor, torch.Tensor] | None = None,
        into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self._futures = futures
        self._out = out  # [P, G, r, D] float32
        self._lse = lse  # [P, G, r]
        self._heads = heads
        self._merged = merged  # written by the futures (native), else merged here
        self._into = into  # where the torch backend's merge is copied (the native one writes it)

    @property
    def native(self) -> bool:
        """Whether the native kernel runs it (else PyTorch's CPU kernels)."""
        return self._merged is not None

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [H_q, D] float32, lse [H_q] float32), H_q = G x r, on the CPU."""
        for f in self._futures:
            f.result()
        if self._merged is not None:
            return self._merged
        out, lse = merge(self._out, self._lse, self._heads)
        if self._into is None:
            return out, lse
        self._into[0].copy_(out)
        self._into[1].copy_(lse)
        return self._into
