"""`MethodChoice`: how one request runs over the store: its placement (`--kv`, `--head-group`)
and at most one opt-in method (lossless when none is chosen).

The fields are the user-facing options (the CLI flags and `LLM(...)` keywords of the same
names); `selected` resolves them against the registry, and `build` makes the store parts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.hooks import KVCodec
from kvtier.methods.registry import FAMILIES, OPTIONS, REGISTRY, BuildContext, MethodEntry, lookup, names
from kvtier.model.llama import CausalLM
from kvtier.planner.placement import POLICIES
from kvtier.policies import PolicyParts
from kvtier.policies.head_sparsity import DEFAULT_CACHE


@dataclass(frozen=True)
class MethodChoice:
    """A request's method options; the default is lossless dense attention over the full KV,
    placed by the planner (`kv="auto"`)."""

    kv: str = "auto"
    head_group: int | None = None
    attention: str = "dense"
    hip_preset: str = "auto"  # `kvtier.sparse.resolve_preset` picks one per request
    hip_refresh: str | None = None  # a REFRESH_PRESETS name (None: the preset's intervals)
    hip_host_keys: bool | None = None  # stage-0 reruns on host keys (`HipConfig.host_scoring`)
    hip_probes: bool | None = None  # stage 0 scores the bisection's probes (`HipConfig.probe_scoring`)
    hip_strides: str | None = None  # queries pooled per score a stage, "4/4/2" (None: the preset's)
    hip_align_window: bool | None = None  # the window at a stage-0 chunk (`HipConfig.align_window`)
    hip_exact: int | None = (
        None  # prefill stages of chunks up to N tokens on every key (`HipConfig.exact_chunk`)
    )
    hip_stage0: int | None = None  # prefill queries sharing stage 0 (`HipConfig.stage0_block_q`)
    # prefill stage 0 on landmark keys (`HipConfig.stage0_landmarks`); "all": the prompt's last
    # token's too (`prompt_landmarks`)
    hip_landmarks: bool | str | None = None
    kv_quant: str | None = None
    evict: str | None = None
    kv_budget: int | None = None
    head_sparsity: float | None = None
    quest_page: int = 16

    def __post_init__(self) -> None:
        if self.kv not in POLICIES:
            raise ConfigError(f"unknown --kv policy {self.kv!r}; choose one of {', '.join(POLICIES)}")
        if self.head_group is not None and self.kv not in ("head", "auto"):
            raise ConfigError(f"--head-group applies to --kv head (or auto), not --kv {self.kv}")
        if self.head_group is not None and self.head_group < 1:
            raise ConfigError(f"--head-group must be at least 1, got {self.head_group}")
        chosen = self.selected()  # raises on unknown names
        if len(chosen) > 1 and not _composable(chosen):
            flags = [self._flag(e) for e in chosen]
            pairs = [
                f"{self._flag(e)} with {FAMILIES[f].flag}" for e in REGISTRY.values() for f in e.composes_with
            ]
            also = f" (what combines: {', '.join(pairs)})" if pairs else ""
            raise ConfigError(f"{' and '.join(flags)} cannot be combined yet: choose one method{also}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ConfigError(f"--kv-budget must be a positive number of tokens, got {self.kv_budget}")
        if self.hip_refresh is not None:
            OPTIONS["hip_refresh"].parse(self.hip_refresh)  # raises on an unknown name
        if self.hip_strides is not None:
            OPTIONS["hip_strides"].parse(self.hip_strides)  # raises on a malformed list
        if self.head_sparsity is not None and not 0.0 < self.head_sparsity < 1.0:
            raise ConfigError(f"--head-sparsity must be in (0, 1), got {self.head_sparsity}")
        entry = self.entry
        # HiP's options but its preset (whose "auto" default is never None)
        hip_keys = tuple(k for k in REGISTRY["hip"].takes if k != "hip_preset")
        for key in ("kv_budget", *hip_keys):
            if getattr(self, key) is not None and (entry is None or key not in entry.takes):
                takers = [self._flag(e) for e in REGISTRY.values() if key in e.takes]
                raise ConfigError(f"{OPTIONS[key].flag} applies only with {', '.join(takers)}")
        if entry is not None:
            missing = [k for k in entry.requires if getattr(self, k) is None]
            if missing:
                need = " ".join(f"{OPTIONS[k].flag} {entry.examples.get(k, 'N')}" for k in missing)
                raise ConfigError(f"{self._flag(entry)} needs {need} ({OPTIONS[missing[0]].help})")

    def selected(self) -> list[MethodEntry]:
        """The registry entries these options select (at most one is valid)."""
        out = []
        for family in FAMILIES.values():
            value = getattr(self, family.key)
            if value is None or value == family.none:
                continue
            if family.key == "head_sparsity":  # selected by a ratio, not a name
                out += [REGISTRY[n] for n in names("head_sparsity")]
            else:
                out.append(lookup(family.key, str(value)))
        return out

    @property
    def lossless(self) -> bool:
        """No opt-in method: every placement gives the same tokens."""
        return not self.selected()

    @property
    def extends_context(self) -> bool:
        """Whether the method lets the model run past its trained length (HiP)."""
        return self.attention == "hip"

    @property
    def entry(self) -> MethodEntry | None:
        """The method that runs the request: the one chosen, or of a composed pair the one whose
        parts the other plugs into (HiP, beside a codec)."""
        chosen = self.selected()
        return _primary(chosen) if chosen else None

    def codec(self) -> KVCodec | None:
        """The packed KV format the planner sizes the cache with (quantized methods only)."""
        made = [e.codec() for e in self.selected() if e.codec is not None]
        return made[0] if made else None

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def exact_at(self, cfg: ModelConfig, context: int) -> bool:
        """Whether a request of `context` tokens (prompt plus output) under this lossy choice
        loses nothing: every method it selects keeps and attends every key at that length
        (`MethodEntry.exact_at`; HiP below its budgets), so it may run as `lossless_twin`, on the
        faster lossless paths, with the same attention up to rounding. False when lossless."""
        chosen, options = self.selected(), self.options()
        exact = [e.exact_at is not None and e.exact_at(options, cfg, context) for e in chosen]
        return bool(exact) and all(exact)

    @property
    def lossless_twin(self) -> MethodChoice:
        """This choice's placement (`kv`, `head_group`) with no method: lossless."""
        return MethodChoice(kv=self.kv, head_group=self.head_group)

    def build(
        self,
        cfg: ModelConfig,
        device: torch.device,
        model: CausalLM | None,
        hip_cache_tokens: int | None = None,
        head_cache: Path | None = DEFAULT_CACHE,
        context: int | None = None,
        hip_prune_bytes: int | None = None,
    ) -> PolicyParts:
        """Fresh store parts for one request (`hip_cache_tokens`: HiP's block cache per
        offloaded slice, None: the preset's; `context`: its prompt plus output, which HiP's
        `auto` preset is chosen by, as `plan_for` chose it; `hip_prune_bytes`: the plan's
        `Placement.prune_bytes`); raises ConfigError on a budget the model rejects."""
        chosen = self.selected()
        if not chosen:
            return PolicyParts()
        ctx = BuildContext(
            cfg, device, model, self.options(), hip_cache_tokens, head_cache, context, hip_prune_bytes
        )
        primary = _primary(chosen)
        parts = primary.build(ctx)
        for other in (e for e in chosen if e is not primary):  # a codec beside HiP
            extra = other.build(ctx)
            parts = replace(parts, codec=extra.codec, describe=f"{parts.describe} + {extra.describe}")
        return parts

    def _flag(self, entry: MethodEntry) -> str:
        family = FAMILIES[entry.family]
        return family.flag if family.key == "head_sparsity" else f"{family.flag} {entry.name}"


def _composable(chosen: list[MethodEntry]) -> bool:
    """Two methods, one of which composes with the other's family (HiP with a KV codec)."""
    if len(chosen) != 2:
        return False
    a, b = chosen
    return b.family in a.composes_with or a.family in b.composes_with


def _primary(chosen: list[MethodEntry]) -> MethodEntry:
    """Of a composed pair, the method that takes the other (`composes_with`); else the one."""
    return next((e for e in chosen if any(o.family in e.composes_with for o in chosen)), chosen[0])


def build_policy(
    cfg: ModelConfig,
    *,
    device: torch.device,
    model: CausalLM | None = None,
    head_cache: Path | None = DEFAULT_CACHE,
    context: int | None = None,
    **options: Any,
) -> PolicyParts:
    """Store parts for method options given as keywords (`MethodChoice`'s fields; None = unset),
    for tests and bench scripts that build a store without an `LLM` (`context`: as `build`)."""
    given = {k: v for k, v in options.items() if v is not None}
    return MethodChoice(**given).build(cfg, device, model, head_cache=head_cache, context=context)
