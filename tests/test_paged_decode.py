"""The Triton paged decode kernel against its torch reference, and the reference against
`kvtier.attention.dense.attend`.

Runs the compiled kernel on CUDA and, without CUDA, Triton's interpreter on CPU tensors (as in
tests/test_triton_bisect.py: TRITON_INTERPRET=1 is set before triton is imported, and a
subprocess re-runs the CPU cases when triton was imported earlier by another test module). The
kernel module imports triton, so the tests import it inside their bodies. Sizes are small: the
interpreter runs each program in numpy.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

pytestmark = NEEDS_TRITON

from kvtier.attention.dense import attend  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative and absolute


def _paged(
    lens: list[int], h_kv: int, d: int, page: int, dtype: torch.dtype, device: str, seed: int, view: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pages [num_pages, page, 2, H_kv, D], block_tables [B, max_blocks] int32, seq_lens [B] int32).

    Each sequence gets its pages from one shuffled permutation of the pool, with spare pages
    left over; unused table entries also point at random pages. view: "contiguous",
    "transposed" (stored [num_pages, 2, page, H_kv, D]) or "sliced" (a head and a dim slice of a
    wider pool)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in lens]
    max_blocks = max(blocks) + 1
    num_pages = sum(blocks) + 3
    if view == "transposed":
        pages = torch.randn(num_pages, 2, page, h_kv, d, generator=gen).transpose(1, 2)
    elif view == "sliced":
        pages = torch.randn(num_pages, page, 2, h_kv + 1, d + 8, generator=gen)[:, :, :, 1:, :d]
    else:
        pages = torch.randn(num_pages, page, 2, h_kv, d, generator=gen)
    assert pages.is_contiguous() == (view == "contiguous")
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.randint(0, num_pages, (len(lens), max_blocks), generator=gen)
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[used : used + n]
        used += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return pages.to(device, dtype), tables.to(device, torch.int32), seq_lens.to(device)


CASES = {
    # name: (seq_lens, H_kv, r, D, page size, dtype, num_splits, pages view)
    "r1-p16-fp32": ([1, 5, 300], 2, 1, 64, 16, torch.float32, 4, "contiguous"),
    "r3-p5-bf16": ([300, 1, 37], 2, 3, 64, 5, torch.bfloat16, 16, "transposed"),
    "r4-p16-d128-fp32": ([257, 9, 2], 1, 4, 128, 16, torch.float32, 3, "sliced"),
    "r4-p5-bf16": ([3, 200], 2, 4, 64, 5, torch.bfloat16, 5, "sliced"),
    "r2-p7-d48-empty-seq": ([0, 64, 65], 2, 2, 48, 7, torch.float32, 2, "contiguous"),
    "r4-p16-one-split-empty-seq": ([0, 130, 7], 2, 4, 64, 16, torch.float32, 1, "contiguous"),
}


def test_default_splits_give_the_gpu_at_most_about_two_programs_a_multiprocessor() -> None:
    from kvtier.attention.paged_decode import MAX_SPLITS, default_splits

    assert default_splits(64, 8, 132) == 1  # 512 programs already
    assert default_splits(32, 8, 132) == 1  # 256: faster than 512 with two splits on the H200
    assert default_splits(16, 8, 132) == 2
    assert default_splits(1, 8, 132) == 33
    assert default_splits(1, 1, 132) == MAX_SPLITS  # capped
    assert default_splits(1, 8, None) == MAX_SPLITS  # not a GPU


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_reference(device: str, case: str) -> None:
    """GQA groups of 1-4 heads, page sizes that do and do not divide the 64-key tile, short and
    long sequences in one batch, shuffled page ids, strided page views, fp32 and bf16."""
    from kvtier.attention.paged_decode import paged_decode, paged_decode_reference

    lens, h_kv, r, d, page, dtype, splits, view = CASES[case]
    pages, tables, seq_lens = _paged(lens, h_kv, d, page, dtype, device, seed=len(case), view=view)
    q = torch.randn(len(lens), h_kv * r, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    got = paged_decode(q, pages, tables, seq_lens, num_splits=splits)
    ref = paged_decode_reference(q, pages, tables, seq_lens)
    assert got.shape == q.shape and got.dtype == dtype
    err = (got.float() - ref.float()).abs().max()
    assert torch.allclose(got.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype]), err
    if lens[0] == 0:
        assert bool((got[0] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_splits_past_the_keys_are_empty_and_long_sequences_use_every_split(device: str) -> None:
    """16 splits over 3 and 40 keys (one 64-key tile): splits 1-15 write lse -inf and out 0;
    600 keys over 4 splits of 192: every split has keys. Split 0's lse is the log-sum-exp of
    the scores."""
    from kvtier.attention.paged_decode import combine_splits, paged_decode_reference, paged_decode_splits

    pages, tables, seq_lens = _paged([3, 40], 2, 32, 16, torch.float32, device, seed=2, view="contiguous")
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3)).to(device)
    part, lse = paged_decode_splits(q, pages, tables, seq_lens, 16)
    assert part.shape == (2, 4, 16, 32) and lse.shape == (2, 4, 16)
    assert bool((lse[:, :, 1:] == float("-inf")).all())
    assert bool((part[:, :, 1:] == 0).all())
    ref = paged_decode_reference(q, pages, tables, seq_lens)
    assert torch.allclose(part[:, :, 0], ref, rtol=1e-4, atol=1e-5)
    keys = pages[tables[0, 0].long(), :3, 0].float()  # [3, H_kv, D] sequence 0's keys
    scores = torch.einsum("hd,nhd->hn", q[0], keys.repeat_interleave(2, dim=1)) / math.sqrt(32)
    assert torch.allclose(lse[0, :, 0], torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=1e-5)

    pages, tables, seq_lens = _paged([600], 1, 32, 16, torch.float32, device, seed=4, view="contiguous")
    q = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(5)).to(device)
    part, lse = paged_decode_splits(q, pages, tables, seq_lens, 4)
    assert bool(lse.isfinite().all())
    ref = paged_decode_reference(q, pages, tables, seq_lens)
    assert torch.allclose(combine_splits(part, lse), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_equals_the_torch_merge(device: str, dtype: torch.dtype) -> None:
    """33 splits (not a power of two) of head dim 48: the one-launch merge equals the torch ops,
    written in the query's dtype; a row whose splits are all empty is 0, one with a single
    nonempty split is that split's partial, and no weight overflows at lse ~ 1e4."""
    from kvtier.attention.paged_decode import combine_splits, combine_splits_fused

    gen = torch.Generator().manual_seed(11)
    part = torch.randn(3, 4, 33, 48, generator=gen)
    lse = torch.randn(3, 4, 33, generator=gen) * 5
    lse[0, 0] = float("-inf")  # a sequence without keys
    part[0, 0] = 0.0
    lse[0, 1, 1:] = float("-inf")  # one split holds every key
    part[0, 1, 1:] = 0.0
    lse[1] += 1e4  # large log-sum-exps: max-subtracted weights stay finite
    lse[2, :, 5:20] = float("-inf")
    part, lse = part.to(device), lse.to(device)
    got = combine_splits_fused(part, lse, dtype)
    ref = combine_splits(part, lse)
    assert got.shape == (3, 4, 48) and got.dtype == dtype
    assert torch.allclose(got.float(), ref, rtol=TOL[dtype], atol=TOL[dtype]), (got.float() - ref).abs().max()
    assert bool((got[0, 0] == 0).all())
    assert torch.allclose(got[0, 1].float(), part[0, 1, 0], rtol=TOL[dtype], atol=TOL[dtype])
    assert bool(got.float().isfinite().all())


def test_reference_equals_dense_attend() -> None:
    """The reference on one sequence equals the repo's exact attention over the same keys."""
    from kvtier.attention.paged_decode import paged_decode_reference

    s, h_kv, r, d, page = 45, 2, 3, 32, 8
    pages, tables, seq_lens = _paged([s], h_kv, d, page, torch.float32, "cpu", seed=6, view="transposed")
    q = torch.randn(1, h_kv * r, d, generator=torch.Generator().manual_seed(7))
    t = torch.arange(s)
    kv = pages[tables[0, t // page].long(), t % page]  # [S, 2, H_kv, D]
    ref = paged_decode_reference(q, pages, tables, seq_lens)
    assert torch.allclose(ref, attend(q, kv), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_graph_replays_new_lengths_and_tables() -> None:
    """Captured once, a replay with new seq_lens and block tables (same shapes) gives the
    reference for the new values."""
    from kvtier.attention.paged_decode import paged_decode, paged_decode_reference

    pages, tables, seq_lens = _paged([300, 7], 2, 64, 16, torch.bfloat16, "cuda", seed=8, view="contiguous")
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        paged_decode(q, pages, tables, seq_lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(q, pages, tables, seq_lens)
    seq_lens.copy_(torch.tensor([20, 301], dtype=torch.int32))
    tables.copy_(tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_decode_reference(q, pages, tables, seq_lens)
    assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
