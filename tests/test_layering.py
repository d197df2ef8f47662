"""The package's import graph: lower layers never import higher ones, and no module imports
itself back through others.

Every `import kvtier...` / `from kvtier... import` counts, also inside functions and under
`TYPE_CHECKING`: a lazy import is still a dependency, and a type-only cycle is still two modules
that cannot be understood apart.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvtier

ROOT = Path(kvtier.__file__).parent

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "units", "config", "__init__"}),  # names, sizes, model config
    frozenset({"attention"}),  # the model <-> cache interface and exact kernels
    frozenset({"model", "planner"}),  # the pure decoder; byte formulas and placement
    frozenset({"kv", "loading"}),  # the tiered store; checkpoints
    frozenset({"parallel"}),  # tensor parallelism: the transform, rank groups, spawned ranks
    frozenset({"policies", "sparse"}),  # the methods' parts: codecs, evictors, kernels
    frozenset({"methods"}),  # the method registry and plan_for
    frozenset({"engine"}),  # LLM and the generation loop
    frozenset({"eval", "serve", "hf"}),  # users of the engine; hf: kvtier inside transformers
    frozenset({"cli", "__main__"}),  # the command line
)
"""Each top-level module or package of kvtier, lowest first. `kvtier/__init__.py` re-exports
the engine's API, so it is checked as a special case below."""


def layer_of(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise AssertionError(f"kvtier.{package} is in no layer of {__file__}: add it to LAYERS")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kvtier_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every kvtier module `path` imports, wherever the import stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvtier"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.startswith("kvtier"):
                yield node.lineno, base


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_every_package_has_a_layer() -> None:
    for path in sources():
        layer_of(top(module_name(path)) if path.parent != ROOT else path.stem)


def test_no_upward_imports() -> None:
    upward = []
    for path in sources():
        src = top(module_name(path)) if path.parent != ROOT else path.stem
        if src == "__init__":
            continue  # the top-level re-export of LLM and the errors
        for line, target in kvtier_imports(path):
            dst = top(target)
            if layer_of(dst) > layer_of(src):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({src}) imports {target} ({dst})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    modules = {module_name(p): p for p in sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for _, target in kvtier_imports(path):
            # `from kvtier.kv import store` names a module; `from kvtier.kv.store import X` too.
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name and target in modules:
                deps.add(target)
        graph[name] = deps
    cycles: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
