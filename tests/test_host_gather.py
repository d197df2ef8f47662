"""`kvtier.kv.host_gather`: runs of a host slice read by one Triton launch, against the copies
`HostSlice.read_runs_into` makes one piece at a time.

On CPU tensors the kernel runs in Triton's interpreter (see tests/triton_interpreter.py); on
CUDA the extents are pinned and the output is on the GPU, as in a HiP block-cache refresh.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

pytestmark = NEEDS_TRITON

G, D, E = 3, 40, 24  # row of 2 * 3 * 40 = 240 elements (not a power of two); 24 tokens an extent


def _extents(n: int, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    """n separate extents [E, 2, G, D] of distinct values (each its own allocation)."""
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(E, 2, G, D, generator=gen).to(dtype) for _ in range(n)]
    return [e.pin_memory() for e in out] if pin else out


def _expected(extents: list[torch.Tensor], spans: list[tuple[int, int, int]], rows: int) -> torch.Tensor:
    whole = torch.cat(extents)  # the slice's tokens in order
    want = torch.full((rows, 2, G, D), -7.0, dtype=whole.dtype)
    for start, end, at in spans:
        want[at : at + end - start] = whole[start:end]
    return want


def _host_slice(extents: list[torch.Tensor]) -> Any:
    """A `HostSlice` whose arena hands out `extents` in order (reserve takes them)."""
    from kvtier.kv.host_slice import HostSlice

    pool = list(extents)

    class Arena:
        def take(self) -> torch.Tensor:
            return pool.pop(0)

    return HostSlice(Arena(), E)  # type: ignore[arg-type]


def test_runs_are_cut_into_tiles_of_at_most_tile_tokens() -> None:
    from kvtier.kv.host_gather import run_tiles

    tiles = run_tiles([(5, 41, 0), (50, 50, 36), (60, 61, 36)], tile=16)
    assert tiles.tolist() == [[5, 0, 16], [21, 16, 16], [37, 32, 4], [60, 36, 1]]
    assert run_tiles([]).shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_equals_one_copy_a_run(device: str, dtype: torch.dtype) -> None:
    """Runs inside one extent, across one and two extent boundaries, longer than a tile, of one
    token, empty, and out of order in the output: every row lands where a copy a run puts it,
    and rows no run names are untouched."""
    from kvtier.kv.host_gather import extent_offsets, gather_runs

    extents = _extents(5, dtype, pin=device == "cuda")
    spans = [(3, 9, 40), (20, 30, 0), (45, 98, 60), (100, 101, 10), (70, 70, 11), (110, 119, 11)]
    rows = 120
    out = torch.full((rows, 2, G, D), -7.0, dtype=dtype, device=device)
    gather_runs(extents, extent_offsets(extents, out.device), E, spans, out)
    assert torch.equal(out.cpu(), _expected(extents, spans, rows))


@pytest.mark.parametrize("device", DEVICES)
def test_a_ring_of_extents_wraps(device: str) -> None:
    """ring=2 (a quantized tier's full-precision tail): token p is in extent (p // E) % 2, so
    tokens 60-80 are rows 12-23 of extent 0 then 0-7 of extent 1."""
    from kvtier.kv.host_gather import extent_offsets, gather_runs

    extents = _extents(2, torch.float32, pin=device == "cuda")
    out = torch.zeros(20, 2, G, D, device=device)
    gather_runs(extents, extent_offsets(extents, out.device), E, [(60, 80, 0)], out, ring=2)
    assert torch.equal(out.cpu(), torch.cat((extents[0][12:], extents[1][:8])))


@pytest.mark.parametrize("device", DEVICES)
def test_host_slice_reads_runs_through_the_gather(device: str) -> None:
    """`HostSlice.read_runs_into` (on the GPU: the one-launch path; on the CPU: the copies)
    puts every run where it belongs, also after the slice grows by two extents (on the GPU the
    extents' offsets are rebuilt)."""
    host = _host_slice(_extents(4, torch.bfloat16, pin=device == "cuda"))
    host.reserve(2 * E)
    for spans in ([(1, 30, 0), (40, 48, 29)], [(70, 90, 0), (5, 6, 20)]):
        host.reserve(4 * E)  # the second pass has two more extents
        out = torch.full((37, 2, G, D), -7.0, dtype=torch.bfloat16, device=device)
        host.read_runs_into(out, spans)
        assert torch.equal(out.cpu(), _expected(host.extents, spans, 37))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_keys_reads_each_rows_first_half(device: str) -> None:
    """`keys=True`: out [n, G, D] gets the K half of each token's [2, G, D] row, across extent
    boundaries, and nothing of the V half; a K/V-shaped out is refused."""
    from kvtier.kv.host_gather import extent_offsets, gather_runs

    extents = _extents(5, torch.bfloat16, pin=device == "cuda")
    spans = [(3, 9, 40), (20, 30, 0), (45, 98, 60), (110, 119, 11)]
    out = torch.full((120, G, D), -7.0, dtype=torch.bfloat16, device=device)
    offsets = extent_offsets(extents, out.device)
    gather_runs(extents, offsets, E, spans, out, keys=True)
    assert torch.equal(out.cpu(), _expected(extents, spans, 120)[:, 0])
    with pytest.raises(ValueError, match="contiguous rows"):
        gather_runs(extents, offsets, E, spans, torch.zeros(120, 2, G, D, dtype=torch.bfloat16), keys=True)


@pytest.mark.parametrize("device", DEVICES)
def test_host_slice_reads_keys(device: str) -> None:
    """`HostSlice.read_keys_into`: tokens [start, end)'s keys [n, G, D], across extents (on the
    GPU through the key gather, on the CPU by strided copies)."""

    host = _host_slice(_extents(4, torch.float32, pin=device == "cuda"))
    host.reserve(4 * E)
    whole = torch.cat(host.extents)
    out = torch.full((70, G, D), -7.0, device=device)
    host.read_keys_into(out, 5, 75)
    assert torch.equal(out.cpu(), whole[5:75, 0])


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set: run the CPU cases in a
    fresh interpreter-mode process."""
    run_cpu_cases(__file__)


def test_page_tiles_cut_pages_by_their_counts() -> None:
    """`page_tiles`: page pages[k]'s first counts[k] tokens to rows k * page on, in tiles of 16;
    a count of 0 copies nothing (built with tensor ops, as on the GPU)."""
    from kvtier.kv.host_gather import page_tiles

    tiles = page_tiles(torch.tensor([7, 2, 0]), torch.tensor([20, 0, 5]), page=20, tile=16)
    assert tiles.tolist() == [[140, 0, 16], [156, 16, 4], [40, 20, 0], [56, 36, 0], [0, 40, 5], [16, 56, 0]]


@pytest.mark.parametrize("device", DEVICES)
def test_gather_tiles_reads_selected_pages(device: str) -> None:
    """Quest's pages through one launch over device-built tiles: whole pages, a partial last one
    and an unused slot; rows no tile names keep what they held."""
    from kvtier.kv.host_gather import extent_offsets, gather_tiles, page_tiles

    extents = _extents(5, torch.float32, pin=device == "cuda")
    page = 8
    pages = torch.tensor([1, 6, 14, 3], device=device)  # page 6 spans extents 1 and 2 (E = 24)
    counts = torch.tensor([8, 8, 3, 0], device=device)
    out = torch.full((4 * page, 2, G, D), -7.0, device=device)
    gather_tiles(extents, extent_offsets(extents, out.device), E, page_tiles(pages, counts, page), out)
    spans = [(8, 16, 0), (48, 56, 8), (112, 115, 16)]
    assert torch.equal(out.cpu(), _expected(extents, spans, 4 * page))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=DEVICES[1].marks)])
def test_host_slice_reads_pages(device: str) -> None:
    """`HostSlice.read_pages_into`: the same rows, the rest zeroed (on the CPU by a host gather;
    on the GPU through `gather_tiles`)."""

    host = _host_slice(_extents(5, torch.float32, pin=device == "cuda"))
    host.reserve(5 * E)
    out = torch.full((4 * 8, 2, G, D), -7.0, device=device)
    pages = torch.tensor([14, 6, 1, 3], device=device)  # any order
    host.read_pages_into(out, pages, torch.tensor([3, 8, 8, 0], device=device), 8)
    want = _expected(host.extents, [(112, 115, 0), (48, 56, 8), (8, 16, 16)], 32)
    want[want == -7.0] = 0.0
    assert torch.equal(out.cpu(), want)
