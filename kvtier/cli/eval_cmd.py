"""`kvtier eval`: offline long-context accuracy (passkey, needle in a haystack, RULER-style).

kvtier eval niah --lengths 1k,2k,4k,8k --depths 0:100:25 --samples 2 --plot niah.png
kvtier eval passkey --lengths 2k,4k --samples 5 --method gpu --method head,head_group=1
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from kvtier.cli.options import int_type, output_path_type, seed_type, size_type
from kvtier.errors import ConfigError
from kvtier.eval.grid import parse_depths, parse_lengths
from kvtier.eval.haystack import HAYSTACKS
from kvtier.eval.results import EvalResult, Record
from kvtier.eval.ruler import RULER_SUBTASKS
from kvtier.eval.runner import EvalConfig, run_eval
from kvtier.eval.specs import option_types, parse_methods
from kvtier.eval.tasks import TASKS, TaskSpec
from kvtier.methods import spec_names
from kvtier.units import parse_count


def add_parser(subparsers: Any) -> None:
    """Register `kvtier eval` and its options."""
    p = subparsers.add_parser(
        "eval",
        help="offline long-context accuracy: passkey, needle-in-a-haystack heatmaps, RULER-style tasks",
        description="Generate synthetic long-context prompts from a seed (no downloads), run them under "
        "one or more KV methods and score the answers. Lengths count prompt plus answer tokens.",
        allow_abbrev=False,
    )
    p.add_argument("task", help=f"one of: {', '.join(TASKS)}")
    p.add_argument(
        "--model", default=None, help="HF folder, .gguf file or preset (default: embedded SmolLM2)"
    )
    p.add_argument("--lengths", default="2k,4k", help="context lengths in tokens, e.g. 1k,2k,4k,8k")
    p.add_argument(
        "--depths",
        default=None,
        help="needle depths %%: start:stop:step or a list (niah default 0:100:10; "
        "passkey default: random per sample; not for ruler)",
    )
    p.add_argument(
        "--samples", type=int_type("--samples"), default=1, help="samples per (length, depth) cell"
    )
    p.add_argument(
        "--first-sample",
        type=int,
        default=0,
        help="index of each cell's first sample: --first-sample 1 --samples 2 runs samples 1-2 of a "
        "--samples 3 grid (same prompts)",
    )
    p.add_argument("--seed", type=seed_type(), default=0, help="seed of the generators (0 <= seed < 2**64)")
    p.add_argument(
        "--method",
        action="append",
        default=None,
        metavar="SPEC",
        help=f"KV method, repeatable: a name ({', '.join(spec_names())}) with optional key=value "
        f"({', '.join(option_types())}), e.g. head,head_group=1 (default: auto)",
    )
    p.add_argument("--haystack", choices=HAYSTACKS, default=None, help="filler (default: per task)")
    p.add_argument(
        "--subtasks", default=None, help=f"ruler subset, comma-separated: {', '.join(RULER_SUBTASKS)}"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", default=None, help="allow lengths past the trained context")
    p.add_argument(
        "--gpu-memory",
        type=_budget,
        default=None,
        help="GPU budget of every method, e.g. 24GiB (a method's gpu_memory= overrides it)",
    )
    p.add_argument("--json", action="store_true", help="print the aggregate scores as JSON")
    p.add_argument(
        "--plot",
        type=output_path_type("--plot"),
        default=None,
        metavar="F.png",
        help="save a heatmap (niah) or accuracy lines",
    )
    p.add_argument(
        "--out",
        type=output_path_type("--out"),
        default=None,
        metavar="F.json",
        help='save everything, per-sample records too; rewritten after each sample ("complete": '
        "false until the run ends), so a run that stops keeps what it finished",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run that --out holds (the same command, stopped before it completed): "
        "its finished samples are kept, not run again",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _budget(text: str) -> str:
    """`--gpu-memory` as typed (recorded so in the results), once checked to be a size."""
    size_type("--gpu-memory")(text)
    return text.strip()


def build_config(args: argparse.Namespace) -> EvalConfig:
    """Parse and check the options (ConfigError on bad input), before any model is loaded."""
    spec = TaskSpec(
        task=args.task,
        lengths=parse_lengths(args.lengths),
        depths=None if args.depths is None else parse_depths(args.depths),
        samples=args.samples,
        seed=args.seed,
        first_sample=args.first_sample,
        haystack=args.haystack,
        subtasks=None if args.subtasks is None else tuple(s.strip() for s in args.subtasks.split(",")),
    )
    mml = None if args.max_model_len is None else parse_count(args.max_model_len, "--max-model-len")
    return EvalConfig(spec, parse_methods(args.method), args.model, args.device, mml, args.gpu_memory)


_RECORDED = (
    "model",
    "lengths",
    "depths",
    "samples",
    "first_sample",
    "seed",
    "haystack",
    "subtasks",
    "device",
    "max_model_len",
    "gpu_memory",
)


def command_line(args: argparse.Namespace) -> str:
    """The run as one canonical `kvtier eval ...` command (recorded in the results)."""
    words = ["kvtier", "eval", args.task]
    for opt in _RECORDED:
        value = getattr(args, opt)
        if value is not None:
            words += [f"--{opt.replace('_', '-')}", str(value)]
    for m in args.method or []:
        words += ["--method", m]
    return shlex.join(words)


def resumed_records(out: str | None, command: str) -> list[Record]:
    """The records `--resume` keeps: those of `out` when it holds a run of `command` (none when
    it does not exist yet). ConfigError when there is no `--out` or it holds another run."""
    if out is None:
        raise ConfigError("--resume continues the run saved in --out F.json: give --out")
    if not Path(out).exists():
        print(f"--resume: {out} does not exist yet; running every sample", file=sys.stderr)
        return []
    earlier = EvalResult.load(out)
    if earlier.meta.get("command") != command:
        raise ConfigError(
            f"--resume: {out} holds a run of another command ({earlier.meta.get('command')!r}); "
            f"this one is {command!r}: give the same options, another --out, or drop --resume"
        )
    return earlier.records


def run(args: argparse.Namespace) -> int:
    """Run the eval; print a table (or `--json`), save `--out` and `--plot`."""
    cfg = build_config(args)
    command = command_line(args)
    done = resumed_records(args.out, command) if args.resume else []
    save = (lambda partial: partial.save(args.out)) if args.out else None
    result = run_eval(cfg, command=command, progress=not args.no_progress, after_each=save, done=done)
    if args.out:
        result.save(args.out)
    if args.plot:
        from kvtier.eval.plots import plot_results

        plot_results(result, args.plot)
    print(json.dumps(result.summary(), indent=2) if args.json else result.table())
    return 0
