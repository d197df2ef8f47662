"""Stage 0 on landmark keys scored by `triton_chunk_max`'s kernel (one-key chunks) against
torch's float32 products: the same head scores, "max" and "softmax", and the same kept chunks.

CPU cases run Triton's interpreter, as tests/test_chunk_max.py does.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

D = 32

from kvtier.config import RopeConfig  # noqa: E402
from kvtier.model.rope import Rotary  # noqa: E402
from kvtier.sparse import landmarks  # noqa: E402
from kvtier.sparse.landmarks import _torch_scores, _triton_scores, key_scores, landmark_stage  # noqa: E402
from kvtier.sparse.rope_ext import RopeTable  # noqa: E402


def _case(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three blocks of 4 pooled rows x 3 query heads of 2 KV heads over 150 stage-0 chunks of 8
    tokens (more than the kernel's 64 chunks a program), the last block's candidates ending
    early: qr [3, 4, 2, 3, D], keys [S, 2, D], where [150, 2], valid [3]."""
    gen = torch.Generator().manual_seed(11)
    b, nq, g, r, chunk, first, c = 3, 4, 2, 3, 8, 4, 150
    keys = torch.randn(first + c * chunk, g, D, generator=gen)
    qr = torch.randn(b, nq, g, r, D, generator=gen)
    where = first + torch.arange(c)[:, None] * chunk + torch.randint(0, chunk, (c, g), generator=gen)
    valid = torch.tensor([c * chunk, 1100, 300])
    return qr.to(device), keys.to(device), where.to(device), valid.to(device)


@NEEDS_TRITON
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_score", ["max", "softmax"])
def test_kernel_scores_and_keeps_what_torch_does(device: str, head_score: str) -> None:
    """The kernel's head score of each landmark equals the torch products' (dead chunks -inf),
    and `landmark_stage` keeps the same positions with either."""
    qr, keys, where, valid = _case(device)
    chunk, c = 8, where.shape[0]
    lk = keys[where, torch.arange(keys.shape[1], device=device)]  # [C, G, D]
    live = (valid[:, None] - torch.arange(c, device=device)[None, :] * chunk) > 0
    got = _triton_scores(qr, lk, live, head_score)
    ref = _torch_scores(qr, lk, live, head_score)
    assert got.shape == ref.shape == (3, c)
    assert torch.allclose(got[live], ref[live], rtol=1e-5, atol=1e-4)
    assert bool((got[~live] == float("-inf")).all()) and bool((~live).any())
    kw = dict(first=4, mode="relative", rotary=None, limit=0, head_score=head_score)
    kept = [landmark_stage(qr, lk, where, valid, chunk, 40 * chunk, **kw, triton=t) for t in (True, False)]
    assert torch.equal(kept[0][0], kept[1][0]) and torch.equal(kept[0][1], kept[1][1])
    assert int(kept[0][1][2]) == 300  # the short block (38 chunks) keeps all it has


@NEEDS_TRITON
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "rotate"), [(16, True), (100, True), (100, False)])
def test_key_scores_kernel_equals_the_running_sums(
    device: str, window: int, rotate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`key_scores(triton=True)` (the band of products in tiles of 64 keys and 64 queries) gives
    the running sums' scores, rotated at their positions (unrotated: a slice's strided keys, read
    in place): 150 keys (a short last tile), windows within one tile and across two, cut by the
    chunk's end."""
    monkeypatch.setattr(landmarks, "WINDOW", window)
    gen = torch.Generator().manual_seed(window)
    t, g, r, start = 150, 2, 3, 40
    q = torch.randn(t, g * r, D, generator=gen).to(device)
    k = torch.randn(t, 2, g, D, generator=gen).to(device)[:, 0]  # a slice's keys: a strided view
    rope = RopeTable(Rotary(RopeConfig(), D, torch.device(device))) if rotate else None
    got = key_scores(q, k, start, rope, triton=True)
    want = key_scores(q, k, start, rope)
    assert got.shape == want.shape == (t, g) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set: run this file's CPU cases
    in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
