"""The methods a request can run with, in one registry, and the planning entry point.

- `registry`: `MethodEntry` (name, family, options, how its store parts are built, the packed
  format the planner sizes), `register`, and the lookups the CLI, eval and planner use.
- one file per method family: `hip`, `quest`, `quant` (KV codecs), `evict`, `duo` (head-wise
  sparsity). Importing this package registers them all.
- `choice`: `MethodChoice`, a request's options resolved against the registry.
- `plan`: `plan_for`, the one planning entry point (store planner + a method's planner hook).
- `spec`: methods as text (`head,head_group=1`, `quest,kv_budget=1k`), for eval and `LLM.generate`.

May import: the store (`kvtier.kv`), the planner, the model, and the methods' parts
(`kvtier.policies`, `kvtier.sparse`). Imported by the engine, eval, serve and the CLI; never by
the layers below it.
"""

# NOTE: importing a method's module registers it; this order is the order the CLI and eval
# list them in (sparse attention, codecs, evictors, streaming heads).
# isort: off
from kvtier.methods import hip, quest  # noqa: F401
from kvtier.methods import quant  # noqa: F401
from kvtier.methods import evict  # noqa: F401
from kvtier.methods import duo  # noqa: F401

# isort: on
from kvtier.methods.choice import MethodChoice, build_policy
from kvtier.methods.plan import plan_for
from kvtier.methods.registry import (
    FAMILIES,
    OPTIONS,
    REGISTRY,
    BuildContext,
    Family,
    MethodEntry,
    Option,
    Placement,
    PlanInputs,
    choices,
    lookup,
    names,
    register,
    unregister,
)
from kvtier.methods.spec import method_spec, parse_choice, spec_names

__all__ = [
    "FAMILIES",
    "OPTIONS",
    "REGISTRY",
    "BuildContext",
    "Family",
    "MethodChoice",
    "MethodEntry",
    "Option",
    "Placement",
    "PlanInputs",
    "build_policy",
    "choices",
    "lookup",
    "method_spec",
    "names",
    "parse_choice",
    "plan_for",
    "register",
    "spec_names",
    "unregister",
]
