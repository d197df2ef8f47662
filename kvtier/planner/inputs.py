"""`PlanInputs`: what a placement is planned for (the model, the context, the machine, the
budgets and the asked placement), and its store plan (`plan_kv`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import ModelConfig
from kvtier.planner.compact import CompactSlices
from kvtier.planner.hardware import Hardware
from kvtier.planner.packed import PackedFormat
from kvtier.planner.placement import KVPlan, plan_kv


@dataclass(frozen=True)
class PlanInputs:
    """What a placement is planned for: the model, the context, the machine and the budgets."""

    cfg: ModelConfig
    context: int
    hardware: Hardware
    dtype_bytes: int
    gpu_budget: int | None  # None: unlimited (the CPU)
    host_budget: int | None = None  # None: unchecked
    kv: str = "auto"  # the placement policy (`--kv`)
    head_group: int | None = None  # KV heads per slice (None: the policy's choice)
    chunk_size: int | None = None  # prefill chunk (None: the roofline's)
    block_size: int = 256
    cpu_attention: str | int = "off"  # streamed slices decoded on the CPU: auto, off or a count
    activations: str = "runner"  # whose forward runs the chunks: "runner" (kvtier's) or "hf"
    compact: CompactSlices | None = None  # slices an evictor keeps small on the GPU (not placed)
    # Whether the store's staging buffers go back to the caching allocator while a kernel that
    # never streams in decode runs (`kvtier.kv.staged_attend.StagedSlices.idle_in_decode`): not
    # when they are carved from a server's lent pages.
    staging_freed_in_decode: bool = True
    # Tokens decode appends after the prompt (the request's max_tokens; None: unknown, so up to
    # the whole context): what an evictor that never evicts in decode (SnapKV) keeps on top.
    new_tokens: int | None = None

    def plan(self, codec: PackedFormat | None = None, unpack_scratches: int | None = None) -> KVPlan:
        """The store's plan for these inputs; `codec`: a quantized cache, sized packed;
        `unpack_scratches` as `plan_kv`'s (None: chosen by its link model)."""
        return plan_kv(
            self.cfg,
            self.context,
            policy=self.kv,
            gpu_budget=self.gpu_budget,
            dtype_bytes=self.dtype_bytes,
            host_budget=self.host_budget,
            chunk_size=self.chunk_size,
            group_size=self.head_group,
            hardware=self.hardware,
            block_size=self.block_size,
            codec=codec,
            cpu_attention=self.cpu_attention,
            activations=self.activations,
            compact=self.compact,
            unpack_scratches=unpack_scratches,
        )
