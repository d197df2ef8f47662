"""Engine options (frozen, validated) and their resolution against the machine.

What a request runs with over the store (placement and method) is a `kvtier.methods.MethodChoice`;
these are the options of the loaded engine itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.methods import MethodChoice, method_spec
from kvtier.planner.cpu_split import parse_mode
from kvtier.planner.memory import EXPERT_PLACES
from kvtier.units import parse_size

# How a prompt of several chunks is prefilled (`kvtier.engine.runner.prefill`): "chunk", each
# chunk through every layer; "layer", the chunks through each layer in turn where the store
# streams slices it can hold a layer of (`kvtier.engine.layer_prefill`: no stored prefix is
# loaded again for each chunk).
PREFILL_ORDERS = ("chunk", "layer")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    """How to run: device, dtype, budgets and granularity. Sizes are in bytes."""

    device: str = "auto"
    dtype: str = "auto"
    gpu_memory: int | None = None
    chunk_size: int | None = None
    block_size: int = 256
    max_model_len: int | None = None
    seed: int = 0
    cpu_attention: str | int = "off"  # streamed slices decoded on the CPU (kvtier.planner.cpu_split)
    fuse_projections: bool = True  # q/k/v and gate/up as one matmul each (kvtier.model.fuse)
    experts: str = "auto"  # a MoE model's routed experts: auto, gpu or host (planner.memory.place_experts)
    # One prompt under a lossless method and kv="auto" runs through the batch engine (a page
    # pool of its size; decode steps replayed as CUDA graphs) when its KV fits the device, as a
    # list of prompts does; None: on CUDA, where the graphs take the host out of each step.
    single_batched: bool | None = None
    # A lossy request short enough that its method drops nothing (HiP below its budgets:
    # `MethodChoice.exact_at`) runs lossless instead, on those faster paths, and says so in its
    # stats; None: on CUDA. (On the CPU the tests and evals run HiP's own path at short lengths.)
    exact_lossless: bool | None = None
    prefill_order: str = "chunk"  # PREFILL_ORDERS

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(_DTYPES)}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError(f"--chunk-size must be at least 1, got {self.chunk_size}")
        if self.block_size < 1:
            raise ConfigError(f"block size must be at least 1, got {self.block_size}")
        object.__setattr__(self, "cpu_attention", parse_mode(self.cpu_attention))
        if self.prefill_order not in PREFILL_ORDERS:
            raise ConfigError(
                f"--prefill-order {self.prefill_order!r}: use one of {', '.join(PREFILL_ORDERS)}"
            )
        if self.experts not in EXPERT_PLACES:
            raise ConfigError(f"--experts {self.experts!r}: use one of {', '.join(EXPERT_PLACES)}")

    @staticmethod
    def with_sizes(gpu_memory: str | int | None = None, **kw: object) -> EngineConfig:
        """Build from user-facing values (sizes like "24GiB")."""
        gm = None if gpu_memory is None else parse_size(gpu_memory, "--gpu-memory")
        return EngineConfig(gpu_memory=gm, **kw)  # type: ignore[arg-type]

    def torch_device(self) -> torch.device:
        """The device to run on, with an index for CUDA (`cuda` and `auto` mean the current GPU).

        NOTE: the index matters: `torch.cuda.set_per_process_memory_fraction` and friends reject
        `torch.device("cuda")`, so a plain "cuda" is resolved here, once, for every caller."""
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        spec = auto if self.device == "auto" else self.device
        try:
            dev = torch.device(spec)
        except RuntimeError:
            raise ConfigError(f"--device {self.device!r} is not a device; use cpu, cuda or cuda:N") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda was asked for, but no CUDA GPU is available; use cpu")
            count = torch.cuda.device_count()
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if not 0 <= index < count:
                raise ConfigError(
                    f"--device {self.device!r}: this machine has {count} GPU(s), cuda:0..{count - 1}"
                )
            dev = torch.device("cuda", index)
        elif dev.type != "cpu":
            raise ConfigError(f"--device {self.device!r} is not supported; use cpu, cuda or cuda:N")
        return dev

    def exact_note(
        self, method: MethodChoice, cfg: ModelConfig, device: torch.device, context: int
    ) -> str | None:
        """Why a request of `context` tokens (prompt plus output) of model `cfg` on `device` runs
        lossless under `method` (`exact_lossless`, None: on CUDA; its method drops nothing at that
        length), else None."""
        on = device.type == "cuda" if self.exact_lossless is None else self.exact_lossless
        if not on or method.lossless or not method.exact_at(cfg, context):
            return None
        return f"{method_spec(method)} drops nothing at {context} tokens (prompt plus output)"

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
