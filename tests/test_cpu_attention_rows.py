"""CPU decode attention over packed rows (`CpuDecoder.start_rows`): the native kernel reads KIVI
rows in place, the torch backend unpacks them first; both against float64 attention over the
values the codec gives back (`codec.unpack`), for every bit width, GQA group, head dim and a
value channel group of 32 or the whole head, both where the native kernel attends 4- and 8-bit
codes directly (up to 4 query heads a KV head) and where it unpacks a row first."""

from __future__ import annotations

import pytest
import torch

from kvtier.attention.cpu_decode import CpuDecoder, native_library, plan_row_tasks, wide_vectors
from kvtier.policies.quant import Fp8Codec, KiviCodec

NATIVE = native_library() is not None
BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="no C++ compiler"))]
CASES = [  # (bits, KV heads, query heads per KV head, head dim)
    (4, 2, 3, 64),
    (4, 1, 4, 128),
    (2, 2, 1, 64),
    (8, 1, 2, 48),  # D % 32 != 0: a value's channels share one (min, step)
    (4, 2, 2, 48),  # the same read from the codes (4 or 8 bits, up to 4 query heads a KV head)
    (8, 2, 4, 64),
    (4, 1, 9, 64),  # r > 8: two passes over the rows
]


def packed_slice(
    codec: KiviCodec | Fp8Codec, g: int, r: int, d: int, rows_per_extent: int, extents: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """q [G r, D] and row extents [rows_per_extent, row_bytes] of KV with a per-channel offset
    (as real keys have), packed by `codec`."""
    gen = torch.Generator().manual_seed(seed)
    n = rows_per_extent * extents * codec.group
    kv = torch.randn(n, 2, g, d, generator=gen) + torch.randn(1, 2, g, d, generator=gen) * 3
    rows = codec.pack(kv)
    q = torch.randn(g * r, d, generator=gen)
    return q, list(rows.split(rows_per_extent))


def reference(
    codec: KiviCodec | Fp8Codec, q: torch.Tensor, extents: list[torch.Tensor], rows: int, g: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = codec.unpack(torch.cat(extents)[:rows], g, d, torch.float32).double()  # [S, 2, G, D]
    qd = q.double().view(g, -1, d)
    scores = torch.einsum("grd,sgd->grs", qd, kv[:, 0]) * d**-0.5  # [G, r, S]
    out = torch.einsum("grs,sgd->grd", torch.softmax(scores, dim=-1), kv[:, 1])
    return out.reshape(-1, d), torch.logsumexp(scores, dim=-1).reshape(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,g,r,d", CASES)
def test_rows_match_float64_attention_over_unpacked_values(
    backend: str, bits: int, g: int, r: int, d: int
) -> None:
    codec = KiviCodec(bits=bits)
    q, extents = packed_slice(codec, g, r, d, rows_per_extent=40, extents=3, seed=bits * 7 + g + r)
    rows = 97  # into the third extent, tasks of several rows
    assert len(plan_row_tasks(extents, rows)) >= 3
    dec = CpuDecoder(2, backend=backend)
    pending = dec.start_rows(q, codec, extents, rows, g, d)
    assert pending.native == (backend == "native")
    out, lse = pending.result()
    dec.close()
    ref_out, ref_lse = reference(codec, q, extents, rows, g, d)
    assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("g,r,d", [(2, 2, 64), (1, 4, 128), (2, 9, 40)])
def test_fp8_rows_match_float64_attention_over_unpacked_values(backend: str, g: int, r: int, d: int) -> None:
    """FP8 rows (one token each, E4M3 codes scaled per vector): the native kernel reads them in
    place, subnormal codes and signs included (the values are spread over many binades)."""
    codec = Fp8Codec()
    q, extents = packed_slice(codec, g, r, d, rows_per_extent=600, extents=2, seed=1)
    dec = CpuDecoder(2, backend=backend)
    pending = dec.start_rows(q, codec, extents, 1000, g, d)
    assert pending.native == (backend == "native")
    out, lse = pending.result()
    dec.close()
    ref_out, ref_lse = reference(codec, q, extents, 1000, g, d)
    assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler")
def test_every_e4m3_code_widens_as_torch_reads_it() -> None:
    """All 254 finite E4M3 codes (the codec never writes NaN) through the native kernel: one
    token whose key is zero, so its value comes back as the output exactly."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    codec, d = Fp8Codec(), 8
    for chunk in codes.split(d):
        if chunk.numel() < d:
            chunk = torch.cat((chunk, torch.zeros(d - chunk.numel(), dtype=torch.uint8)))
        row = torch.zeros(1, codec.row_bytes(1, d), dtype=torch.uint8)
        row[0, d : 2 * d] = chunk  # the value's codes; the key's stay 0
        row[0, 2 * d :] = torch.tensor([1.0, 1.0], dtype=torch.float16).view(torch.uint8)  # scales 1
        dec = CpuDecoder(1, backend="native")
        out, _ = dec.start_rows(torch.ones(1, d), codec, [row], 1, 1, d).result()
        dec.close()
        assert torch.equal(out[0], chunk.view(torch.float8_e4m3fn).float())


def test_a_codec_the_kernel_does_not_read_unpacks_with_torch() -> None:
    codec = KiviCodec(bits=4, group=8, residual=8)  # 8-token rows: not the kernel's 32
    q, extents = packed_slice(codec, 2, 2, 64, rows_per_extent=60, extents=2, seed=1)
    dec = CpuDecoder(2)
    pending = dec.start_rows(q, codec, extents, 100, 2, 64)
    assert not pending.native
    out, lse = pending.result()
    dec.close()
    ref_out, ref_lse = reference(codec, q, extents, 100, 2, 64)
    assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler")
def test_native_rows_do_not_depend_on_the_thread_count() -> None:
    codec = KiviCodec(bits=4)
    q, extents = packed_slice(codec, 2, 4, 128, rows_per_extent=64, extents=2, seed=5)
    results = []
    for threads in (1, 2, 3):
        dec = CpuDecoder(threads, backend="native")
        results.append(dec.start_rows(q, codec, extents, 128, 2, 128).result())
        dec.close()
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler")
@pytest.mark.parametrize("g,r,d", [(2, 4, 128), (1, 1, 64), (3, 3, 96)])
def test_wide_4_bit_rows_equal_the_8_float_path_up_to_summation_order(g: int, r: int, d: int) -> None:
    """On AVX-512 targets 4-bit rows with D a multiple of 32 are attended 16 floats a vector
    (`wide_vectors`): outputs within fp32 rounding of the 8-float path's, both of float64's. Where
    the target lacks the path, `wide_vectors` says so and the switch changes nothing."""
    codec = KiviCodec(bits=4)
    q, extents = packed_slice(codec, g, r, d, rows_per_extent=24, extents=2, seed=g * 10 + r)
    dec = CpuDecoder(2, backend="native")
    runs = []
    try:
        for wide in (True, False):
            assert wide_vectors(wide) in (wide, None)
            runs.append(dec.start_rows(q, codec, extents, 45, g, d).result())
    finally:
        wide_vectors(True)
        dec.close()
    ref_out, ref_lse = reference(codec, q, extents, 45, g, d)
    for out, lse in runs:
        assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-5)
        assert torch.allclose(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.allclose(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(runs[0][1], runs[1][1], rtol=1e-6, atol=1e-6)


def test_rows_of_another_shape_are_refused() -> None:
    codec = KiviCodec(bits=4)
    q, extents = packed_slice(codec, 2, 2, 64, rows_per_extent=8, extents=1, seed=2)
    dec = CpuDecoder(1)
    with pytest.raises(ValueError, match="bytes"):
        dec.start_rows(q, codec, extents, 8, 1, 64)  # rows of 2 heads read as 1
    with pytest.raises(ValueError, match="outside"):
        dec.start_rows(q, codec, extents, 9, 2, 64)
    dec.close()
