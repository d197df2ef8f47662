"""Every launched Triton kernel of kvtier, compiled to TTIR for an sm90 target on a machine with
no GPU: Triton's frontend only (`ASTSource.make_ir`), over the variants `tests.triton_variants`
lists (the constexpr values and argument specializations that each kernel's wrapper can pass).

`tests/test_triton_compile.py` runs this module as a script, in processes where TRITON_INTERPRET
is unset: under the interpreter the kernels are `InterpretedFunction`s, which never compile. By
hand: `python -m tests.triton_compile_variants [KERNEL ...] [--shard I/N]` prints one JSON line
a variant ({"index", "kernel", "variant", "error"}: error null where it compiled).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from tests.triton_variants import KERNELS, ROOT, Ptr, Variant, variants

# --- compiling ------------------------------------------------------------------------------


class _Tensor:
    """What Triton's specializer reads of a tensor argument: its dtype and data pointer."""

    def __init__(self, ptr: Ptr) -> None:
        import torch

        self.dtype = getattr(torch, ptr.dtype)
        self._ptr = 1 << 20 if ptr.aligned else (1 << 20) + 2

    def data_ptr(self) -> int:
        return self._ptr


def _chain(exc: BaseException) -> list[BaseException]:
    """exc and its `__cause__`s, outermost first: the last is the root cause."""
    out = [exc]
    while out[-1].__cause__ is not None:
        out.append(out[-1].__cause__)
    return out


def describe(exc: BaseException, scope: dict[str, Any] | None = None) -> str:
    """The root cause's message, then where it was raised: each Triton function on the way (the
    kernel, then the helpers it calls) at its file and line where `scope` (name -> JITFunction)
    has it, and the innermost source line."""
    chain = _chain(exc)
    root = chain[-1]
    message = getattr(root, "error_message", None) or f"{type(root).__name__}: {root}"
    steps, line = [], ""
    for e in chain:
        node, src = getattr(e, "node", None), getattr(e, "src", None)
        if node is None or not hasattr(node, "lineno") or not isinstance(src, str):
            continue  # not a CompilationError with a location
        found = re.search(r"def\s+(\w+)", src)
        name = found.group(1) if found else "?"
        fn = (scope or {}).get(name)
        if fn is not None:  # node.lineno counts from the function's `def` line
            path = Path(fn.file_name)
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            steps.append(f"{name} ({where}:{fn.def_file_line_number + node.lineno - 1})")
        else:
            steps.append(f"{name} (line {node.lineno} from its def)")
        lines = src.splitlines()
        line = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
    text = str(message).strip()
    if steps:
        text += f"\n  at {' > '.join(steps)}: {line}"
    return text


def _jit_scope(fn: Any) -> dict[str, Any]:
    """The JITFunctions `fn` can reach by name: its module's, and theirs (helpers' modules)."""
    from triton.runtime.jit import JITFunction

    scope, todo = {fn.__name__: fn}, [fn]
    while todo:
        for name, value in todo.pop().fn.__globals__.items():
            if isinstance(value, JITFunction) and name not in scope:
                scope[name] = value
                todo.append(value)
    return scope


class Compiler:
    """make_ir for sm90 with the CUDA backend; no GPU needed."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        self.target = GPUTarget("cuda", 90, 32)
        self.backend = CUDABackend(self.target)

    def signature(
        self, fn: Any, args: dict[str, Any]
    ) -> tuple[dict[str, str], dict[Any, Any], dict[Any, Any]]:
        """(signature, constexprs, attrs) of a launch with `args`, as the JIT's binder makes them."""
        from triton.runtime.jit import native_specialize_impl

        if set(args) != set(fn.arg_names):
            raise TypeError(f"arguments {sorted(set(args) ^ set(fn.arg_names))} missing or unknown")
        signature: dict[str, str] = {}
        constexprs: dict[Any, Any] = {}
        attrs: dict[Any, Any] = {}
        for i, p in enumerate(fn.params):
            value = args[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[(i,)] = "constexpr", value
                continue
            arg = _Tensor(value) if isinstance(value, Ptr) else value
            specialize, align = not p.do_not_specialize, not p.do_not_specialize_on_alignment
            ty, attr = native_specialize_impl(type(self.backend), arg, p.is_const, specialize, align)[:2]
            signature[p.name] = ty
            if ty == "constexpr":
                constexprs[(i,)] = attr
            elif isinstance(attr, str):
                attrs[(i,)] = self.backend.parse_attr(attr)
        return signature, constexprs, attrs

    def compile(self, variant: Variant) -> str | None:
        """None where `variant` compiles to TTIR, else `describe` of the error."""
        from triton._C.libtriton import ir
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        fn = getattr(importlib.import_module(KERNELS[variant.kernel]), variant.kernel)
        if not isinstance(fn, JITFunction):
            return f"{variant.kernel} is a {type(fn).__name__}, not a JITFunction: is TRITON_INTERPRET set?"
        try:
            src = ASTSource(fn, *self.signature(fn, variant.args))
            opts = self.backend.parse_options(variant.options)
            context = ir.context()
            ir.load_dialects(context)
            self.backend.load_dialects(context)
            codegen = self.backend.get_codegen_implementation(opts)
            src.make_ir(self.target, opts, codegen, self.backend.get_module_map(), context)
        except Exception as e:
            return describe(e, _jit_scope(fn))
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kernels", nargs="*", help="kernels (default: all)")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th variant from the I-th")
    opts = parser.parse_args(argv)
    unknown = set(opts.kernels) - set(KERNELS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    index, count = (int(x) for x in opts.shard.split("/"))
    if "triton" not in sys.modules:  # Triton reads it where kvtier's kernels are decorated, below
        os.environ.pop("TRITON_INTERPRET", None)
    compiler = Compiler()
    failed = 0
    every = variants(opts.kernels or None)
    for i in range(index, len(every), count):
        v = every[i]
        error = compiler.compile(v)
        failed += error is not None
        print(json.dumps({"index": i, "kernel": v.kernel, "variant": v.label, "error": error}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
