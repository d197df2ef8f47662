"""What the batch engine is configured with: `BatchConfig` (pool and batch sizes, the tiered
runs' launcher) and `ModelHost` (what it needs of a loaded model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.config import ModelConfig
from kvtier.engine.batch.scheduler import SchedulerConfig
from kvtier.errors import ConfigError
from kvtier.methods import MethodChoice
from kvtier.model.llama import CausalLM


class ModelHost(Protocol):
    """What the batch engine needs of a loaded model (`kvtier.engine.llm.LLM` is one)."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Any
    method: MethodChoice

    @property
    def model(self) -> CausalLM: ...

    @property
    def name(self) -> str: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def budget_given(self) -> bool: ...

    def gpu_budget(self) -> int | None: ...


@dataclass(frozen=True)
class BatchConfig:
    """Pool and batch sizes. None = chosen from the device at start."""

    page_size: int = 16
    num_pages: int | None = None  # device pages (default: what the memory budget leaves; see sizing.py)
    num_host_pages: int | None = None  # host-tier pages for evicted prefixes (default: num_pages, capped)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    threads: int | None = None  # torch CPU threads of the engine thread (None: torch's default)
    # Decode-only steps from static buffers (`kvtier.engine.batch.graphs`), replayed as CUDA
    # graphs (None: on CUDA; on the CPU they run eagerly, for tests).
    static_decode: bool | None = None
    cuda_graphs: bool = True
    # Decode tokens a decode-only batch step computes before reading them back (1: one). With 2
    # or more, a step whose sequences all continue queues the next forward on the tokens the last
    # one sampled on the device, so the device runs the forwards back to back instead of waiting
    # for the host in between; a sequence that stops early drops its later tokens. It applies to
    # the static decode path (`static_decode`: on CUDA by default). Off (1) until the H200 says
    # it pays (bench/serve_gpu.py --decode-steps, pending_h200.sh 30).
    decode_steps: int = 1
    # GPU bytes kept out of the pool for requests over stores of their own (tiered runs, methods);
    # None: a quarter of the room, at most 4 GiB, when the pool is sized from memory (sizing.py).
    offload_reserve: int | None = None
    # Queue a tiered run's steps from a thread of its own (None: on CUDA), so that a launch the
    # device makes wait (its streams' queues full of slice loads) never holds the batch's steps.
    tiered_thread: bool | None = None
    # With that thread, keep it at most this many layers ahead of the device (0: unpaced). On the
    # H200 pacing at 4 layers made both the short streams and the long run slower
    # (bench/results/serve_gpu_24gib_b7512d8.json beside serve_gpu_24gib_unpaced.json), hence 0.
    tiered_lookahead_layers: int = 0
    # The share of the page pool that requests streaming from the host (lossless tiered runs)
    # may borrow, all together, for their whole-capacity resident slices and staging buffers:
    # one run of consecutive pages each (`kvtier.kv.pages.PagePool.take_run`), given back when
    # the request ends. 0: they live in the offload reserve only.
    tiered_share: float = 0.25
    # ... but only beyond what max_num_seqs sequences of this many tokens would hold: the batch
    # keeps that much of the pool (at 24 GiB, Llama-3-8B's 42K-token pool is all kept, so a
    # tiered run there borrows nothing; on a whole H200 it may borrow up to the share). A
    # request that fits neither the offload reserve nor that (HiP's decode memory at 24 GiB)
    # may borrow the free pages the keep withheld, up to the share (`plan_store`).
    tiered_keep_tokens: int = 2048
    # Free the allocator's unused cached blocks once a tiered run's prefill ends (on CUDA), so
    # the batch's next allocations do not run into the budget's cap (a retry: a device-wide sync
    # behind the run's queued work). Off until the H200 says it helps (pending_h200.sh 18).
    tiered_release_after_prefill: bool = False
    # Prefill chunks on cuDNN's attention where the device prefers it (Hopper; see
    # `kvtier.attention.dense`): only for an engine no tiered request shares (`LLM.generate`'s).
    # A server keeps flash: cuDNN's per-shape module loads waited behind tiered runs' copies.
    prefill_cudnn: bool = False

    def __post_init__(self) -> None:
        if self.tiered_keep_tokens < 0:
            raise ConfigError(f"tiered_keep_tokens must be >= 0, got {self.tiered_keep_tokens}")
        if not 0.0 <= self.tiered_share <= 1.0:
            raise ConfigError(f"--tiered-share must be between 0 and 1, got {self.tiered_share}")
        if self.tiered_lookahead_layers < 0:
            raise ConfigError(f"tiered_lookahead_layers must be >= 0, got {self.tiered_lookahead_layers}")
        if self.decode_steps < 1:
            raise ConfigError(f"--decode-steps must be at least 1, got {self.decode_steps}")
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be at least 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"--num-pages must be at least 1, got {self.num_pages}")
        if self.num_host_pages is not None and self.num_host_pages < 0:
            raise ConfigError(f"--num-host-pages must not be negative, got {self.num_host_pages}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)  # validates
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {self.threads}")
        if self.offload_reserve is not None and self.offload_reserve < 0:
            raise ConfigError(f"--offload-reserve must not be negative, got {self.offload_reserve}")
