"""What `LLM.generate` returns (shaped like vLLM's `RequestOutput`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


def step_summary(seconds: list[float]) -> dict[str, float]:
    """Step times -> {"min", "p50", "p90", "max"} (nearest-rank percentiles, 4 decimals); {} if none."""
    if not seconds:
        return {}
    ordered = sorted(seconds)

    def rank(p: float) -> float:
        return round(ordered[max(0, math.ceil(p * len(ordered)) - 1)], 4)

    return {"min": rank(0.0), "p50": rank(0.5), "p90": rank(0.9), "max": rank(1.0)}


@dataclass
class GenerationStats:
    """Speed, memory by tier and PCIe traffic of one request."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # seconds to turn the prompt into tokens (the chat template applied), before the setup
    tokenize_s: float = 0.0
    # seconds to plan the request and build its store before the prefill, its host tier pinned
    # there (Llama-3-8B at 512K: 64 GiB); 0 where the request built none (the batch engine)
    setup_s: float = 0.0
    # the GPU libraries' first-use warm-up beside the setup (`kvtier.engine.warmup`): its
    # {"seconds"} (and "error" if it failed); empty where none ran (KVTIER_WARMUP off, done)
    warmup: dict[str, float | str] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes (kv store + measured)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    decode_h2d_bytes: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    # CUDA's caching allocator over the request: retries (a failed cudaMalloc that freed the
    # cache and synced), cudaMalloc calls, peak reserved bytes; empty off CUDA
    gpu_allocator: dict[str, int] = field(default_factory=dict)
    # wall seconds of the decode steps, each ended by its sampled token's host read: "min",
    # "p50", "p90", "max" (a HiP refresh step stands out from the cached ones); empty when no
    # step was timed alone (one token, or the batch engine)
    decode_step_s: dict[str, float] = field(default_factory=dict)
    # each of those steps' seconds, in order (4 decimals): which steps are slow (HiP's reruns
    # come every few steps: with `lean`'s 128/8/4 a stage-0 rerun at steps 0, 128, ...)
    decode_step_times_s: list[float] = field(default_factory=list)
    # what else each of those steps did (`StepProbe`): its H2D bytes; the garbage collector's
    # collections by generation over the decode, their seconds, and those >= 1 ms with their
    # step; the CUDA allocator's cudaMalloc calls and retries over the decode (empty off CUDA)
    decode_step_h2d_bytes: list[int] = field(default_factory=list)
    decode_gc: dict[str, Any] = field(default_factory=dict)
    decode_allocator: dict[str, int] = field(default_factory=dict)
    # seconds of each prefill step (`runner.prefill_spans`: chunks, and HiP's last token alone),
    # in order, timed on the device without a host sync between steps (CUDA events); where a
    # long prompt's prefill goes (a chunk's cost grows with the context before it); empty when
    # the prompt was not prefilled step by step here (the batch engine)
    prefill_step_s: list[float] = field(default_factory=list)
    # "chunk": each chunk through every layer; "layer": the chunks through each layer in turn
    # (`kvtier.engine.layer_prefill`), `prefill_step_s` then holding each layer's seconds
    prefill_order: str = "chunk"
    # what the attention kernel counted (`CountingKernel`: HiP's stage reruns, cache hit rate,
    # decode graphs); empty for kernels that count nothing
    kernel: dict[str, object] = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    @property
    def decode_h2d_gbps(self) -> float:
        return self.decode_h2d_bytes / self.decode_s / 1e9 if self.decode_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefill_tokens_per_s"] = round(self.prefill_tokens_per_s, 2)
        d["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 3)
        d["decode_h2d_gbps"] = round(self.decode_h2d_gbps, 3)
        return d


@dataclass
class RequestOutput:
    """One finished request."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_token_ids),
            "stats": self.stats.to_dict(),
        }


def allocator_counts(device: torch.device) -> dict[str, int]:
    """CUDA caching-allocator counters of `device` that a request's stats report as deltas."""
    stats = torch.cuda.memory_stats(device)
    retries, mallocs = stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)
    return {"alloc_retries": int(retries), "cuda_mallocs": int(mallocs)}
