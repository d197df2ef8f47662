"""`Rotary.apply` on the torch path: bitwise HF's x * cos + rotate_half(x) * sin, in every dtype,
for slices of heads and a broadcast table row; `RopeTable.rotate` bitwise `apply` at the same
positions (it gathers only the first halves of its tables)."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import RopeConfig
from kvtier.model.rope import Rotary
from kvtier.sparse.rope_ext import RopeTable


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
    assert torch.equal(Rotary.apply(x, cos, sin), _hf(x, cos, sin))
    heads = x[:, 2:5]  # a slice of heads: not contiguous
    assert torch.equal(Rotary.apply(heads, cos, sin), _hf(heads, cos, sin))
    row_cos, row_sin = cos[:1], sin[:1]  # one row broadcast over T
    assert torch.equal(Rotary.apply(x, row_cos, row_sin), _hf(x, row_cos, row_sin))


def test_rope_table_rotates_as_apply() -> None:
    rotary = Rotary(RopeConfig(theta=500000.0), head_dim=32)
    table = RopeTable(rotary)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 3, 32, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 5000, (50,), generator=gen)
    cos, sin = rotary.cos_sin(pos, torch.bfloat16)
    assert torch.equal(table.rotate(x, pos), _hf(x, cos, sin))
    assert not torch.equal(table.rotate(x, pos + 1), _hf(x, cos, sin))  # positions matter
