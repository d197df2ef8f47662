"""Ranks started by the process that asks for them: `LLM(tensor_parallel=N)` and `kvtier generate
--tensor-parallel N` outside torchrun.

The asking process becomes rank 0 (the driver) and starts ranks 1..N-1 as spawned processes on
this machine, torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK in their environment). Each worker
joins the process group, builds the same object (`factory(**kwargs)`: an `LLM` with the same
options) and then runs, as rank 0 does, every call rank 0 makes (`Workers.call`): the model is
SPMD, so a `generate` on rank 0 is a `generate` on every rank.

    rank 0 (driver)                         rank r (worker)
    TCPStore (port 0), spawn workers   -->  connect, set "kvtier_worker_r", init the group
    init the group (waits for all)          factory(**kwargs)  (joins, loads its shard)
    factory's own __init__                  serve_calls: loop { call = broadcast; run it }
    Workers.call("generate", ...)      -->  llm.generate(...)  (collectives in lock step)
    Workers.close()                    -->  None: leave the loop, destroy the group, exit
"""

from __future__ import annotations

import datetime as dt
import multiprocessing.process
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.errors import ConfigError, KvtierError
from kvtier.parallel.group import RankGroup, init_default_group, join, launched_world_size

HOST = "127.0.0.1"
STARTUP_TIMEOUT = dt.timedelta(minutes=10)  # for every worker to import torch and connect


def start_ranks(
    size: int | None, device_type: str, factory: Callable[..., Any], kwargs: dict[str, Any]
) -> tuple[RankGroup | None, Workers | None]:
    """This process's rank group for `size` ranks (None: as launched), and the workers it started.

    - started as a rank (torchrun, a kvtier worker): its group; no workers.
    - a plain process and size > 1: rank 0 of workers started here, each running
      `factory(**kwargs)` (which asks for the same size).
    - a plain process (or a launch of one process) and size None or 1: (None, None), no ranks.
    """
    launched = launched_world_size()
    if launched is None or (launched == 1 and size in (None, 1)):
        if size is None or size == 1:
            return None, None
        workers = start_workers(size, device_type, factory, kwargs)
        try:
            workers.group = join(size, device_type)
        except BaseException:
            workers.close(timeout_s=1.0, notify=False)
            raise
        return workers.group, workers
    return join(size, device_type), None


class Workers:
    """Ranks 1..N-1, as seen from rank 0: their processes, and the calls sent to them."""

    def __init__(self, processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
        self.processes = list(processes)
        self.group: RankGroup | None = None  # set once rank 0 has joined
        # Rank 0 failed while the ranks were running collectives: the workers may be waiting in
        # one, so close() stops them rather than sending them a call, and no call is sent again.
        self.broken = False
        self.closed = False

    def call(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Make every worker run `obj.name(*args, **kwargs)` on its own object (results stay
        there); rank 0 then runs the same call itself."""
        if self.broken or self.group is None:
            raise KvtierError(
                "the tensor-parallel ranks stopped after an error in a run; build a new LLM to go on"
            )
        self.group.broadcast_object((name, args, kwargs))

    def close(self, timeout_s: float = 30.0, notify: bool = True) -> None:
        """Tell the workers to leave (unless `notify` is False: they are leaving already, after a
        failed start), wait for them (terminating any that hang) and leave the group. Only the
        first call acts (a finalizer calls it again, maybe while another LLM's group is up)."""
        if self.closed:
            return
        self.closed = True
        if notify and not self.broken and self.group is not None and dist.is_initialized() and self.alive():
            self.group.broadcast_object(None)
        for p in self.processes:
            p.join(1.0 if self.broken else timeout_s)
            if p.is_alive():
                p.terminate()
                p.join()
        if self.group is not None:
            self.group.close()
            self.group = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)


def start_workers(
    size: int, device_type: str, factory: Callable[..., Any], kwargs: dict[str, Any]
) -> Workers:
    """Start ranks 1..size-1 running `factory(**kwargs)`, and make this process rank 0 of their
    process group (torch.distributed's default group, initialized here). Raises KvtierError when
    a worker exits before it joins (its traceback is on stderr)."""
    if dist.is_initialized():
        raise ConfigError("torch.distributed is initialized already; run one tensor-parallel LLM at a time")
    store = dist.TCPStore(HOST, 0, size, True, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    processes = [
        ctx.Process(
            target=_worker_main,
            args=(rank, size, store.port, device_type, factory, kwargs),
            name=f"kvtier-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for p in processes:
        p.start()
    workers = Workers(processes)
    keys = [f"kvtier_worker_{rank}" for rank in range(1, size)]
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        dead = [p for p in processes if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            workers.close(timeout_s=1.0, notify=False)
            why = f"exited with code {dead[0].exitcode}" if dead else "did not connect in time"
            raise KvtierError(f"tensor-parallel worker {(dead or processes)[0].name} {why} before joining")
        time.sleep(0.02)
    if device_type == "cuda":
        torch.cuda.set_device(0)
    init_default_group(device_type, 0, store=store, rank=0, world_size=size)
    return workers


def _worker_main(
    rank: int,
    size: int,
    port: int,
    device_type: str,
    factory: Callable[..., Any],
    kwargs: dict[str, Any],
) -> None:
    """A worker's process: join, build the object, run rank 0's calls until it says stop."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    store = dist.TCPStore(HOST, port, size, False, timeout=STARTUP_TIMEOUT)
    store.set(f"kvtier_worker_{rank}", "ready")
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    init_default_group(device_type, rank, store=store, rank=rank, world_size=size)
    try:
        obj = factory(**kwargs)
    except Exception:
        # NOTE: the object's constructor reported the error to rank 0 (RankGroup.agree), which
        # raises it; this rank has nothing to add.
        dist.destroy_process_group()
        sys.exit(1)
    serve_calls(obj, obj.parallel)
    obj.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def serve_calls(obj: Any, group: RankGroup) -> None:
    """Run rank 0's calls on `obj` until it sends None (`Workers.close`).

    A call that raises a KvtierError before `obj.collectives_started` raised the same on rank 0
    (same inputs, same checks, before any collective), which reports it; the worker goes on to
    the next call. Any other error ends the worker (rank 0's collective then fails too)."""
    while True:
        message = group.broadcast_object(None)
        if message is None:
            return
        name, args, kwargs = message
        try:
            getattr(obj, name)(*args, **kwargs)
        except KvtierError:
            if getattr(obj, "collectives_started", False):
                raise
            continue
