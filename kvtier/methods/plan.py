"""`plan_for`: the one planning entry point. The engine, the server, `kvtier plan` and the bench
scripts call it; a method with its own planner (HiP) is a hook here, not a second planner."""

from __future__ import annotations

from kvtier.methods.choice import MethodChoice
from kvtier.methods.registry import Placement, PlanInputs
from kvtier.planner.placement import KVPlan, plan_kv

LOSSLESS = MethodChoice()


def plan_for(inputs: PlanInputs, method: MethodChoice = LOSSLESS) -> Placement:
    """The placement of `inputs.context` tokens under `method` (default: lossless).

    A quantized method's cache is planned packed (its codec sizes resident and streamed slices);
    a method with a `plan` hook plans through it, with the store planner as a callback. Raises
    `CapacityError` (or `HostCapacityError`) when the context fits nowhere.
    """
    codec = method.codec()

    def plan_with(group: int | None, gpu: int | None, chunk: int | None = None) -> KVPlan:
        return plan_kv(
            inputs.cfg,
            inputs.context,
            policy=inputs.kv,
            gpu_budget=gpu,
            dtype_bytes=inputs.dtype_bytes,
            chunk_size=chunk or inputs.chunk_size,
            group_size=group or inputs.head_group,
            block_size=inputs.block_size,
            hardware=inputs.hardware,
            host_budget=inputs.host_budget,
            codec=codec,
        )

    entry = method.entry
    if entry is not None and entry.plan is not None:
        return entry.plan(inputs, method.options(), plan_with)
    return Placement(plan_with(None, inputs.gpu_budget))
