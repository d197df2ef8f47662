"""The fused Triton dequantization of packed KIVI and FP8 rows against the torch unpack (bitwise
in fp32).

On the CPU the kernel runs in Triton's interpreter, in a fresh process (TRITON_INTERPRET=1 must
be set before triton is first imported, and other test modules may have imported it already).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.policies.quant import Fp8Codec, KiviCodec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# (bits, group, KV heads, head dim, dtype): int2/int4/int8, value channel groups of `group` or
# (head dim not a multiple of the group) the whole head.
CASES = [
    (4, 32, 1, 128, torch.bfloat16),
    (8, 32, 1, 64, torch.bfloat16),
    (2, 8, 2, 16, torch.float32),
    (4, 8, 3, 12, torch.float32),
]


def check(device: str) -> None:
    from kvtier.policies.quant_triton import unpack_kivi_into

    for bits, group, heads, dim, dtype in CASES:
        codec = KiviCodec(bits=bits, group=group, residual=0)
        gen = torch.Generator().manual_seed(bits * group + dim)
        kv = (torch.randn(5 * group, 2, heads, dim, generator=gen) * 3 + 1).to(device, dtype)
        rows = codec.pack(kv)
        assert rows.shape == (5, codec.row_bytes(heads, dim))
        ref = codec.unpack(rows, heads, dim, dtype)
        out = torch.full_like(kv, float("nan"))
        unpack_kivi_into(codec, rows, out)
        if device == "cpu" and dtype == torch.float32:
            assert torch.equal(out, ref), (bits, group, heads, dim)  # every code, scale and offset
        else:
            # bf16: the interpreter truncates fp32 -> bf16 (one unit in the last place at most);
            # CUDA rounds to nearest but may fuse the multiply-add.
            ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
            assert torch.allclose(out.float(), ref.float(), rtol=ulp, atol=0), (bits, group, heads, dim)


def check_fp8(device: str) -> None:
    from kvtier.policies.quant_triton import unpack_fp8_into

    codec = Fp8Codec()
    # Every finite E4M3 code (0x7f and 0xff are NaN), each under a scale of 1 and of 3/1024.
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    heads, dim = 1, codes.numel() // 2  # a token's K and V of one 127-wide head: all 254 codes
    rows = torch.empty(2, codec.row_bytes(heads, dim), dtype=torch.uint8)
    rows[:, : 2 * heads * dim] = codes
    scales = torch.tensor([[1.0, 1.0], [3 / 1024, 0.5]], dtype=torch.float16)
    rows[:, 2 * heads * dim :] = scales.view(torch.uint8)
    gen = torch.Generator().manual_seed(8)
    kv = torch.randn(37, 2, 3, 64, generator=gen) * torch.logspace(-6, 2, 64)  # subnormal codes too
    for packed, shape, dtype in (
        (rows, (2, 2, heads, dim), torch.float32),
        (codec.pack(kv), kv.shape, torch.float32),
        (codec.pack(kv), kv.shape, torch.bfloat16),
    ):
        packed = packed.to(device)
        ref = codec.unpack(packed, shape[2], shape[3], dtype)
        out = torch.full(shape, float("nan"), dtype=dtype, device=device)
        unpack_fp8_into(packed, out)
        if dtype == torch.float32:
            assert torch.equal(out, ref), (out - ref).abs().max()
        else:
            assert torch.allclose(out.float(), ref.float(), rtol=2.0**-7, atol=0)


def test_interpreted_kernel_equals_torch_unpack_bitwise() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parent.parent
    code = "from tests.test_dequant_triton import check, check_fp8; check('cpu'); check_fp8('cpu')"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_compiled_kernel_matches_torch_unpack() -> None:
    check("cuda")
    check_fp8("cuda")


def test_kernel_arguments_avoid_names_the_launcher_shadows() -> None:
    """Triton's compiled launcher binds arguments in generated code whose locals (`params`,
    `specialization`, `options`, ...) shadow kernel arguments of the same name; the interpreter
    does not, so only this check catches it on a CPU machine."""
    import inspect

    from kvtier.model import fused
    from kvtier.policies import quant_triton
    from kvtier.sparse import triton_attn_kernels, triton_bisect

    reserved = {"params", "specialization", "options", "backend", "specialize_impl", "JITCallable"}
    # JIT functions, or interpreted ones when another test set TRITON_INTERPRET: both wrap `fn`.
    kernels = [
        obj
        for mod in (quant_triton, triton_attn_kernels, triton_bisect, fused)
        for obj in vars(mod).values()
        if inspect.isfunction(getattr(obj, "fn", None))
    ]
    assert len(kernels) >= 10
    for kernel in kernels:
        names = set(inspect.signature(kernel.fn).parameters)
        assert not names & reserved, (kernel.fn.__name__, names & reserved)
