"""KV-cache quantization codecs: KIVI-style integers and FP8 E4M3 (see `KVCodec` in the store).

The store keeps the dequantized values (a simulation: quality is exactly that of quantized
storage; bytes are reported by `packed_bytes`, what packed storage would hold).

KIVI layout (Liu et al. 2024), asymmetric min-max per group, `x^ = round((x - min) / s) * s + min`:

```
 keys   [n, D]: per-channel — each channel of `group` consecutive tokens shares (s, min)
 values [n, D]: per-token   — each run of `group` channels of one token shares (s, min)
 tokens:  [ coded in groups of `group` tokens ........ | newest `residual` full precision ]
```

NOTE: KIVI quantizes keys block-wise and values token by token; here both are quantized a
`group` of tokens at a time once they are older than the residual window, so a value stays full
precision at most `group - 1` tokens longer than in KIVI. The stored result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 2  # scales and minimums are stored in fp16


def minmax_roundtrip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max quantize -> dequantize of x along `dim` (one group per slice of the
    other dims). Returns x's shape and dtype."""
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    q = torch.round((xf - lo) / scale).clamp(0, 2**bits - 1)
    return (q * scale + lo).to(x.dtype)


@dataclass(frozen=True)
class KiviCodec:
    """Integer KV quantization with KIVI's layout: `bits` in {2, 4, 8}, groups of `group`."""

    bits: int = 4
    group: int = 32
    residual: int = 128  # newest tokens kept in full precision

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ConfigError(f"KIVI codec bits must be 2, 4 or 8, got {self.bits}")
        if self.group < 1 or self.residual < 0 or self.residual % self.group:
            raise ConfigError(
                f"KIVI residual ({self.residual}) must be a non-negative multiple of the group ({self.group})"
            )

    def frozen_tokens(self, length: int) -> int:
        return max(0, (length - self.residual) // self.group * self.group)

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        n, _, g, d = kv.shape  # [n, 2, G, D]
        if n % self.group:
            raise ValueError(f"KIVI codes whole groups of {self.group} tokens, got {n}")
        cg = self.group if d % self.group == 0 else d  # value channel group: the head if D < group
        keys = kv[:, 0].reshape(n // self.group, self.group, g, d)  # token groups, per channel
        values = kv[:, 1].reshape(n, g, d // cg, cg)  # channel groups, per token
        k = minmax_roundtrip(keys, self.bits, dim=1).reshape(n, g, d)
        v = minmax_roundtrip(values, self.bits, dim=3).reshape(n, g, d)
        return torch.stack((k, v), dim=1)

    def packed_bytes(self, tokens: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes of K and V of `tokens` tokens over `heads` KV heads (all layers), packed: codes
        plus an fp16 scale and minimum per group; the residual window at `dtype_bytes`."""
        coded = self.frozen_tokens(tokens)
        elems = coded * 2 * heads * head_dim
        full = (tokens - coded) * 2 * heads * head_dim * dtype_bytes
        return elems * self.bits // 8 + elems // self.group * 2 * SCALE_BYTES + full


@dataclass(frozen=True)
class Fp8Codec:
    """FP8 E4M3 with a dynamic scale per token, KV head and K/V: `scale = amax / 448`."""

    def frozen_tokens(self, length: int) -> int:
        return length

    def roundtrip(self, kv: torch.Tensor) -> torch.Tensor:
        xf = kv.float()  # [n, 2, G, D]
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        q = (xf / scale).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(kv.dtype)

    def packed_bytes(self, tokens: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
        """One byte per element plus an fp16 scale per key or value vector of one head."""
        vectors = tokens * 2 * heads
        return vectors * (head_dim + SCALE_BYTES)


KV_QUANT = ("int8", "int4", "fp8")


def make_codec(name: str) -> KiviCodec | Fp8Codec:
    """The codec for `--kv-quant NAME`."""
    if name == "int8":
        return KiviCodec(bits=8)
    if name == "int4":
        return KiviCodec(bits=4)
    if name == "fp8":
        return Fp8Codec()
    raise ConfigError(f"unknown --kv-quant {name!r}; use one of {', '.join(KV_QUANT)}")
