"""`--attention quest`: Quest's query-aware page selection (`kvtier.policies.quest`)."""

from __future__ import annotations

from kvtier.methods.registry import BuildContext, MethodEntry, Option, register
from kvtier.policies import PolicyParts
from kvtier.policies.quest import QuestKernel
from kvtier.units import parse_count

QUEST_PAGE = Option(
    "quest_page",
    "--quest-page",
    lambda s: parse_count(s, "--quest-page"),
    "tokens per Quest page (16, the paper's; 4 found the pass key on SmolLM2 where 16 did not)",
)


def _build(ctx: BuildContext) -> PolicyParts:
    budget, page = int(ctx.options["kv_budget"]), int(ctx.options["quest_page"])
    return PolicyParts(kernel=QuestKernel(budget, page=page), describe=f"quest budget {budget} page {page}")


QUEST = register(
    MethodEntry(
        "quest",
        "attention",
        "Quest: per-page key bounds pick the pages a decode step reads (needs --kv-budget)",
        _build,
        takes=("kv_budget", "quest_page"),
        requires=("kv_budget",),
        examples={"kv_budget": "1k"},
    ),
    QUEST_PAGE,
)
