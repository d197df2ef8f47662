"""Sampling parameters (vLLM's names) and the sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.units import SEED_LIMIT

SEED_MIN = -(2**63)
"""The lowest seed `torch.Generator.manual_seed` takes (the CLI's --seed starts at 0; the server
takes negative seeds too)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; `seed` makes sampling reproducible."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        # NOTE: `not x >= 0` and friends are also true for nan, which no comparison accepts.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_LIMIT:
            raise ConfigError(f"seed must be in {SEED_MIN}..{SEED_LIMIT - 1}, got {self.seed}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")


class Sampler:
    """Picks the next token from float32 logits [vocab]."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Token id as a 0-d tensor on the logits' device (no host sync)."""
        p = self.params
        if p.temperature == 0:
            return logits.argmax(-1)
        logits = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator)[0]
