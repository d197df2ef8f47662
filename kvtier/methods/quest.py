"""`--attention quest`: Quest's query-aware page selection (`kvtier.policies.quest`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.errors import CapacityError
from kvtier.methods.registry import (
    BuildContext,
    MethodEntry,
    Option,
    Placement,
    PlanWith,
    register,
    within_budget,
)
from kvtier.planner.inputs import PlanInputs
from kvtier.policies import PolicyParts
from kvtier.policies.quest import QuestKernel, bounded_slices, bounds_slice_bytes, quest_gpu_bytes
from kvtier.units import format_bytes, parse_count

QUEST_PAGE = Option(
    "quest_page",
    "--quest-page",
    lambda s: parse_count(s, "--quest-page"),
    "tokens per Quest page (16, the paper's; 4 found the pass key on SmolLM2 where 16 did not)",
)


def _build(ctx: BuildContext) -> PolicyParts:
    budget, page = int(ctx.options["kv_budget"]), int(ctx.options["quest_page"])
    kernel = QuestKernel(budget, page=page, capacity=ctx.context)
    return PolicyParts(kernel=kernel, describe=f"quest budget {budget} page {page}")


def _plan(inputs: PlanInputs, options: Mapping[str, Any], plan_with: PlanWith) -> Placement:
    """The store's plan within the GPU budget less Quest's page bounds, which stay on the GPU
    for every slice (they select the pages a decode step gathers from the host): one buffer a
    slice past the dense layers, which the kernel takes from a server's lent pages
    (`QuestKernel.place_caches`) and so lists as `method_buffers`."""
    page = int(options["quest_page"])
    bounds = quest_gpu_bytes(inputs.cfg, inputs.context, page, inputs.dtype_bytes)
    budget = inputs.gpu_budget
    if budget is not None and bounds >= budget:
        raise CapacityError(
            f"--attention quest keeps {format_bytes(bounds)} of page bounds on the GPU at "
            f"{inputs.context:,} tokens with pages of {page}, over --gpu-memory "
            f"{format_bytes(budget)}: use a larger --quest-page, a shorter context or more --gpu-memory"
        )
    plan = plan_with(None, None if budget is None else budget - bounds, None)
    group = plan.group_size
    buffers = (bounds_slice_bytes(inputs.cfg, inputs.context, page, group, inputs.dtype_bytes),)
    return Placement(plan, reserve_bytes=bounds, method_buffers=buffers * bounded_slices(inputs.cfg, group))


QUEST = register(
    MethodEntry(
        "quest",
        "attention",
        "Quest: per-page key bounds pick the pages a decode step reads (needs --kv-budget)",
        _build,
        takes=("kv_budget", "quest_page"),
        requires=("kv_budget",),
        examples={"kv_budget": "1k"},
        plan=_plan,
        borrows_pages=True,  # its page bounds are its method_buffers, in lent pages
        exact_at=within_budget,  # a context within the budget is dense (`QuestKernel`)
    ),
    QUEST_PAGE,
)
