"""The one narrow interface between the model and the KV cache.

The model computes q, k, v for the tokens of a step and hands them to an `Attention`; the
attention owns positions, RoPE and the cache. Everything that decides where KV lives or which
keys are read (offload, sparsity, quantization, eviction) sits behind this interface, so the
model code never changes for them.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Attention(Protocol):
    """Attention of one step (a prefill chunk or a decode token) over the cached context."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend the step's queries to the cache of `layer` plus the step's own keys.

        q: [T, H_q, D], k and v: [T, H_kv, D], all *before* RoPE; the implementation rotates
        them at the positions of the current step. Mutates the cache: the step's k and v are
        appended to layer `layer`. Returns the attention output [T, H_q, D].
        """
        ...
