"""Fused input projections: q, k and v as one matmul, gate and up as one, in every block.

A transform applied to a built model (after loading and any tensor-parallel sharding), in the
way gpt-fast applies quantization: each block's input Linears are concatenated along their
output dim into one, and the originals become views of its rows, so nothing is held twice. A
decode step then launches 4 GEMMs a layer instead of 7, and the small k/v ones (8 MB each for
Llama-3-8B) no longer run alone. On the CPU the outputs are bitwise those of the separate
matmuls (`tests/test_fused_projections.py`).
"""

from __future__ import annotations

from torch import nn

from kvtier.model.layers import GatedMLP
from kvtier.model.moe import MoE
from kvtier.model.self_attention import SelfAttention


def fuse_projections_(model: nn.Module) -> int:
    """Fuse every `SelfAttention`'s q/k/v and every `GatedMLP`'s gate/up in `model` (experts
    on the device included; latent attention keeps its own projections). Returns how many blocks it fused;
    a block fused before is left alone. Mutates `model`."""
    # Experts kept in host memory run from their packed rows (`MoE.host_experts`), not fused.
    on_host = {
        id(e) for m in model.modules() if isinstance(m, MoE) and m.host_experts is not None for e in m.experts
    }
    blocks = [
        m
        for m in model.modules()
        if (isinstance(m, SelfAttention) and m.qkv_proj is None)
        or (isinstance(m, GatedMLP) and m.gate_up_proj is None and id(m) not in on_host)
    ]
    for m in blocks:
        m.fuse()
    return len(blocks)
