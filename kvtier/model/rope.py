"""Rotary position embedding (RoPE), with the 'linear' and 'llama3' frequency scalings."""

from __future__ import annotations

import math

import torch

from kvtier.config import RopeConfig
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
    return inv


class Rotary:
    """Applies RoPE at given absolute positions. Stateless apart from the frequency table.

    NOTE: cos/sin are computed in float32 and cast to the activation dtype before the rotation,
    the order Hugging Face uses, so results match it bit for bit in float32.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)  # [D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for `positions` [T] -> two [T, D] tensors in `dtype`."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

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


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes and strides `kvtier.model.fused.rope` takes."""
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        return False
    table = (x.shape[0], x.shape[-1])
    return cos.shape == table and sin.shape == table and cos.stride(-1) == 1 and sin.stride(-1) == 1
