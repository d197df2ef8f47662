"""How many KV pages the server's pool gets, and the checks that keep a given count in budget.

The pool is what the memory budget leaves after everything else the process needs at once:

    budget       --gpu-memory, else the GPU's total memory (never more than is free on it now
                 plus what this process holds); on the CPU: host memory available now
  - used         bytes already allocated: the weights (torch.cuda.memory_allocated); 0 on the
                 CPU, where the loaded weights are already out of the host memory available
  - activation   one batch step of max_num_batched_tokens through the model (the planner's
                 estimate) with the logits of up to max_num_seqs sequences
  - context      (GPU only) what the process holds outside PyTorch's allocator, measured at start:
                 the CUDA context and the libraries' handles (at most CONTEXT_MAX; more is taken
                 to be another process's)
  - reserve      cuBLAS workspaces, kernels loaded later, allocator slack (GPU_RESERVE_BYTES); 0 on
                 the CPU
  - offload      (GPU only) room kept for requests over stores of their own while the batch steps:
                 a tiered run's buffers and activations, a method's store (`--offload-reserve`,
                 default a quarter of what is left, at most OFFLOAD_RESERVE_MAX)
  = room         -> room // (bytes_per_page * (1 + gather)) pages; fewer than MIN_PAGES is a
                 CapacityError

`gather` (GPU only, 1 / num_layers): a decode step's attention gathers the batch's KV of one
layer into a dense tensor, up to one layer's share of the whole pool, and frees it before the
next layer. Without it a full pool ran past the budget on the H200 (25.94 GB against 24 GiB with
the CUDA context, `bench/results/gpu_smoke_llama8b.json`). Padding to the longest sequence can
still exceed it; an out-of-memory there fails the step's requests with an error, not the server.

The allocator itself is capped at the whole budget, so without the context term a pool that
filled the room let the caching allocator reach its cap with the context on top: 26.37 GB under
nvidia-smi against `--gpu-memory 24GiB` (25.77 GB), 0.6 GB over.

A request longer than the pool is a tiered run with offload (`kvtier.serve.tiered`), beside the
batch, planned within the same budget minus the pool and minus what a batch step may allocate at
the same time (its activations and gather: `offload_gpu_budget`), plus the pool pages it may
borrow (`BatchConfig.tiered_share`): a lossless run's resident slices and staging buffers are then
a run of the pool's pages, and only its activations (and a method's caches) use the offload
term. Without the batch-step term a tiered run beside the batch took the server to 26.37 GB
against 24 GiB on the H200 (`bench/results/gpu_smoke_llama8b_serve.json`, 2026-12-01).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvtier.config import ModelConfig
from kvtier.errors import CapacityError, ConfigError
from kvtier.planner.hardware import host_memory_available
from kvtier.planner.memory import GPU_RESERVE_BYTES, activation_bytes
from kvtier.units import format_bytes

MIN_PAGES = 16  # a smaller pool cannot hold one page per sequence of a useful batch
OFFLOAD_RESERVE_MAX = 4 * 1024**3  # the default offload term's ceiling (a quarter of the room below it)
CONTEXT_MAX = 1024**3  # the most a process's CUDA context and library handles are taken to hold
CPU_DEFAULT_PAGES = 1024  # the default pool on the CPU, when host memory allows it


def step_activation_bytes(
    cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int
) -> int:
    """Peak activation bytes of one batch step: a prefill chunk of `max_num_batched_tokens`
    tokens (`kvtier.planner.memory.activation_bytes`) plus the logits rows of the other sequences
    that sample in the same step ([N, vocab] in the dtype and in fp32, N <= max_num_seqs)."""
    rows = min(max_num_seqs, max_num_batched_tokens)
    return activation_bytes(cfg, max_num_batched_tokens, dtype_bytes) + (rows - 1) * cfg.vocab_size * (
        dtype_bytes + 4
    )


@dataclass(frozen=True)
class PoolBudget:
    """The memory a page pool is sized within (see the module docstring); bytes throughout.

    `label` names the budget for messages ("--gpu-memory", "the GPU's memory", "host memory available").
    """

    where: str  # "GPU" or "host": where the pool lives
    label: str
    budget: int
    used: int
    activation: int
    reserve: int
    max_num_batched_tokens: int
    used_by: str = "weights"  # what `used` is, for messages
    gather: float = 0.0  # extra bytes per page byte: one layer's gather of the pool (see the module)
    offload: int = 0  # kept for requests over stores of their own (see the module)
    context: int = 0  # held outside the allocator: the CUDA context, library handles (see the module)

    def __post_init__(self) -> None:
        terms = (self.budget, self.used, self.activation, self.reserve, self.offload, self.context)
        if min(terms) < 0:
            raise ConfigError(f"pool budget terms must not be negative: {self}")

    @property
    def room(self) -> int:
        """Bytes left for the pool (0 when the other terms already exceed the budget)."""
        return max(0, self.budget - sum(n for n, _, _ in self._others()))

    def with_default_offload(self) -> PoolBudget:
        """This budget with the default offload term: a quarter of the room, at most
        OFFLOAD_RESERVE_MAX."""
        return replace(self, offload=min(OFFLOAD_RESERVE_MAX, self.room // 4))

    def fitting(self, bytes_per_page: int) -> int:
        """Pages of `bytes_per_page` bytes that fit the room."""
        return self.room // self.page_cost(bytes_per_page)

    def page_cost(self, bytes_per_page: int) -> int:
        """Bytes of budget one page takes: the page and its share of a step's gather."""
        return int(bytes_per_page * (1.0 + self.gather))

    def default_pages(self, bytes_per_page: int, cap: int | None = None) -> int:
        """All the pages that fit the room (at most `cap`). CapacityError below MIN_PAGES."""
        pages = self.fitting(bytes_per_page)
        if pages < MIN_PAGES:
            least = format_bytes(MIN_PAGES * bytes_per_page)
            raise CapacityError(
                f"no room for the KV page pool on the {self.where}: {self._terms()} leaves "
                f"{format_bytes(self.room)}, under the {MIN_PAGES} pages ({least}) a pool needs. "
                + self._advice()
            )
        return pages if cap is None else min(pages, cap)

    def check(self, num_pages: int, bytes_per_page: int, flag: str = "--num-pages") -> None:
        """Raise CapacityError if `num_pages` pages (given as `flag`) do not fit the room."""
        need = num_pages * self.page_cost(bytes_per_page)
        if need > self.room:
            raise CapacityError(
                f"{flag} {num_pages} needs {format_bytes(need)} on the {self.where} "
                f"({format_bytes(bytes_per_page)} a page), but {self._terms()} leaves "
                f"{format_bytes(self.room)}: at most {self.fitting(bytes_per_page)} pages fit. "
                f"Lower {flag} (or leave it out to size it from memory). {self._advice()}"
            )

    def describe(self, pool_bytes: int) -> str:
        """Where the budget goes once a pool of `pool_bytes` is allocated, for the startup line:
        "--gpu-memory (24.00 GiB) = 14.96 GiB weights + 6.10 GiB KV pool + ..."."""
        (used, _, used_short), *rest = self._others()
        gather = int(pool_bytes * self.gather)
        parts = [used_short.format(format_bytes(used)), f"{format_bytes(pool_bytes)} KV pool"]
        if gather:
            parts.append(f"{format_bytes(gather)} decode gather")
        parts += [short.format(format_bytes(n)) for n, _, short in rest if n]
        spare = self.budget - sum(n for n, _, _ in self._others()) - pool_bytes - gather
        if spare > 0:
            parts.append(f"{format_bytes(spare)} unused")
        return f"{self.label} ({format_bytes(self.budget)}) = " + " + ".join(parts)

    def _others(self) -> list[tuple[int, str, str]]:
        """The terms besides the pool: (bytes, how messages name them, how the startup line does)."""
        return [
            (self.used, f"{{}} in use ({self.used_by})", f"{{}} {self.used_by}"),
            (
                self.activation,
                f"{{}} of activations for a {self.max_num_batched_tokens}-token step",
                "{} step activations",
            ),
            (self.context, "{} of CUDA context", "{} CUDA context"),
            (self.reserve, "a {} reserve", "{} reserve"),
            (self.offload, "{} kept for offloaded requests (--offload-reserve)", "{} for offloaded requests"),
        ]

    def _terms(self) -> str:
        terms = [long.format(format_bytes(n)) for n, long, _ in self._others() if n]
        return " - ".join([f"{self.label} ({format_bytes(self.budget)})", *terms])

    def _advice(self) -> str:
        if self.where == "GPU":
            return (
                "Raise --gpu-memory, lower --max-num-batched-tokens, or use a smaller model or "
                "--dtype; longer requests than the pool run with offload"
            )
        return "Free host memory, or lower --max-num-batched-tokens"


def measure_pool_budget(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    gpu_budget: int | None,
    gpu_budget_given: bool,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    offload_reserve: int = 0,
) -> PoolBudget | None:
    """The budget of a pool on `device`, measured now (after the weights are loaded).

    `gpu_budget` is `LLM.gpu_budget()` (--gpu-memory, else the GPU's total memory);
    `gpu_budget_given` says whether it came from --gpu-memory (for messages); `offload_reserve`
    is the GPU's offload term (`PoolBudget.with_default_offload` sizes a default). None on a CPU whose
    available memory is unknown (not Linux): nothing to check against.
    """
    itemsize = dtype.itemsize
    activation = step_activation_bytes(cfg, max_num_batched_tokens, max_num_seqs, itemsize)
    if device.type == "cuda":
        assert gpu_budget is not None
        free, total = torch.cuda.mem_get_info(device)
        used = int(torch.cuda.memory_allocated(device))
        label = "--gpu-memory" if gpu_budget_given else "the GPU's memory"
        if used + free < gpu_budget:  # another process holds part of the GPU
            gpu_budget, label = used + free, "the GPU memory free now plus this process's"
        return PoolBudget(
            "GPU",
            label,
            gpu_budget,
            used,
            activation,
            GPU_RESERVE_BYTES,
            max_num_batched_tokens,
            gather=1.0 / cfg.num_layers,
            offload=offload_reserve,
            context=outside_allocator_bytes(device, free, total),
        )
    available = host_memory_available()
    if available is None:
        return None
    return PoolBudget("host", "host memory available", available, 0, activation, 0, max_num_batched_tokens)


def outside_allocator_bytes(device: torch.device, free: int, total: int) -> int:
    """What this process holds on `device` outside PyTorch's allocator, from `mem_get_info`'s
    (free, total): used memory minus the allocator's reserved bytes, at most CONTEXT_MAX."""
    outside = total - free - int(torch.cuda.memory_reserved(device))
    return max(0, min(outside, CONTEXT_MAX))


def offload_gpu_budget(
    budget: int, allocated: int, free: int, pool_bytes: int, batch_bytes: int = 0, held: int = 0
) -> int:
    """The `gpu_budget` to plan an offloaded request with: the GPU budget (`LLM.gpu_budget()`,
    capped by what this process holds plus what is free on the GPU now) minus the page pool,
    which stays allocated while the request runs, minus `batch_bytes`, what a batch step
    allocates beside it (its activations and one layer's gather of the pool), and minus `held`,
    what other requests' stores hold outside the pool now (running or still being freed). The
    planner takes weights, the request's own activations and its reserve off this itself."""
    return max(0, min(budget, allocated + free) - pool_bytes - batch_bytes - held)
