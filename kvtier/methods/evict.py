"""`--evict window|streaming|h2o|snapkv --kv-budget N`: token eviction (`kvtier.policies.evict`)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.methods.registry import BuildContext, MethodEntry, register
from kvtier.policies import PolicyParts
from kvtier.policies.evict import H2OEvictor, SnapKVEvictor, WindowEvictor
from kvtier.policies.scoring import CacheRopeKernel, ScoringKernel

STREAMING_SINKS = 4  # StreamingLLM's attention sinks


def evictor_entry(name: str, help: str, parts: Callable[[BuildContext, int], PolicyParts]) -> MethodEntry:
    """The registry entry of an evictor: `parts(ctx, budget)` builds it for one request."""

    def build(ctx: BuildContext) -> PolicyParts:
        budget = int(ctx.options["kv_budget"])
        built = parts(ctx, budget)
        return PolicyParts(
            kernel=built.kernel,
            rotate_keys=built.rotate_keys,
            codec=built.codec,
            evictor=built.evictor,
            describe=f"evict {name} budget {budget}",
        )

    return MethodEntry(
        name,
        "evict",
        help,
        build,
        takes=("kv_budget",),
        requires=("kv_budget",),
        examples={"kv_budget": "1k"},
    )


def _scored(scorer: H2OEvictor | SnapKVEvictor) -> PolicyParts:
    return PolicyParts(kernel=ScoringKernel(scorer), evictor=scorer)


STREAMING = register(
    evictor_entry(
        WindowEvictor.STREAMING,
        "StreamingLLM: 4 attention sinks + the most recent tokens (RoPE at cache positions)",
        lambda ctx, b: PolicyParts(
            kernel=CacheRopeKernel(ctx.cfg, ctx.device),
            rotate_keys=False,
            evictor=WindowEvictor(b, sinks=STREAMING_SINKS),
        ),
    ),
)
H2O = register(
    evictor_entry(
        H2OEvictor.name,
        "H2O: heavy hitters by accumulated attention + recent",
        lambda _, b: _scored(H2OEvictor(b)),
    )
)
SNAPKV = register(
    evictor_entry(
        SnapKVEvictor.name,
        "SnapKV: prompt-window votes + recent",
        lambda _, b: _scored(SnapKVEvictor(b)),
    )
)
WINDOW = register(
    evictor_entry(
        WindowEvictor.WINDOW,
        "sliding window: the last N tokens",
        lambda _, b: PolicyParts(evictor=WindowEvictor(b)),
    )
)
