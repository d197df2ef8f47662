"""The attention kernels against a float64 reference, including split-KV decode and LSE merging."""

from __future__ import annotations

import pytest
import torch

import kvtier.attention.dense as dense


def reference(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    t, hq, d = q.shape
    s, _, hkv, _ = kv.shape
    k = kv[:, 0].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    v = kv[:, 1].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(-1, -2) / d**0.5
    keep = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    return (scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("t,s,hq,hkv", [(1, 37, 6, 2), (5, 40, 4, 4), (9, 9, 4, 1), (1, 100, 8, 8)])
def test_attend_matches_reference(t: int, s: int, hq: int, hkv: int) -> None:
    g = torch.Generator().manual_seed(t * s)
    q, kv = torch.randn(t, hq, 16, generator=g), torch.randn(s, 2, hkv, 16, generator=g)
    assert torch.allclose(dense.attend(q, kv).double(), reference(q, kv), atol=1e-5)


@pytest.mark.parametrize("s", [32, 45, 101])
def test_split_kv_decode(monkeypatch: pytest.MonkeyPatch, s: int) -> None:
    monkeypatch.setattr(dense, "DECODE_SPLIT", 16)
    g = torch.Generator().manual_seed(s)
    q, kv = torch.randn(1, 6, 8, generator=g), torch.randn(s, 2, 2, 8, generator=g)
    assert torch.allclose(dense.attend(q, kv).double(), reference(q, kv), atol=1e-5)


def test_merge_of_blocks_equals_one_call() -> None:
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(5, 6, 8, generator=g), torch.randn(13, 2, 2, 8, generator=g)
    acc = None
    for part in (
        dense.attend_prefix_lse(q, kv[:4]),
        dense.attend_prefix_lse(q, kv[4:8]),
        dense.attend_self_lse(q, kv[8:, 0], kv[8:, 1]),
    ):
        acc = dense.merge_into(acc, part)
    assert acc is not None
    assert torch.allclose(acc[0].double(), reference(q, kv), atol=1e-5)


def test_stacked_merge_equals_folded_merges() -> None:
    """`merge_stacked` of four partials (one empty for some rows: lse -inf) gives what folding
    `merge_into` gives, and one call over the whole keys."""
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(5, 6, 8, generator=g), torch.randn(13, 2, 2, 8, generator=g)
    parts = [
        dense.attend_prefix_lse(q, kv[:4]),
        dense.attend_prefix_lse(q, kv[4:6]),
        dense.attend_prefix_lse(q, kv[6:8]),
        dense.attend_self_lse(q, kv[8:, 0], kv[8:, 1]),
    ]
    empty = (torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], float("-inf")))
    acc = None
    for part in parts:
        acc = dense.merge_into(acc, part)
    assert acc is not None
    parts.insert(2, empty)
    out, lse = dense.merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert torch.allclose(out, acc[0], atol=1e-6) and torch.allclose(lse, acc[1], atol=1e-6)
    assert torch.allclose(out.double(), reference(q, kv), atol=1e-5)


def _math_cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 stand-in for cuDNN's kernel, with its top-left causal alignment."""
    scores = q[0].double() @ k[0].double().transpose(-1, -2) / q.shape[-1] ** 0.5  # [H, T, S]
    if causal:
        t, s = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores.softmax(-1) @ v[0].double()).to(q.dtype), lse.float()


@pytest.mark.parametrize("t,s,hq,hkv", [(5, 40, 4, 4), (9, 9, 4, 1), (7, 30, 6, 2), (16, 64, 8, 1)])
def test_cudnn_split_merges_prefix_and_chunk(
    monkeypatch: pytest.MonkeyPatch, t: int, s: int, hq: int, hkv: int
) -> None:
    """The cuDNN path's head folding and log-sum-exp merge, with the kernel replaced by math."""
    import kvtier.attention.cudnn_split as split

    monkeypatch.setattr(split, "_cudnn", _math_cudnn)
    g = torch.Generator().manual_seed(t * s + hq)
    q, kv = torch.randn(t, hq, 16, generator=g), torch.randn(s, 2, hkv, 16, generator=g)
    assert torch.allclose(split.attend_split(q, kv).double(), reference(q, kv), atol=1e-5)


def test_cudnn_split_prefix_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix longer than one block is merged block by block, in few distinct shapes."""
    import kvtier.attention.cudnn_split as split

    assert split.prefix_blocks(0, 8) == []
    monkeypatch.setattr(split, "PREFIX_BLOCK", 20)
    assert split.prefix_blocks(50, 8) == [(0, 16), (16, 32), (32, 48), (48, 50)]
    shapes = {b - a for p in range(8, 400, 8) for a, b in split.prefix_blocks(p, 8)}
    assert shapes == {8, 16}  # chunked prefill: full blocks and one remainder size
    monkeypatch.setattr(split, "_cudnn", _math_cudnn)
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(8, 6, 16, generator=g), torch.randn(75, 2, 2, 16, generator=g)
    assert torch.allclose(split.attend_split(q, kv).double(), reference(q, kv), atol=1e-5)
