"""CPU decode attention over host extents (both backends); the planner's CPU split is in
`tests/test_cpu_split.py`."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from kvtier.attention.cpu_decode import CpuDecoder, merge, native_library, plan_tasks, wide_vectors
from kvtier.attention.dense import attend_prefix_lse
from kvtier.loading.presets import preset_config
from kvtier.planner.hardware import HARDWARE

H200 = HARDWARE["h200"]
LLAMA3 = preset_config("llama-3-8b")
NEEDS_CXX = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
BACKENDS = ["torch", pytest.param("native", marks=NEEDS_CXX)]


@pytest.fixture(scope="module", params=BACKENDS)
def decoder(request: pytest.FixtureRequest) -> CpuDecoder:
    dec = CpuDecoder(2, backend=request.param)
    assert dec.backend == request.param
    return dec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,r,d", [(1, 4, 128), (2, 3, 64), (1, 9, 16), (4, 1, 8)])
def test_decode_matches_sdpa_over_the_extents(
    decoder: CpuDecoder, dtype: torch.dtype, g: int, r: int, d: int
) -> None:
    """Three extents, a length that ends inside the last one; r = 9 runs the native kernel twice."""
    gen = torch.Generator().manual_seed(g * 100 + r * 10 + d)
    extents = [torch.randn(700, 2, g, d, generator=gen).to(dtype) for _ in range(3)]
    q = torch.randn(g * r, d, generator=gen).to(dtype)
    out, lse = decoder.attend(q, extents, 1777)
    ref_out, ref_lse = attend_prefix_lse(q.float()[None], torch.cat(extents)[:1777].float())
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (g * r, d) and lse.shape == (g * r,)
    # The native kernel takes q in fp32; the torch backend rounds q to the KV dtype first.
    tol = 1e-6 if dtype == torch.float32 or decoder.backend == "native" else 1e-3
    assert torch.allclose(out, ref_out[0], atol=tol, rtol=tol)
    assert torch.allclose(lse, ref_lse[0], atol=tol, rtol=tol)


def test_result_does_not_depend_on_the_thread_count(decoder: CpuDecoder) -> None:
    extents = [torch.randn(5000, 2, 2, 64) for _ in range(2)]
    q = torch.randn(8, 64)
    one = CpuDecoder(1, backend=decoder.backend)
    a, b = one.attend(q, extents, 9000), decoder.attend(q, extents, 9000)
    one.close()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def slice_of(
    g: int, r: int, d: int, dtype: torch.dtype, tokens: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """q [G * r, D] and two extents of `tokens` tokens: several tasks in each."""
    gen = torch.Generator().manual_seed(seed)
    extents = [torch.randn(tokens, 2, g, d, generator=gen).to(dtype) for _ in range(2)]
    return torch.randn(g * r, d, generator=gen).to(dtype), extents


NATIVE_CASES = [
    (torch.bfloat16, 1, 4, 128),  # llama-3-8b's shapes, head-wise
    (torch.bfloat16, 2, 9, 64),  # r = 9: two passes of the kernel over the KV
    (torch.float32, 3, 2, 24),  # D = 24: not a multiple of 16
]


@NEEDS_CXX
@pytest.mark.parametrize("dtype,g,r,d", NATIVE_CASES)
def test_native_threads_give_bitwise_the_same_result(dtype: torch.dtype, g: int, r: int, d: int) -> None:
    q, extents = slice_of(g, r, d, dtype, 6000, seed=g * 10 + r)
    length = 11000  # the last extent's last task is short
    assert len(plan_tasks(extents, length)) >= 3
    results = []
    for threads in (1, 2, 3):
        dec = CpuDecoder(threads, backend="native")
        results.append(dec.attend(q, extents, length))
        dec.close()
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@NEEDS_CXX
@pytest.mark.parametrize("dtype,g,r,d", NATIVE_CASES)
def test_one_native_call_equals_the_kernel_task_by_task(dtype: torch.dtype, g: int, r: int, d: int) -> None:
    """The pool's single call per start against the kernel called once per task from Python
    (the path before the pool), merged by the same native merge: bitwise equal. PyTorch's
    merge of the same partials agrees to fp32 rounding."""
    q, extents = slice_of(g, r, d, dtype, 6000, seed=g + r + d)
    length = 11000
    dec = CpuDecoder(2, backend="native")
    got = dec.attend(q, extents, length)
    dec.close()
    lib = native_library()
    assert lib is not None
    fn = lib.kvtier_decode_bf16 if dtype == torch.bfloat16 else lib.kvtier_decode_f32
    tasks = plan_tasks(extents, length)
    out = torch.empty(len(tasks), g, r, d)
    lse = torch.empty(len(tasks), g, r)
    qs = q.float().contiguous()
    for n, t in enumerate(tasks):
        kv = extents[t.extent][t.start : t.start + t.tokens].data_ptr()
        assert fn(kv, t.tokens, g, qs.data_ptr(), d**-0.5, r, d, out[n].data_ptr(), lse[n].data_ptr()) == 0
    want = (torch.empty(g * r, d), torch.empty(g * r))
    lib.kvtier_merge(len(tasks), g * r, d, out.data_ptr(), lse.data_ptr(), *(x.data_ptr() for x in want))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch_out, torch_lse = merge(out, lse, g * r)
    assert torch.allclose(torch_out, got[0], rtol=1e-6, atol=1e-7)
    assert torch.allclose(torch_lse, got[1], rtol=1e-6, atol=1e-7)


@NEEDS_CXX
def test_native_result_does_not_depend_on_torchs_thread_count() -> None:
    """PyTorch's sum over the tasks splits differently with its intra-op threads; the native
    merge adds in task order."""
    q, extents = slice_of(2, 4, 128, torch.bfloat16, 9000, seed=9)
    dec = CpuDecoder(2, backend="native")
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            results.append(dec.attend(q, extents, 17000))
    finally:
        torch.set_num_threads(before)
        dec.close()
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,g,r,d", NATIVE_CASES)
def test_decode_matches_a_float64_reference(backend: str, dtype: torch.dtype, g: int, r: int, d: int) -> None:
    """Against attention computed in float64 over the same (rounded) values: the native kernel's
    fp32 accumulation over 11,000 tokens stays within a few fp32 ulps (PyTorch's flash kernel
    returns a bf16 output for bf16 KV: rounded to 8 bits)."""
    q, extents = slice_of(g, r, d, dtype, 6000, seed=3 * g + r)
    length = 11000
    dec = CpuDecoder(2, backend=backend)
    out, lse = dec.attend(q, extents, length)
    dec.close()
    kv = torch.cat(extents)[:length].double()  # [S, 2, G, D]
    # The torch backend rounds q to the KV dtype, the native kernel takes it in fp32.
    qd = (q.to(dtype) if backend == "torch" else q.float()).double().view(g, r, d)
    scores = torch.einsum("grd,sgd->grs", qd, kv[:, 0]) * d**-0.5  # [G, r, S]
    ref_lse = torch.logsumexp(scores, dim=-1)
    ref = torch.einsum("grs,sgd->grd", torch.softmax(scores, dim=-1), kv[:, 1])
    tol = 1e-6 if backend == "native" else 1e-5 if dtype == torch.float32 else 4e-3
    assert torch.allclose(out.double(), ref.reshape(g * r, d), rtol=tol, atol=tol)
    assert torch.allclose(lse.double(), ref_lse.reshape(g * r), rtol=tol, atol=tol)


@NEEDS_CXX
@pytest.mark.parametrize("g,r,d", [(1, 4, 128), (2, 9, 64), (2, 3, 96), (1, 2, 48)])
def test_bf16_on_16_floats_a_vector_equals_the_8_float_path(g: int, r: int, d: int) -> None:
    """On AVX-512 targets bf16 tokens with D a multiple of 32 are attended 16 floats a vector
    (`wide_vectors`; D = 48 stays on the 8-float path): within fp32 rounding of the 8-float
    path's output and of float64's."""
    q, extents = slice_of(g, r, d, torch.bfloat16, 700, seed=5 * g + r)
    dec = CpuDecoder(2, backend="native")
    runs = []
    try:
        for wide in (True, False):
            assert wide_vectors(wide) in (wide, None)
            runs.append(dec.attend(q, extents, 1300))
    finally:
        wide_vectors(True)
        dec.close()
    kv = torch.cat(extents)[:1300].double()
    scores = torch.einsum("grd,sgd->grs", q.float().double().view(g, r, d), kv[:, 0]) * d**-0.5
    ref = torch.einsum("grs,sgd->grd", torch.softmax(scores, dim=-1), kv[:, 1]).reshape(g * r, d)
    for out, lse in runs:
        assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)
        assert torch.allclose(lse.double(), torch.logsumexp(scores, dim=-1).reshape(-1), rtol=1e-6, atol=1e-6)
    assert torch.allclose(runs[0][0], runs[1][0], rtol=1e-6, atol=1e-6)


class Gate:
    """A stand-in for the CUDA event a start waits for: `synchronize` blocks until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.waited_on: list[str] = []

    def synchronize(self) -> None:
        self.waited_on.append(threading.current_thread().name)
        assert self.opened.wait(10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_returns_before_ready_and_waits_for_it_off_the_caller(backend: str) -> None:
    q, extents = slice_of(1, 4, 64, torch.float32, 5000, seed=5)
    dec = CpuDecoder(2, backend=backend)
    want = dec.attend(q, extents, 9000)
    gate = Gate()
    pending = [dec.start(q, extents, 9000, gate), dec.start(q, extents, 4000, gate)]  # type: ignore[arg-type]
    assert not any(f.done() for p in pending for f in p._futures)
    gate.opened.set()
    got = pending[0].result()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert pending[1].result()[0].shape == (4, 64)
    assert gate.waited_on and threading.current_thread().name not in gate.waited_on
    dec.close()


@NEEDS_CXX
def test_two_native_decoders_run_at_once() -> None:
    q, extents = slice_of(2, 4, 64, torch.bfloat16, 8000, seed=6)
    decoders = [CpuDecoder(2, backend="native") for _ in range(2)]
    want = decoders[0].attend(q, extents, 15000)
    pending = [d.start(q, extents, 15000) for d in decoders for _ in range(3)]
    for p in pending:
        out, lse = p.result()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    for d in decoders:
        d.close()


def test_decode_rejects_a_length_past_the_extents(decoder: CpuDecoder) -> None:
    with pytest.raises(ValueError, match="outside"):
        decoder.attend(torch.zeros(4, 8), [torch.zeros(10, 2, 1, 8)], 11)


def test_results_land_in_the_tensors_given(decoder: CpuDecoder) -> None:
    """`into`: the result is written to views of one buffer (how a layer's CPU slices share one
    copy to the GPU), equal to a start without it; a wrong shape or dtype is refused."""
    extents = [torch.randn(600, 2, 2, 32) for _ in range(2)]
    q = torch.randn(6, 32)
    buf = torch.full((2, 6 * 32 + 6), float("nan"))
    into = (buf[1, : 6 * 32].view(6, 32), buf[1, 6 * 32 :])
    out, lse = decoder.start(q, extents, 1100, into=into).result()
    ref_out, ref_lse = decoder.attend(q, extents, 1100)
    assert out.data_ptr() == into[0].data_ptr() and lse.data_ptr() == into[1].data_ptr()
    assert torch.equal(buf[1, : 6 * 32].view(6, 32), ref_out) and torch.equal(buf[1, 6 * 32 :], ref_lse)
    assert buf[0].isnan().all()  # nothing written past the views
    with pytest.raises(ValueError, match="into"):
        decoder.start(q, extents, 1100, into=(torch.empty(6, 32, dtype=torch.bfloat16), torch.empty(6)))
    with pytest.raises(ValueError, match="into"):
        decoder.start(q, extents, 1100, into=(torch.empty(6, 32), torch.empty(5)))
