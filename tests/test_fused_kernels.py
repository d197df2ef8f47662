"""The fused Triton kernels (RMSNorm, residual add + RMSNorm, RoPE, silu * up) against the torch
code they replace.

Without CUDA the kernels run on CPU tensors in Triton's interpreter: TRITON_INTERPRET=1 is set
here, before triton is first imported (kvtier.model.fused imports it). With CUDA the "cuda" cases
run the compiled kernels against the torch code on CUDA (KVTIER_FUSED=0), and the "cpu" cases run
only if TRITON_INTERPRET=1 was set by the caller. If triton.language was imported before this
file set the variable, `test_cpu_cases_in_subprocess` runs the CPU cases in a fresh process (as in
tests/test_triton_attn.py). Sizes are small: the interpreter runs each program in numpy.

Exact where the arithmetic is torch's op by op (RoPE, the residual add); within one unit in the
last place where only the order of a float32 reduction (RMSNorm) or the exp (silu on the CPU,
numpy's against torch's) differs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import DEVICES, NEEDS_TRITON, SUBPROCESS_ONLY, run_cpu_cases

pytestmark = NEEDS_TRITON

from kvtier.config import RopeConfig  # noqa: E402
from kvtier.model import layers, rope  # noqa: E402
from kvtier.model.layers import RMSNorm  # noqa: E402
from kvtier.model.rope import Rotary  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model code called directly is the torch reference, on CUDA too."""
    monkeypatch.setenv("KVTIER_FUSED", "0")


def _randn(*shape: int, seed: int, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two 16-bit float tensors."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.element_size() == 2

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max().item()) if a.numel() else 0


def _norm(n: int, dtype: torch.dtype, device: str, eps: float = 1e-5) -> RMSNorm:
    norm = RMSNorm(n, eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(n, generator=torch.Generator().manual_seed(n)))
    return norm.to(device, dtype)


# (T, H, D, heads sliced out of a wider tensor)
ROPE_SHAPES = [(13, 4, 64, False), (9, 3, 128, False), (7, 2, 32, True), (1, 8, 64, False)]


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "T{}-H{}-D{}-slice{}".format(*s))
def test_rope_is_bitwise_rotary_apply(
    device: str, dtype: torch.dtype, shape: tuple[int, int, int, bool]
) -> None:
    from kvtier.model.fused import rope as fused_rope

    t, h, d, sliced = shape
    x = _randn(t, 2 * h if sliced else h, d, seed=t + d, device=device, dtype=dtype, scale=3.0)
    if sliced:
        x = x[:, 1::2]  # heads of one group inside the [T, H_q, D] projection
    cos, sin = Rotary(RopeConfig(), d, device=device).cos_sin(torch.arange(500, 500 + t), dtype)
    out = fused_rope(x, cos, sin)
    ref = Rotary.apply(x, cos, sin)
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
@pytest.mark.parametrize("shape", [(5, 4096), (33, 96), (6, 4, 16)], ids=str)
def test_rms_norm_within_one_ulp(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Rows of a hidden stream, a width that is no power of two, and q/k norm over [T, H, D]."""
    from kvtier.model.fused import rms_norm

    norm = _norm(shape[-1], dtype, device)
    x = _randn(*shape, seed=sum(shape), device=device, dtype=dtype, scale=2.0)
    out = rms_norm(x, norm.weight, norm.eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert _ulps(out, norm(x)) <= 1


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
def test_add_rms_norm(device: str, dtype: torch.dtype) -> None:
    """The sum is the torch add bit for bit; the norm is `rms_norm` of that sum bit for bit."""
    from kvtier.model.fused import add_rms_norm, rms_norm

    norm = _norm(160, dtype, device, eps=1e-6)
    x = _randn(11, 160, seed=1, device=device, dtype=dtype, scale=4.0)
    delta = _randn(11, 160, seed=2, device=device, dtype=dtype)
    summed, out = add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(summed, x + delta)
    assert torch.equal(out, rms_norm(x + delta, norm.weight, norm.eps))
    ref_sum, ref_out = norm.add_norm(x, delta)
    assert torch.equal(summed, ref_sum) and _ulps(out, ref_out) <= 1


@pytest.mark.parametrize("device", DEVICES)
@DTYPES
def test_silu_mul(device: str, dtype: torch.dtype) -> None:
    """torch's silu formula, op by op: exact on CUDA (libdevice's expf, IEEE division, as torch's
    CUDA kernel); within one ulp on the CPU, where numpy's exp stands in for torch's."""
    from kvtier.model.fused import silu_mul

    gate = _randn(3, 5000, seed=3, device=device, dtype=dtype, scale=4.0)  # more than one program
    up = _randn(3, 5000, seed=4, device=device, dtype=dtype)
    out = silu_mul(gate, up)
    ref = F.silu(gate) * up
    if device == "cuda":
        assert torch.equal(out, ref)
    else:
        assert _ulps(out, ref) <= 1
    # The two halves of one gate-up output (`GatedMLP` after `fuse()`): rows 2 x 5000 apart.
    gate_up = torch.cat((gate, up), dim=1)  # [3, 10000]
    halves = silu_mul(*gate_up.chunk(2, dim=1))
    assert halves.is_contiguous() and torch.equal(halves, out)
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_mul(gate.t(), up.t())
    # A row narrower than one program's block (SmolLM2's 1536 channels): masked, not spilled.
    small = _randn(5, 2 * 1536, seed=5, device=device, dtype=dtype, scale=4.0)
    g, u = small.chunk(2, dim=1)
    ref = F.silu(g) * u
    out = silu_mul(g, u)
    assert torch.equal(out, ref) if device == "cuda" else _ulps(out, ref) <= 1


def _counting(calls: collections.Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("device", DEVICES)
def test_model_takes_the_fused_path(
    device: str, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A tiny Qwen3 (q/k norm, GQA) in bf16: every fused kernel is called, logits stay within
    bf16 rounding of the torch path. On the CPU `use_fused` is made to accept CPU tensors."""
    from kvtier.kv.store import TieredKVStore
    from kvtier.loading.weights import load_safetensors_folder
    from kvtier.model import fused
    from kvtier.planner.placement import plan_kv
    from tests.hf_reference import make_hf_model

    folder = tmp_path_factory.mktemp("qwen3")
    make_hf_model("qwen3-qknorm", folder)
    model, cfg = load_safetensors_folder(folder, torch.device(device), torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).to(device)

    def logits() -> torch.Tensor:
        plan = plan_kv(cfg, 12, policy="gpu", gpu_budget=None, dtype_bytes=2, chunk_size=12)
        store = TieredKVStore(cfg, plan, device=torch.device(device), dtype=torch.bfloat16, capacity=12)
        store.begin_step(12)
        out = model(ids, store, logits_at=torch.arange(12, device=device), mlp_chunk=5)
        store.end_step()
        return out

    ref = logits()
    calls: collections.Counter[str] = collections.Counter()
    for name in ("rms_norm", "add_rms_norm", "rope", "silu_mul"):
        monkeypatch.setattr(fused, name, _counting(calls, name, getattr(fused, name)))
    monkeypatch.setenv("KVTIER_FUSED", "1")
    if device == "cpu":

        def on_cpu(*tensors: torch.Tensor) -> bool:
            return all(t.dtype == torch.bfloat16 for t in tensors)

        monkeypatch.setattr(layers, "use_fused", on_cpu)
        monkeypatch.setattr(rope, "use_fused", on_cpu)
    out = logits()
    n = cfg.num_layers
    # per layer: input norm, q and k norm; add + norm; q and k rotated; 3 MLP sub-chunks; final norm
    assert calls == {"rms_norm": 3 * n + 1, "add_rms_norm": n, "rope": 2 * n, "silu_mul": 3 * n}
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_use_fused_needs_cuda_and_16_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_FUSED")
    assert not layers.use_fused(torch.zeros(2, dtype=torch.bfloat16))  # CPU
    if torch.cuda.is_available():
        x = torch.zeros(2, dtype=torch.bfloat16, device="cuda")
        assert layers.use_fused(x)
        assert not layers.use_fused(x.float())
        assert not layers.use_fused(x, x.half())
        monkeypatch.setenv("KVTIER_FUSED", "0")
        assert not layers.use_fused(x)


@SUBPROCESS_ONLY
def test_cpu_cases_in_subprocess() -> None:
    """triton.language was imported before TRITON_INTERPRET was set (by torch, while collecting
    other modules): run this file's CPU cases in a fresh interpreter-mode process."""
    run_cpu_cases(__file__)
