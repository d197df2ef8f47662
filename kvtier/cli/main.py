"""`kvtier` command line: one subcommand per module (`generate`, `plan`, `eval`).

Each subcommand module exposes `add_parser(subparsers)`, which registers its options and sets
`func` to a `run(args) -> int`. Errors a user can fix are printed as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import NoReturn

# Long contexts allocate and free GPU buffers of many sizes (chunks, staging, sparse caches);
# expandable segments keep the caching allocator's fragments from eating a tight --gpu-memory.
# Read when CUDA's allocator starts, so it is set before any subcommand touches the GPU.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from kvtier import __version__
from kvtier.errors import KvtierError

# When the `kvtier` script started its own code, on `time.perf_counter`'s clock (CLOCK_MONOTONIC
# on Linux: comparable across processes), for `generate --json`'s "at_s".
STARTED = time.perf_counter()

SUBCOMMANDS = ("generate", "plan", "eval", "serve")
VERSION_LINE = f"kvtier {__version__}"


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors on one line, like every other kvtier error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvtier: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `kvtier` parser. Imports every subcommand module, and with them torch: seconds.

    Subcommand parsers are of the same class (argparse's default `parser_class`); every parser
    is built with allow_abbrev=False, so `--kv` is never read as `--kv-quant`."""
    parser = _Parser(
        prog="kvtier",
        description="Long-context LLM inference with a tiered (GPU / host) KV cache.",
        allow_abbrev=False,
    )
    parser.add_argument("-V", "--version", action="version", version=VERSION_LINE)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"kvtier.cli.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvtier` script."""
    given = sys.argv[1:] if argv is None else argv
    if given in (["--version"], ["-V"]):
        # NOTE: answered before the parser is built: building it imports torch (seconds).
        print(VERSION_LINE)
        return 0
    try:
        # NOTE: everything is inside the try: building the parser imports torch (a Ctrl-C there
        # is an interrupt like any other), and option types raise KvtierError themselves.
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except KvtierError as e:
        # NOTE: under torchrun every rank runs the command; ranks past 0 say which they are.
        rank = os.environ.get("RANK", "0")
        print(f"kvtier: error{'' if rank == '0' else f' (rank {rank})'}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
