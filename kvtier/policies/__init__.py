"""Lossy KV policies over the tiered store: quantization, eviction, Quest and head-wise sparsity.

`build_policy` turns the user's options into `PolicyParts`, the keyword arguments the engine
passes to `TieredKVStore(...)`:

```
 option                          kernel            rotate_keys  codec     evictor
 (none)                          None (dense)      True         None      None
 --kv-quant int8|int4|fp8        None              True         KIVI/FP8  None
 --evict window|h2o|snapkv       None/ScoringK.    True         None      Window/H2O/SnapKV
 --evict streaming               CacheRopeKernel   False        None      Window(sinks=4)
 --attention quest               QuestKernel       True         None      None
 --head-sparsity R               None              True         None      HeadStreaming
```

Budgets are checked against the store's capacity when the store is built (the context is not
known here). Objects in `PolicyParts` hold per-sequence state: one store at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.attention.interface import SliceKernel
from kvtier.config import ModelConfig
from kvtier.errors import ConfigError
from kvtier.kv.hooks import Evictor, KVCodec
from kvtier.model.llama import CausalLM
from kvtier.policies.evict import EVICT, H2OEvictor, SnapKVEvictor, WindowEvictor
from kvtier.policies.head_sparsity import DEFAULT_CACHE, HeadStreamingEvictor, head_scores
from kvtier.policies.quant import KV_QUANT, make_codec
from kvtier.policies.quest import QuestKernel
from kvtier.policies.scoring import CacheRopeKernel, ScoringKernel

ATTENTION = ("dense", "quest")
STREAMING_SINKS = 4  # StreamingLLM's attention sinks
DUO_SINKS, DUO_RECENT = 64, 256  # DuoAttention's streaming heads at evaluation


@dataclass(frozen=True)
class PolicyParts:
    """Store keyword arguments for one policy; `describe` names it for logs and tables."""

    kernel: SliceKernel | None = None
    rotate_keys: bool = True
    codec: KVCodec | None = None
    evictor: Evictor | None = None
    describe: str = "lossless"

    def store_kwargs(self) -> dict[str, Any]:
        """`TieredKVStore(cfg, plan, ..., **parts.store_kwargs())`."""
        return {
            "kernel": self.kernel,
            "rotate_keys": self.rotate_keys,
            "codec": self.codec,
            "evictor": self.evictor,
        }


def _check_names(kv_quant: str | None, evict: str | None, attention: str | None) -> None:
    if kv_quant is not None and kv_quant not in KV_QUANT:
        raise ConfigError(f"unknown --kv-quant {kv_quant!r}; use one of {', '.join(KV_QUANT)}")
    if evict is not None and evict not in EVICT:
        raise ConfigError(f"unknown --evict {evict!r}; use one of {', '.join(EVICT)}")
    if attention is not None and attention not in ATTENTION:
        raise ConfigError(f"unknown --attention {attention!r}; use one of {', '.join(ATTENTION)}")


def _check_combination(
    kv_quant: str | None, evict: str | None, kv_budget: int | None, quest: bool, head_sparsity: float | None
) -> None:
    chosen = [
        name
        for name, on in (
            (f"--evict {evict}", evict is not None),
            ("--attention quest", quest),
            ("--head-sparsity", head_sparsity is not None),
        )
        if on
    ]
    if len(chosen) > 1:
        raise ConfigError(
            f"{' and '.join(chosen)} cannot be combined: choose one way to sparsify the KV cache"
        )
    if kv_quant is not None and chosen:
        raise ConfigError(f"--kv-quant {kv_quant} cannot be combined with {chosen[0]} yet: choose one")
    if kv_budget is not None and kv_budget < 1:
        raise ConfigError(f"--kv-budget must be a positive number of tokens, got {kv_budget}")
    if kv_budget is None and (evict is not None or quest):
        raise ConfigError(f"{chosen[0]} needs --kv-budget N (tokens kept or read per KV head)")
    if kv_budget is not None and not chosen:
        raise ConfigError("--kv-budget applies only with --evict, --attention quest or --head-sparsity")


def build_policy(
    cfg: ModelConfig,
    *,
    kv_quant: str | None,
    evict: str | None,
    kv_budget: int | None,
    attention: str | None,
    head_sparsity: float | None,
    device: torch.device,
    model: CausalLM | None = None,
    head_cache: Path | None = DEFAULT_CACHE,
    quest_page: int = 16,
) -> PolicyParts:
    """The store parts for these options; raises `ConfigError` on a bad name, budget or combination.

    `--head-sparsity` classifies heads on a calibration prompt, so it needs `model` (scores are
    cached in `head_cache`, per model). With `kv_budget`, streaming heads keep 64 sinks + the
    rest of the budget as recent tokens; without, DuoAttention's 64 + 256.
    `quest_page` is Quest's page size (16 in the paper; 4 found the pass key on SmolLM2 where 16
    did not, see docs/policy_quality.md).
    """
    _check_names(kv_quant, evict, attention)
    quest = attention == "quest"
    _check_combination(kv_quant, evict, kv_budget, quest, head_sparsity)
    if kv_quant is not None:
        return PolicyParts(codec=make_codec(kv_quant), describe=f"kv-quant {kv_quant}")
    if quest:
        assert kv_budget is not None
        return PolicyParts(
            kernel=QuestKernel(kv_budget, page=quest_page),
            describe=f"quest budget {kv_budget} page {quest_page}",
        )
    if evict is not None:
        assert kv_budget is not None
        desc = f"evict {evict} budget {kv_budget}"
        if evict == "window":
            return PolicyParts(evictor=WindowEvictor(kv_budget), describe=desc)
        if evict == "streaming":
            return PolicyParts(
                kernel=CacheRopeKernel(cfg, device),
                rotate_keys=False,
                evictor=WindowEvictor(kv_budget, sinks=STREAMING_SINKS),
                describe=desc,
            )
        scorer = H2OEvictor(kv_budget) if evict == "h2o" else SnapKVEvictor(kv_budget)
        return PolicyParts(kernel=ScoringKernel(scorer), evictor=scorer, describe=desc)
    if head_sparsity is not None:
        if model is None:
            raise ConfigError("--head-sparsity classifies heads on a calibration prompt: pass the model")
        if kv_budget is not None and kv_budget <= DUO_SINKS:
            raise ConfigError(
                f"--kv-budget {kv_budget} with --head-sparsity must exceed the {DUO_SINKS} sink tokens"
            )
        recent = DUO_RECENT if kv_budget is None else kv_budget - DUO_SINKS
        evictor = HeadStreamingEvictor(
            head_scores(model, cache_dir=head_cache),
            head_sparsity,
            DUO_SINKS,
            recent,
            strict_budget=kv_budget is not None,
        )
        return PolicyParts(evictor=evictor, describe=f"head-sparsity {head_sparsity:g}")
    return PolicyParts()
