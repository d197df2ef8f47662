"""Where one step of `kvtier generate` goes: the command runs in this process, as typed after
`--`, and the `--step`-th single-token step of its store (1: a prefill's last token alone, as
HiP runs it; 2: the first decode step after it), or with `--any-step` the `--step`-th step of
any length (1: the prefill's first chunk, or a prefill by layer's whole pass), runs under
cProfile and torch.profiler. Writes the step's wall, the top Python functions by cumulative time
and the top device operations.

Asked by issue 19: after a 512K prefill by layer the first decode step took 0.61-0.94 s, against
0.08-0.15 after one by chunk, with the same graph captures and allocator calls
(bench/results/hip_cli_speed_512k_fast_order_ab.json).

    python bench/first_decode_trace.py --name first_decode_trace -- \
        --model M --prompt-file P --gpu-memory 24GiB --attention hip --prefill-order layer
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import write_results
from bench.serve_loop import top_kernels
from kvtier.cli.main import main as kvtier_main
from kvtier.kv.store import TieredKVStore


class StepTrace:
    """Profiles the `step`-th `begin_step(1)` of any store (`any_length`: `begin_step` of any
    length) up to the next `begin_step`."""

    def __init__(self, step: int, any_length: bool = False) -> None:
        self.step, self.seen, self.any_length = step, 0, any_length
        self.prof: cProfile.Profile | None = None
        self.kernels: profile | None = None
        self.wall_s: float | None = None
        self._t0 = 0.0
        self.done = False

    def begin(self, n_new: int) -> None:
        if self.done:
            return
        if self.prof is not None:
            self.stop()
            return
        if n_new != 1 and not self.any_length:
            return
        self.seen += 1
        if self.seen != self.step:
            return
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.kernels = profile(activities=activities)
        self.kernels.__enter__()
        self.prof = cProfile.Profile()
        self._t0 = time.perf_counter()
        self.prof.enable()

    def stop(self) -> None:
        assert self.prof is not None and self.kernels is not None
        self.prof.disable()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._t0
        self.kernels.__exit__(None, None, None)
        self.done = True

    def report(self, top: int) -> dict[str, Any]:
        if self.prof is None or self.kernels is None:
            return {"error": f"the command ran fewer than {self.step} single-token steps"}
        text = io.StringIO()
        pstats.Stats(self.prof, stream=text).sort_stats("cumulative").print_stats(top)
        ops = sorted(self.kernels.key_averages(), key=lambda e: -float(e.cpu_time_total))
        return {
            "wall_s": round(self.wall_s or 0.0, 4),
            "python_top": text.getvalue().splitlines()[-top - 3 :],
            "operators_by_cpu_time": [
                {"name": e.key[:90], "calls": e.count, "cpu_ms": round(float(e.cpu_time_total) / 1e3, 3)}
                for e in ops[:top]
            ],
            "device_top": top_kernels(self.kernels, top),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, default=2, help="which single-token step (2: the first decode step)")
    ap.add_argument("--any-step", action="store_true", help="count steps of any length (1: the first chunk)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--name", required=True, help="write bench/results/NAME.json ($OUT when set)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then `kvtier generate`'s arguments")
    args = ap.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        ap.error("give kvtier generate's arguments after --")
    trace = StepTrace(args.step, args.any_step)
    begin = TieredKVStore.begin_step

    def traced(self: TieredKVStore, n_new: int, by_layer: bool = False) -> None:
        trace.begin(n_new)
        begin(self, n_new, by_layer)

    TieredKVStore.begin_step = traced  # type: ignore[method-assign]
    rc = kvtier_main(["generate", *argv])
    if trace.prof is not None and not trace.done:
        trace.stop()
    result = {"step": args.step, "any_step": args.any_step, "kvtier_rc": rc, "generate_args": argv}
    result.update(trace.report(args.top))
    print(write_results(args.name, result), file=sys.stderr)


if __name__ == "__main__":
    main()
