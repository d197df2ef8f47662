"""The registry of opt-in KV methods: one `MethodEntry` per method, each in a file of its own.

A method belongs to a *family*, the request option that selects it: `--attention NAME`
(sparse attention kernels), `--kv-quant NAME` (KV codecs), `--evict NAME` (evictors) or
`--head-sparsity R` (streaming heads). The CLI's choices, eval's `--method` names, `kvtier plan`'s
lossy lines and the planner's sizing all come from here, so a new method is one new file that
calls `register` (see `kvtier.methods.quant` for a codec, `kvtier.methods.evict` for evictors).

Lossless placements (`--kv gpu|layer|head|auto`) are not entries: every method runs over each of
them (`kvtier.planner.placement.POLICIES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.hooks import KVCodec
from kvtier.model.llama import CausalLM
from kvtier.planner.inputs import PlanInputs
from kvtier.planner.placement import KVPlan
from kvtier.policies import PolicyParts
from kvtier.policies.head_sparsity import DEFAULT_CACHE
from kvtier.units import parse_count


@dataclass(frozen=True)
class Family:
    """A request option that selects one method of a family by its value."""

    key: str  # the `LLM(...)` keyword and `MethodChoice` field
    flag: str  # the CLI flag
    help: str
    none: str | None = None  # the value meaning "no method of this family" (None: unset)


FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        f.key: f
        for f in (
            Family("attention", "--attention", "sparse attention", none="dense"),
            Family("kv_quant", "--kv-quant", "quantized KV storage"),
            Family("evict", "--evict", "KV token eviction (needs --kv-budget)"),
            Family("head_sparsity", "--head-sparsity", "streaming heads (a ratio of KV heads)"),
        )
    }
)


@dataclass(frozen=True)
class Option:
    """A value a method takes besides its name (`--kv-budget 1k`, `kv_budget=1k` in eval)."""

    key: str
    flag: str
    parse: Callable[[str], Any]
    help: str


@dataclass(frozen=True)
class BuildContext:
    """What a method's parts are built from: the model and the request's option values."""

    cfg: ModelConfig
    device: torch.device
    model: CausalLM | None
    options: Mapping[str, Any]  # Option.key -> value (None: not given)
    hip_cache_tokens: int | None = None  # HiP's block cache per offloaded slice (None: preset's)
    head_cache: Path | None = DEFAULT_CACHE  # where head-sparsity scores are cached
    context: int | None = None  # the request's prompt plus output, tokens (None: not known)
    hip_prune_bytes: int | None = None  # HiP's prefill pruning batch (`Placement.prune_bytes`)


@dataclass(frozen=True)
class Placement:
    """A method's plan: the store plan and what the method keeps on the GPU besides it."""

    plan: KVPlan
    cache_tokens: int | None = None  # HiP: block cache per offloaded slice (None: a refresh interval)
    reserve_bytes: int = 0  # the method's GPU bytes taken off the budget before the store's plan
    # Of those, the buffers its kernel allocates in decode from the memory the store was given
    # (`kvtier.attention.interface.PlacesCaches`: HiP's block cache of each streamed slice, Quest's
    # page bounds of each slice past its dense layers), in
    # the order it asks for them, after the store's own (`kvtier.kv.device_memory.region_buffers`).
    method_buffers: tuple[int, ...] = ()
    # HiP: GPU bytes a prefill pruning batch may take (`HipConfig.prune_bytes`), when the plan
    # reserved more than the default for it (None: the default)
    prune_bytes: int | None = None


PlanWith = Callable[[int | None, int | None, int | None], KVPlan]
"""The store planner for these inputs: (head group, GPU budget, chunk) -> plan (None: default)."""

PlanHook = Callable[[PlanInputs, Mapping[str, Any], PlanWith], Placement]
"""A method's own planner (HiP's slicing and chunk search): inputs, option values, store planner."""

ExactHook = Callable[[Mapping[str, Any], ModelConfig, int], bool]
"""Whether a method keeps and attends every key of a request of this many tokens (prompt plus
output), so that it computes lossless attention up to rounding: option values, model, context."""


def within_budget(options: Mapping[str, Any], _: ModelConfig, context: int) -> bool:
    """`exact_at` of a method that keeps or reads `--kv-budget` tokens a head and every token
    until a context exceeds them (the evictors, Quest)."""
    return context <= int(options["kv_budget"])


@dataclass(frozen=True)
class MethodEntry:
    """One opt-in method: how a request selects it and how its store parts are built.

    `build` makes fresh parts for one request (they hold per-sequence state). `codec` is the
    packed format the planner sizes a quantized cache with; `plan` a method's own planner (used
    by `plan_for` instead of the store planner alone); `takes` the options it accepts and
    `requires` those it cannot run without; `composes_with` the families of methods a request
    may select beside it (HiP's kernel reads whatever the store holds, so a codec may pack it).
    `borrows_pages`: in the server its store's whole-capacity buffers may be a run of pool pages
    (`kvtier.serve.store_plan.plan_store`): the store takes from its `DeviceMemory` exactly what
    `kvtier.kv.device_memory.region_buffers` says, and whatever else the method keeps on the GPU
    is in its `Placement.reserve_bytes`. `exact_at`: when a request is short enough that the
    method drops nothing (HiP below its budgets), so it may run lossless instead
    (`MethodChoice.exact_at`); None: never.
    """

    name: str
    family: str
    help: str
    build: Callable[[BuildContext], PolicyParts]
    takes: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    codec: Callable[[], KVCodec] | None = None
    plan: PlanHook | None = None
    examples: Mapping[str, str] = field(default_factory=dict)  # option -> a value for messages
    composes_with: tuple[str, ...] = ()
    borrows_pages: bool = False
    exact_at: ExactHook | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(
                f"method {self.name!r}: unknown family {self.family!r}; use {', '.join(FAMILIES)}"
            )
        missing = set(self.requires) - set(self.takes)
        if missing:
            raise ConfigError(f"method {self.name!r} requires options it does not take: {sorted(missing)}")


REGISTRY: dict[str, MethodEntry] = {}
"""Every registered method by name; `register` adds one."""

KV_BUDGET = Option(
    "kv_budget",
    "--kv-budget",
    lambda s: parse_count(s, "--kv-budget"),
    "tokens kept (or read) per KV head",
)
"""The budget that evictors, Quest and streaming heads share."""

OPTIONS: dict[str, Option] = {KV_BUDGET.key: KV_BUDGET}
"""Every option a method takes, by key; `register` adds new ones."""


def register(entry: MethodEntry, *options: Option) -> MethodEntry:
    """Add a method (and any options it introduces). A name or option key is defined once."""
    if entry.name in REGISTRY or entry.name in reserved_names():
        raise ConfigError(f"a method named {entry.name!r} is already registered")
    for opt in options:
        if opt.key in OPTIONS and OPTIONS[opt.key] != opt:
            raise ConfigError(f"option {opt.key!r} is already registered differently")
        OPTIONS[opt.key] = opt
    unknown = [k for k in entry.takes if k not in OPTIONS and k != entry.family]
    if unknown:
        raise ConfigError(f"method {entry.name!r} takes unregistered options {unknown}")
    REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a method (tests that register toys clean up with this)."""
    REGISTRY.pop(name, None)


def reserved_names() -> frozenset[str]:
    """Values that are not methods: each family's "none" (e.g. `--attention dense`)."""
    return frozenset(f.none for f in FAMILIES.values() if f.none is not None)


def names(family: str) -> tuple[str, ...]:
    """The registered methods of a family, in registration order."""
    return tuple(e.name for e in REGISTRY.values() if e.family == family)


def choices(family: str) -> tuple[str, ...]:
    """What the family's option accepts: its "none" value first, then its methods."""
    none = FAMILIES[family].none
    return ((none,) if none is not None else ()) + names(family)


def lookup(family: str, name: str) -> MethodEntry:
    """The entry for `name` in `family`; ConfigError naming the valid ones otherwise."""
    entry = REGISTRY.get(name)
    if entry is None or entry.family != family:
        flag = FAMILIES[family].flag
        raise ConfigError(f"unknown {flag} {name!r}; use one of {', '.join(choices(family))}")
    return entry
