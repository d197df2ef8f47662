"""`Rotary.apply` and `Rotary.apply_half` on the torch path: bitwise HF's x * cos +
rotate_half(x) * sin, in every dtype, for slices of heads and a broadcast table row;
`RopeTable.rotate` bitwise `apply` at the same positions, below and above the rows from which it
gathers only the first halves of its tables."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import RopeConfig
from kvtier.model.rope import Rotary
from kvtier.sparse.rope_ext import HALF_ROWS, RopeTable


def _hf(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q/k: [T, H, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_is_bitwise_hf(dtype: torch.dtype) -> None:
    rotary = Rotary(RopeConfig(theta=10000.0), head_dim=64)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 6, 64, generator=gen) * 3).to(dtype)
    pos = torch.randint(0, 100_000, (37,), generator=gen)
    cos, sin = rotary.cos_sin(pos, dtype)
    heads = x[:, 2:5]  # a slice of heads: not contiguous
    row_cos, row_sin = cos[:1], sin[:1]  # one row broadcast over T
    for a, c, s in ((x, cos, sin), (heads, cos, sin), (x, row_cos, row_sin)):
        assert torch.equal(Rotary.apply(a, c, s), _hf(a, c, s))
        assert torch.equal(Rotary.apply_half(a, c[:, :32], s[:, :32]), _hf(a, c, s))


@pytest.mark.parametrize("rows", [50, HALF_ROWS + 7])
def test_rope_table_rotates_as_apply(rows: int) -> None:
    rotary = Rotary(RopeConfig(theta=500000.0), head_dim=32)
    table = RopeTable(rotary)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 3, 32, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 5000, (rows,), generator=gen)
    cos, sin = rotary.cos_sin(pos, torch.bfloat16)
    assert torch.equal(table.rotate(x, pos), _hf(x, cos, sin))
    assert not torch.equal(table.rotate(x, pos + 1), _hf(x, cos, sin))  # positions matter
