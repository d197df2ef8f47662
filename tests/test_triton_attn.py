"""The Triton block-sparse attention kernel against the pure-torch reference.

Without CUDA the kernels run on CPU tensors in Triton's interpreter: TRITON_INTERPRET=1 is set
here, before triton is first imported (kvtier.sparse.triton_attn imports it). With CUDA the
"cuda" cases run the compiled kernels and the "cpu" cases run only if TRITON_INTERPRET=1 was set
by the caller. Sizes are small: the interpreter runs each program in numpy.

Triton picks interpreter or compiler when a function is decorated, and torch may import
triton.language while other test modules are collected; then the CPU cases cannot run in this
process and `test_cpu_cases_in_subprocess` runs them in a fresh one with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

pytestmark = NEEDS_TRITON

from kvtier.config import RopeConfig  # noqa: E402
from kvtier.model.rope import Rotary  # noqa: E402
from kvtier.sparse.block_sparse import attend_block, attend_block_reference  # noqa: E402
from kvtier.sparse.rope_ext import RopeTable  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _case(
    device: str, s: int, g: int, r: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [s, 2, g, D] and a query pool [s, g * r, D] with unit-variance entries."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(s, 2, g, d, generator=gen).to(device, dtype)
    q = torch.randn(s, g * r, d, generator=gen).to(device, dtype)
    return kv, q


def _prefix(n: int, below: int, seed: int, device: str) -> torch.Tensor:
    """n sorted distinct positions in [0, below)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(below, generator=gen)[:n].sort().values.to(device)


def _rope(d: int, device: str) -> RopeTable:
    return RopeTable(Rotary(RopeConfig(), d, device=device))


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.2e} > {TOL[dtype]:.0e}"


# (Tb, G, r, D, P, window start below the first query, last query position)
SHAPES = [
    (1, 2, 1, 64, 0, 40, 150),  # decode, MHA, no prefix
    (1, 1, 4, 128, 37, 50, 230),  # decode, GQA 4, prefix not a tile multiple
    (1, 2, 3, 64, 70, 1, 200),  # decode, GQA 3, window = the query alone
    (64, 2, 1, 64, 21, 40, 180),  # prefill block
    (64, 1, 4, 128, 0, 10, 120),  # prefill, GQA 4, no prefix, window from 10 before the block
    (16, 1, 3, 64, 33, 0, 100),  # window starting at the first query
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary", [None, "absolute", "streaming"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Tb{}-G{}-r{}-D{}-P{}".format(*s[:5]))
def test_attend_block_matches_reference(
    device: str, dtype: torch.dtype, rotary: str | None, shape: tuple[int, ...]
) -> None:
    from kvtier.sparse.triton_attn import attend_block_triton

    tb, g, r, d, p, back, last = shape
    kv, qs = _case(device, last + 1, g, r, d, dtype, seed=sum(shape))
    q_pos = torch.arange(last - tb + 1, last + 1, device=device)
    w0 = int(q_pos[0]) - back
    prefix = _prefix(p, w0, seed=p, device=device)
    q = qs[q_pos]
    rope = _rope(d, device) if rotary else None
    mode = rotary or "absolute"
    out = attend_block_triton(q, q_pos, kv, prefix, w0, rotary=rope, mode=mode)
    ref = attend_block_reference(q, q_pos, kv, prefix, w0, rotary=rope, mode=mode)
    _check(out, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_key_list(device: str, dtype: torch.dtype, splits: int) -> None:
    """Decode with the key list split over programs and merged by log-sum-exp (incl. empty splits)."""
    from kvtier.sparse.triton_attn import attend_block_triton

    kv, qs = _case(device, 400, 1, 4, 64, dtype, seed=splits)
    q_pos = torch.tensor([399], device=device)
    prefix = _prefix(150, 300, seed=1, device=device)
    q = qs[q_pos]
    out = attend_block_triton(q, q_pos, kv, prefix, 300, num_splits=splits)
    _check(out, attend_block_reference(q, q_pos, kv, prefix, 300), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_block_below_sinks(device: str) -> None:
    """window_start past the last query (a block inside the sinks): no window beyond the block."""
    from kvtier.sparse.triton_attn import attend_block_triton

    kv, qs = _case(device, 64, 1, 3, 64, torch.float32, seed=3)
    q_pos = torch.arange(0, 8, device=device)
    prefix = torch.arange(0, 3, device=device)
    out = attend_block_triton(qs[q_pos], q_pos, kv, prefix, 16)
    _check(out, attend_block_reference(qs[q_pos], q_pos, kv, prefix, 16), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_streaming_prefix_past_queries_stays_in_tables(device: str) -> None:
    """A prefix that breaks the contract (every sink kept in a prompt's first block, keys past
    its queries, as bench/hip_kernels.py once passed) must not read the RoPE tables below row 0:
    on the H100 it faulted, under the interpreter it gave NaN rows. The output stays finite; the
    in-contract prefix (sinks cut at the block's end, as prefill builds it) equals the reference."""
    import kvtier.sparse.triton_attn as ta
    from kvtier.sparse.prefill import attended_prefix

    tb, g, r, d, sink = 16, 1, 2, 64, 40
    kv, qs = _case(device, 64, g, r, d, torch.float32, seed=7)
    q = qs[:tb].view(1, tb, g * r, d)
    q_pos = torch.arange(tb, device=device).view(1, tb)
    w0 = torch.tensor([sink], device=device)  # clamped to the block's end inside
    rope = _rope(d, device)
    every_sink = torch.arange(sink, device=device).view(1, -1)
    out = ta.attend_blocks_triton(q, q_pos, kv, every_sink, w0, rotary=rope, mode="streaming")
    assert torch.isfinite(out).all()
    nothing_selected = torch.empty(1, 0, dtype=torch.long, device=device)
    cut = attended_prefix(nothing_selected, sink, q_pos[:, -1] + 1)  # as prefill builds it
    out = ta.attend_blocks_triton(q, q_pos, kv, cut, w0, rotary=rope, mode="streaming")
    ref = attend_block_reference(q[0], q_pos[0], kv, cut[0, :tb], tb, rotary=rope, mode="streaming")
    _check(out[0], ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary", [None, "streaming"])
def test_batched_blocks(device: str, dtype: torch.dtype, rotary: str | None) -> None:
    """Several query blocks in one launch, with padded prefixes and a short last block."""
    from kvtier.sparse.triton_attn import attend_blocks_triton

    tb, g, r, d = 16, 2, 2, 64
    kv, qs = _case(device, 200, g, r, d, dtype, seed=7)
    starts, lens, n_pre = [96, 112, 128], [16, 16, 9], [30, 0, 45]
    rope = _rope(d, device) if rotary else None
    mode = rotary or "absolute"
    q = torch.zeros(3, tb, g * r, d, dtype=dtype, device=device)
    q_pos = torch.full((3, tb), -1, dtype=torch.int64, device=device)
    prefix = torch.full((3, max(n_pre)), -1, dtype=torch.int64, device=device)
    w0 = torch.tensor([s - 20 for s in starts], device=device)
    refs = []
    for b, (start, n, npre) in enumerate(zip(starts, lens, n_pre, strict=True)):
        pos = torch.arange(start, start + n, device=device)
        q[b, :n] = qs[pos]
        q_pos[b, :n] = pos
        pre = _prefix(npre, int(w0[b]), seed=b, device=device)
        prefix[b, :npre] = pre
        refs.append(attend_block_reference(qs[pos], pos, kv, pre, int(w0[b]), rotary=rope, mode=mode))
    out = attend_blocks_triton(q, q_pos, kv, prefix, w0, rotary=rope, mode=mode)
    for b, n in enumerate(lens):
        _check(out[b, :n], refs[b], dtype)
        assert not out[b, n:].any()  # padded queries give 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary", [None, "streaming"])
def test_gathered_decode_buffer(device: str, dtype: torch.dtype, rotary: str | None) -> None:
    """HiP decode's gathered rows (`AttendBuffer`: rebuilt, then two tokens appended) attended
    by the Triton kernel equal the reference gather over the slice."""
    from kvtier.sparse.decode_buffer import AttendBuffer
    from kvtier.sparse.triton_decode import attend_buffers_triton

    g, r, d, w0, last = 2, 4, 64, 150, 181
    kv, qs = _case(device, last + 1, g, r, d, dtype, seed=3)
    prefix = _prefix(70, w0, seed=2, device=device)
    rope = _rope(d, device) if rotary else None
    mode = rotary or "absolute"
    buf = AttendBuffer()
    buf.rebuild(kv, prefix, w0, last - 1, 1, rope, mode)
    buf.append(kv[last - 1], last - 1, rope)  # grows past the spare row
    buf.append(kv[last], last, rope)
    assert buf.length == 70 + last + 1 - w0
    q = qs[last : last + 1]
    qr = rope.rotate_at(q, last) if rope else q
    assert buf.k is not None and buf.v is not None
    out = attend_buffers_triton(qr, [buf.k], [buf.v], [buf.length])
    pos = torch.tensor([last], device=device)
    _check(out, attend_block_reference(q, pos, kv, prefix, w0, rotary=rope, mode=mode), dtype)


def _stepped_buffers(
    device: str, dtype: torch.dtype, rotary: str | None, pos: int
) -> tuple[list, list, list]:
    """Decode buffers of three queries at `pos` (g=2, r=2, D=32) of different lengths, the third
    full (its next step grows it); the queries [B, 4, D] and new rows [B, 2, 2, D] at pos."""
    from kvtier.sparse.decode_buffer import AttendBuffer

    g, r, d = 2, 2, 32
    rope = _rope(d, device) if rotary else None
    lengths = [(40, pos - 60), (600, pos - 500), (5, pos - 8)]  # (prefix, window start)
    kvs = [_case(device, pos + 1, g, r, d, dtype, seed=20 + i) for i in range(len(lengths))]
    bufs = []
    for i, ((n, w0), (kv, _)) in enumerate(zip(lengths, kvs, strict=True)):
        buf = AttendBuffer()
        spare = 8 if i == 2 else 20  # the third is full after 8 appends
        buf.rebuild(kv, _prefix(n, w0, seed=n, device=device), w0, pos - 8, spare, rope, rotary or "absolute")
        for p in range(pos - 8, pos):
            buf.append(kv[p], p, rope)
        bufs.append(buf)
    assert bufs[2].length == bufs[2].capacity and bufs[0].length < bufs[0].capacity
    qs = [q[pos : pos + 1] for _, q in kvs]
    return bufs, qs, [kv[pos] for kv, _ in kvs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary", [None, "streaming"])
def test_decode_buffers_in_one_launch(device: str, dtype: torch.dtype, rotary: str | None) -> None:
    """A layer's decode queries that rerun no stage (`step_buffers`: every buffer appends its
    token and attends, together) give bitwise what each buffer's own `step` gives, one buffer
    growing; the new rows land where `append` puts them."""
    from kvtier.sparse.decode_buffer import step_buffers

    pos = 1200
    rope = _rope(32, device) if rotary else None
    alone, qs, rows = _stepped_buffers(device, dtype, rotary, pos)
    batched, _, _ = _stepped_buffers(device, dtype, rotary, pos)
    want = torch.cat([buf.step(q, row, pos, rope) for buf, q, row in zip(alone, qs, rows, strict=True)])
    got = step_buffers(batched, torch.cat(qs), torch.stack(rows), pos, rope)
    assert torch.equal(got, want)
    for a, b in zip(alone, batched, strict=True):
        assert (a.length, a.end) == (b.length, b.end)
        assert torch.equal(a.k[: a.length], b.k[: b.length]) and torch.equal(a.v[: a.length], b.v[: b.length])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_buffers_kernel_batch_equals_alone(device: str, dtype: torch.dtype) -> None:
    """`attend_buffers_triton` over three buffers of different key splits, writing their new
    rows first, equals bitwise each buffer attended alone (after `append`) and, within
    rounding, the plain softmax over its rows."""
    from kvtier.sparse.block_sparse import softmax_attention
    from kvtier.sparse.triton_decode import attend_buffers_triton, entry_split

    pos = 1200
    alone, qs, rows = _stepped_buffers(device, dtype, None, pos)
    batched, _, _ = _stepped_buffers(device, dtype, None, pos)
    for buf in batched:
        buf._room(pos)
    new = torch.stack(rows)  # [B, 2, G, D]
    n = [buf.length + 1 for buf in batched]
    splits = {entry_split(k, 2, 2, dtype, 32, torch.device(device))[0] for k in n}
    assert len(splits) > 1 or device == "cuda", splits  # the interpreter's 4 "SMs" split long lists
    got = attend_buffers_triton(
        torch.cat(qs), [b.k for b in batched], [b.v for b in batched], n, new=(new[:, 0], new[:, 1])
    )
    for i, buf in enumerate(alone):
        buf.append(rows[i], pos, None)
        assert torch.equal(batched[i].k[: n[i]], buf.k[: buf.length])
        one = attend_buffers_triton(qs[i], [buf.k], [buf.v], [buf.length])
        assert torch.equal(got[i : i + 1], one)
        mask = torch.ones(1, buf.length, dtype=torch.bool, device=device)
        _check(one, softmax_attention(qs[i], buf.k[: buf.length], buf.v[: buf.length], mask), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotary", [None, "streaming", "absolute"])
def test_prefill_blocks_in_one_launch(device: str, rotary: str | None) -> None:
    """HiP prefill's batched attention (`attend_blocks`: blocks padded into one Triton launch,
    keys rotated in the kernel at their attention positions) equals the per-block reference,
    a short last block included."""
    from kvtier.sparse.block_sparse import attend_blocks

    g, r, d, block, first, t = 2, 2, 64, 16, 120, 37
    kv, qs = _case(device, first + t, g, r, d, torch.float32, seed=11)
    q = qs[first:]
    prefixes, starts = [], []
    for i, b in enumerate(range(0, t, block)):
        w0 = first + b - 20
        starts.append(w0)
        prefixes.append(_prefix(10 + 7 * i, w0, seed=i, device=device))
    rope = _rope(d, device) if rotary else None
    mode = rotary or "absolute"
    prefix = torch.nn.utils.rnn.pad_sequence(prefixes, batch_first=True, padding_value=-1)  # [B, P]
    out = attend_blocks(q, first, block, kv, prefix, starts, rotary=rope, mode=mode, triton=True)
    ref = attend_blocks(q, first, block, kv, prefix, starts, rotary=rope, mode=mode, triton=False)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [(256, 32, 8, 3), (128, 32, 4, 2)], ids=["m256", "m128"])
def test_prefill_tiles(
    device: str, tiles: tuple[int, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill launch shapes `_tiles` picks for 16-bit blocks of 64 queries x 4 heads (one
    program over 128 or 256 rows, key tiles of 32) equal the reference, on CPU in fp32 too."""
    import kvtier.sparse.triton_attn as ta

    monkeypatch.setattr(ta, "TILES", tiles)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tb, g, r, d, first = 64, 1, 4, 64, 150
    kv, qs = _case(device, first + 2 * tb, g, r, d, dtype, seed=5)
    q = qs[first:].view(2, tb, g * r, d)
    q_pos = torch.arange(first, first + 2 * tb, device=device).view(2, tb)
    w0 = q_pos[:, 0] - 20
    prefixes = [_prefix(40 + 9 * b, int(w0[b]), seed=b, device=device) for b in range(2)]
    prefix = torch.nn.utils.rnn.pad_sequence(prefixes, batch_first=True, padding_value=-1)
    rope = _rope(d, device)
    out = ta.attend_blocks_triton(q, q_pos, kv, prefix, w0, rotary=rope, mode="streaming")
    for b in range(2):
        ref = attend_block_reference(
            q[b], q_pos[b], kv, prefixes[b], int(w0[b]), rotary=rope, mode="streaming"
        )
        _check(out[b], ref, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_attend_block_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA attend_block runs the Triton kernel; KVTIER_SPARSE_KERNEL=torch forces the reference."""
    import kvtier.sparse.triton_attn as ta

    calls: list[int] = []
    real = ta.attend_block_triton

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ta, "attend_block_triton", spy)
    kv, qs = _case("cuda", 100, 1, 2, 64, torch.bfloat16, seed=0)
    q_pos = torch.tensor([99], device="cuda")
    prefix = torch.arange(0, 40, device="cuda")
    out = attend_block(qs[q_pos], q_pos, kv, prefix, 60)
    assert calls == [1]
    _check(out, attend_block_reference(qs[q_pos], q_pos, kv, prefix, 60), torch.bfloat16)
    monkeypatch.setenv("KVTIER_SPARSE_KERNEL", "torch")
    attend_block(qs[q_pos], q_pos, kv, prefix, 60)
    assert calls == [1]


def test_import_without_triton_dispatch() -> None:
    """CPU tensors never dispatch to Triton, so importing/using kvtier needs no triton."""
    kv, qs = _case("cpu", 50, 1, 1, 64, torch.float32, seed=0)
    q_pos = torch.tensor([49])
    prefix = torch.arange(0, 10)
    out = attend_block(qs[q_pos], q_pos, kv, prefix, 30)
    assert torch.equal(out, attend_block_reference(qs[q_pos], q_pos, kv, prefix, 30))


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
