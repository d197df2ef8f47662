"""KV-cache quantization codecs: KIVI-style integers and FP8 E4M3 (`kvtier.kv.hooks.KVCodec`).

Every codec packs tokens into rows of bytes (`pack` / `unpack`, one row per `group` tokens) and
its `roundtrip` is exactly `unpack(pack(kv))`. GPU-resident slices keep the packed rows in GPU
memory; streamed slices keep them in host memory, so only packed bytes cross PCIe; either way the
GPU unpacks them when attended (on CUDA with a fused Triton kernel,
`kvtier.policies.quant_triton`, through `unpack_into`).

KIVI layout (Liu et al. 2024), asymmetric min-max per group, `x^ = q * s + min`, with the scale
and minimum stored in fp16:

```
 keys   [n, D]: per-channel — each channel of `group` consecutive tokens shares (s, min)
 values [n, D]: per-token   — each run of `group` channels of one token shares (s, min)
 tokens:  [ coded in groups of `group` tokens ........ | newest `residual` full precision ]
 one packed row per token group:
   [ key codes g*G*D*b/8 | value codes g*G*D*b/8 | key (min, s) 2*G*D fp16 | value (min, s) ]
```

NOTE: KIVI quantizes keys block-wise and values token by token; here both are quantized a
`group` of tokens at a time once they are older than the residual window, so a value stays full
precision at most `group - 1` tokens longer than in KIVI. The stored result is the same.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.errors import ConfigError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 2  # scales and minimums are stored in fp16
MIN_SCALE = 2.0**-14  # smallest normal fp16: a constant group gets this step, not zero


def _fused(dst: torch.Tensor) -> bool:
    """Whether packed rows unpack into dst with a fused Triton kernel: on CUDA, into a contiguous
    dst, with triton installed and KVTIER_DEQUANT not "torch" (which forces the torch `unpack`)."""
    return (
        dst.is_cuda
        and dst.is_contiguous()
        and os.environ.get("KVTIER_DEQUANT", "") != "torch"
        and importlib.util.find_spec("triton") is not None
    )


def _params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (min, scale) of min-max groups, as float32 values exactly representable in fp16."""
    lo16 = lo.to(torch.float16).float()
    scale = ((hi - lo16) / (2**bits - 1)).clamp_min(MIN_SCALE).to(torch.float16).float()
    return lo16, scale


def minmax_codes(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of x along `dim`: (codes uint8, min, scale), the last two
    float32 with `dim` kept as size 1 and values exact in fp16."""
    xf = x.float()
    lo, scale = _params(xf.amin(dim=dim, keepdim=True), xf.amax(dim=dim, keepdim=True), bits)
    q = torch.round((xf - lo) / scale).clamp(0, 2**bits - 1)
    return q.to(torch.uint8), lo, scale


def minmax_roundtrip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Quantize -> dequantize of x along `dim` (one group per slice of the other dims). Returns
    x's shape and dtype."""
    q, lo, scale = minmax_codes(x, bits, dim)
    return (q.float() * scale + lo).to(x.dtype)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes < 2**bits along the last dim: [..., n] -> [..., n * bits // 8] uint8."""
    if bits == 8:
        return codes
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [..., m] uint8 -> [..., m * 8 // bits] uint8 codes."""
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    return c.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 values exact in fp16, [m, ...] -> their fp16 bytes [m, 2 * prod(...)]."""
    return x.to(torch.float16).reshape(x.shape[0], -1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `_as_bytes`: [m, 2 * prod(shape)] uint8 -> float32 [m, *shape]."""
    return b.contiguous().view(torch.float16).float().reshape(b.shape[0], *shape)


@dataclass(frozen=True)
class KiviCodec:
    """Integer KV quantization with KIVI's layout: `bits` in {2, 4, 8}, groups of `group`."""

    bits: int = 4
    group: int = 32
    residual: int = 128  # newest tokens kept in full precision
    # NOTE: the layout above; the CPU decode kernel reads such rows in place (kvtier.attention.cpu_decode)
    row_layout: ClassVar[str] = "kivi"

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ConfigError(f"KIVI codec bits must be 2, 4 or 8, got {self.bits}")
        if self.group < 1 or self.residual < 0 or self.residual % self.group:
            raise ConfigError(
                f"KIVI residual ({self.residual}) must be a non-negative multiple of the group ({self.group})"
            )

    def frozen_tokens(self, length: int) -> int:
        return max(0, (length - self.residual) // self.group * self.group)

    def channel_group(self, d: int) -> int:
        return self.group if d % self.group == 0 else d  # value channel group: the head if D < group

    def row_bytes(self, heads: int, head_dim: int) -> int:
        """Bytes of one packed row: `group` tokens of `heads` KV heads."""
        codes = self.group * heads * head_dim * self.bits // 8
        key_params = 2 * heads * head_dim * SCALE_BYTES
        value_params = 2 * self.group * heads * (head_dim // self.channel_group(head_dim)) * SCALE_BYTES
        return 2 * codes + key_params + value_params

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        """kv [n, 2, G, D] (n a multiple of `group`) -> rows [n / group, row_bytes] uint8."""
        n, _, g, d = kv.shape
        if n % self.group:
            raise ValueError(f"KIVI codes whole groups of {self.group} tokens, got {n}")
        m, cg = n // self.group, self.channel_group(d)
        kq, klo, ks = minmax_codes(kv[:, 0].reshape(m, self.group, g, d), self.bits, dim=1)
        vq, vlo, vs = minmax_codes(kv[:, 1].reshape(m, self.group, g, d // cg, cg), self.bits, dim=4)
        parts = (
            pack_bits(kq.reshape(m, -1), self.bits),
            pack_bits(vq.reshape(m, -1), self.bits),
            _as_bytes(klo),
            _as_bytes(ks),
            _as_bytes(vlo),
            _as_bytes(vs),
        )
        return torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """rows [m, row_bytes] uint8 -> kv [m * group, 2, heads, head_dim] in `dtype`."""
        m, t, g, d = rows.shape[0], self.group, heads, head_dim
        cg = self.channel_group(d)
        nc = t * g * d * self.bits // 8
        kp, vp = 2 * g * d, 2 * t * g * (d // cg)
        cuts = [nc, nc, kp, kp, vp, vp]
        kc, vc, klo, ks, vlo, vs = torch.split(rows, cuts, dim=1)
        kq = unpack_bits(kc, self.bits).reshape(m, t, g, d).float()
        vq = unpack_bits(vc, self.bits).reshape(m, t, g, d // cg, cg).float()
        k = kq * _from_bytes(ks, (1, g, d)) + _from_bytes(klo, (1, g, d))
        v = vq * _from_bytes(vs, (t, g, d // cg, 1)) + _from_bytes(vlo, (t, g, d // cg, 1))
        kv = torch.stack((k.reshape(m * t, g, d), v.reshape(m * t, g, d)), dim=1)
        return kv.to(dtype)

    def unpack_into(self, rows: torch.Tensor, dst: torch.Tensor) -> bool:
        """Unpack rows into dst [m * group, 2, G, D] with the fused Triton kernel: on CUDA, into a
        contiguous dst, with triton installed and KVTIER_DEQUANT not "torch" (which forces the
        torch `unpack`). Returns whether it did."""
        if not _fused(dst):
            return False
        from kvtier.policies.quant_triton import unpack_kivi_into

        unpack_kivi_into(self, rows, dst)
        return True

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        """`unpack(pack(kv))`: the values packed storage gives back."""
        return self.unpack(self.pack(kv), kv.shape[2], kv.shape[3], kv.dtype)

    def packed_bytes(self, tokens: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes of K and V of `tokens` tokens over `heads` KV heads (all layers), packed: codes
        plus an fp16 scale and minimum per group; the residual window at `dtype_bytes`."""
        coded = self.frozen_tokens(tokens)
        full = (tokens - coded) * 2 * heads * head_dim * dtype_bytes
        return coded // self.group * self.row_bytes(heads, head_dim) + full


@dataclass(frozen=True)
class Fp8Codec:
    """FP8 E4M3 with a dynamic fp16 scale per token, KV head and K/V: `scale = amax / 448`."""

    group: int = 1  # tokens per packed row
    # NOTE: codes then scales; the CPU decode kernel reads such rows in place (kvtier.attention.cpu_decode)
    row_layout: ClassVar[str] = "e4m3"

    @property
    def residual(self) -> int:
        return 0  # every token is coded as soon as it is stored

    def frozen_tokens(self, length: int) -> int:
        return length

    def row_bytes(self, heads: int, head_dim: int) -> int:
        """One byte per element plus an fp16 scale per key or value vector of one head."""
        return 2 * heads * (head_dim + SCALE_BYTES)

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        """kv [n, 2, G, D] -> rows [n, row_bytes] uint8: codes, then scales."""
        n = kv.shape[0]
        xf = kv.float()
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
        scale = scale.to(torch.float16).float()
        codes = (xf / scale).to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, -1)
        return torch.cat((codes, _as_bytes(scale)), dim=1)

    def unpack(self, rows: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """rows [n, row_bytes] uint8 -> kv [n, 2, heads, head_dim] in `dtype`."""
        n, nc = rows.shape[0], 2 * heads * head_dim
        codes = rows[:, :nc].contiguous().view(torch.float8_e4m3fn).float().reshape(n, 2, heads, head_dim)
        scale = _from_bytes(rows[:, nc:], (2, heads, 1))
        return (codes * scale).to(dtype)

    def unpack_into(self, rows: torch.Tensor, dst: torch.Tensor) -> bool:
        """Unpack rows into dst [m, 2, G, D] with the fused Triton kernel (no fp32 copies of the
        slice), under the same conditions as `KiviCodec.unpack_into`. Returns whether it did."""
        if not _fused(dst):
            return False
        from kvtier.policies.quant_triton import unpack_fp8_into

        unpack_fp8_into(rows, dst)
        return True

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        """`unpack(pack(kv))`."""
        return self.unpack(self.pack(kv), kv.shape[2], kv.shape[3], kv.dtype)

    def packed_bytes(self, tokens: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
        """One byte per element plus an fp16 scale per key or value vector of one head."""
        return tokens * self.row_bytes(heads, head_dim)
