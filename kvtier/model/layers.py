"""Building blocks of the decoder: RMSNorm and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32, result in the input dtype (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), run in sub-chunks of tokens.

    `max_tokens` bounds the [t, intermediate] temporaries: a long prefill chunk is split so that
    the MLP's activation memory stays proportional to `max_tokens`, not to the chunk.
    """

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
        # x: [T, hidden]
        if max_tokens is None or x.shape[0] <= max_tokens:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        out = torch.empty_like(x)
        for s in range(0, x.shape[0], max_tokens):
            part = x[s : s + max_tokens]
            out[s : s + max_tokens] = self.down_proj(F.silu(self.gate_proj(part)) * self.up_proj(part))
        return out
