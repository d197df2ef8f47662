"""`plan_for`: the one planning entry point. The engine, the server, `kvtier plan` and the bench
scripts call it; a method with its own planner (HiP) is a hook here, not a second planner."""

from __future__ import annotations

from dataclasses import replace

from kvtier.errors import ConfigError
from kvtier.methods.choice import MethodChoice
from kvtier.methods.registry import Placement, PlanInputs
from kvtier.planner.placement import KVPlan

LOSSLESS = MethodChoice()


def plan_for(inputs: PlanInputs, method: MethodChoice = LOSSLESS) -> Placement:
    """The placement of `inputs.context` tokens under `method` (default: lossless).

    A quantized method's cache is planned packed (its codec sizes resident and streamed slices);
    a method with a `plan` hook plans through it, with the store planner as a callback. Raises
    `CapacityError` (or `HostCapacityError`) when the context fits nowhere.
    """
    codec = method.codec()
    quantized = method.entry is not None and method.entry.family == "kv_quant"
    if not method.lossless and not quantized:
        # NOTE: CPU attention is dense attention over the stored KV (full precision, or the
        # packed rows of a quantized cache): sparse and evicting methods stream.
        if isinstance(inputs.cpu_attention, int) and inputs.cpu_attention > 0:
            raise ConfigError("--cpu-attention N applies to lossless or quantized KV only: use auto or off")
        inputs = replace(inputs, cpu_attention="off")

    entry = method.entry
    hook = None if entry is None else entry.plan
    # NOTE: the store planner's choice of unpacking packed loads on a stream of their own weighs a
    # decode that streams every slice each token; a method with its own planner (HiP's cached
    # decode streams rarely) keeps one scratch.
    scratches = None if hook is None else 1

    def plan_with(group: int | None, gpu: int | None, chunk: int | None = None) -> KVPlan:
        group, chunk = group or inputs.head_group, chunk or inputs.chunk_size
        return replace(inputs, head_group=group, gpu_budget=gpu, chunk_size=chunk).plan(codec, scratches)

    if hook is not None:
        return hook(inputs, method.options(), plan_with)
    return Placement(plan_with(None, inputs.gpu_budget))
