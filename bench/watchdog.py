"""Evidence from a bench run that hangs: after `seconds`, every thread's Python stack and the
state of each store's CPU handoff (its ticket, the flag's value, its signals and how many are
done), then exit 3. A run killed by `timeout` leaves nothing; this leaves where each thread
stood (issue 23: the stream's wait for CPU slices, `kvtier.kv.host_flag`).

    python bench/tiered_store.py ... --watchdog 100
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import weakref
from typing import Any

import kvtier.kv.cpu_attend as cpu_attend

_stores: weakref.WeakSet[Any] = weakref.WeakSet()


def arm(seconds: float) -> None:
    """Record every `CpuSlices` made from now on, and after `seconds` print the stacks and the
    handoff states to stderr and exit the process (status 3)."""
    init = cpu_attend.CpuSlices.__init__

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _stores.add(self)

    cpu_attend.CpuSlices.__init__ = recording  # type: ignore[method-assign]
    threading.Thread(target=_fire, args=(seconds,), daemon=True, name="kvtier-watchdog").start()


def handoff_states() -> list[str]:
    """One line per live `CpuSlices`: its ticket, the flag's value, its signals (done of all)."""
    lines = []
    for cpu in list(_stores):
        flag = cpu.flag
        value = flag.get() if flag is not None else None
        done = sum(s.done() for s in cpu._signals)
        lines.append(f"ticket {cpu._ticket} flag {value} signals {done}/{len(cpu._signals)} done")
    return lines


def _fire(seconds: float) -> None:
    time.sleep(seconds)
    print(f"\n== watchdog: still running after {seconds:g} s", file=sys.stderr, flush=True)
    for line in handoff_states():
        print(f"== handoff: {line}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(3)
