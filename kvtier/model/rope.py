"""Rotary position embedding (RoPE), with the 'linear', 'llama3' and 'yarn' frequency scalings:
`Rotary` rotates whole heads in halves (Llama's rotate_half), `LatentRotary` the decoupled RoPE
part of DeepSeek-V2's queries and cache entries, in interleaved pairs (its complex form)."""

from __future__ import annotations

import math

import torch

from kvtier.config import ModelConfig, RopeConfig
from kvtier.model.layers import use_fused


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The per-pair rotation frequencies, [head_dim // 2] float32, after scaling."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.kind == "yarn":
        return _yarn(rope, head_dim, inv)
    return inv


def _yarn(rope: RopeConfig, dim: int, extrapolated: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolated (/ factor) frequencies below the correction range, the original ones
    above, a linear ramp between (transformers' `_compute_yarn_parameters`)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [D/2] weight of the original (extrapolated) frequency
    pos = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (rope.factor * pos) * (1 - keep) + extrapolated * keep


class Rotary:
    """Applies RoPE at given absolute positions. Stateless apart from the frequency table.

    NOTE: cos/sin are computed in float32 and cast to the activation dtype before the rotation,
    the order Hugging Face uses, so results match it bit for bit in float32.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)  # [D/2]
        self.factor = rope.attention_factor  # YaRN's scale on cos and sin (1: none)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for `positions` [T] -> two [T, D] tensors in `dtype`."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos.to(dtype), sin.to(dtype)

    def rotate_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's q [T, H_q, D] and k [T, H_kv, D] rotated, v as it is (what the store stores)."""
        return self.apply(q, cos, sin), self.apply(k, cos, sin), v

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] by cos/sin [T, D] (in x's dtype) -> [T, H, D].

        On CUDA in 16 bits this is one fused kernel (`kvtier.model.fused.rope`), bitwise equal to
        the torch code below; cos/sin rows broadcast over T (shape [1, D]) take the torch code.
        """
        if use_fused(x, cos, sin) and _fusable(x, cos, sin):
            from kvtier.model import fused

            return fused.rope(x, cos, sin)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    @staticmethod
    def apply_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply` given the first halves of cos/sin, [T, D/2] (or [1, D/2]): RoPE's tables
        repeat each half (`cos_sin`). Computes [x1 c - x2 s, x2 c + x1 s] for x = [x1, x2]: per
        element the same rounded products and sum as x * cos + rotate_half(x) * sin (negation
        is exact), so bitwise `apply`'s torch code and HF's, with half the tables read and no
        rotated copy of x: for many rows (HiP's key rotations on the CPU were half its prefill
        time). Two more operators than `apply`, which a few rows (decode) pay in launches."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
        torch.sub(x1 * c, x2 * s, out=out[..., :half])
        torch.add(x2 * c, x1 * s, out=out[..., half:])
        return out


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes and strides `kvtier.model.fused.rope` takes."""
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        return False
    table = (x.shape[0], x.shape[-1])
    return cos.shape == table and sin.shape == table and cos.stride(-1) == 1 and sin.stride(-1) == 1


class LatentRotary:
    """RoPE of an MLA model (DeepSeek-V2): only the last `dims` values of each query head and of
    each cache entry rotate, in interleaved pairs (x[2i], x[2i+1]) as complex numbers, in float32
    (transformers' `apply_rotary_emb`). The store hands the entry over as its K and V halves
    (`kvtier.model.mla`), so the rotated part is the tail of V.
    """

    def __init__(self, rope: RopeConfig, dims: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = dims
        self.inv_freq = inverse_frequencies(rope, dims).to(device)  # [R/2]
        self.factor = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `positions` [T] -> two [T, R/2] float32 tables (any `dtype` asked)."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.factor, freqs.sin() * self.factor

    def rotate_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, L + R] and the entry halves k, v [T, 1, (L + R) / 2]: the last R values of q
        and of v (the decoupled key) rotated."""
        r = self.head_dim
        q = torch.cat((q[..., :-r], self.apply(q[..., -r:], cos, sin)), dim=-1)
        v = torch.cat((v[..., :-r], self.apply(v[..., -r:], cos, sin)), dim=-1)
        return q, k, v

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, R] times e^(i theta) pair by pair, cos/sin [T, R/2] float32 -> x's dtype."""
        pairs = x.float().unflatten(-1, (-1, 2))  # [T, H, R/2, 2]
        a, b = pairs[..., 0], pairs[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


def rotary_for(cfg: ModelConfig, device: torch.device | str = "cpu") -> Rotary | LatentRotary:
    """The RoPE the store applies to a step of `cfg`'s model."""
    if cfg.mla is not None:
        return LatentRotary(cfg.rope, cfg.mla.qk_rope_head_dim, device)
    return Rotary(cfg.rope, cfg.head_dim, device)
