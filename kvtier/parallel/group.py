"""`RankGroup`: this process's place among the ranks of one tensor-parallel model.

The model's all-reduces and the sampled token go over torch.distributed's default process group
(NCCL when the ranks run on GPUs, gloo on the CPU). Control messages (a driver's calls to its
workers, start-up errors) go over a second, gloo group with a long timeout: a worker waits there,
idle, between requests.

A process is a rank in one of three ways, all ending in an initialized default group:
  torchrun           RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment
  a kvtier worker    started by `kvtier.parallel.spawn`, which initializes the group first
  a kvtier driver    a plain process asking for N ranks: `spawn.start_workers` makes it rank 0
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvtier.errors import ConfigError, KvtierError

Sample = Callable[[torch.Tensor], torch.Tensor]  # logits [vocab] -> token id (0-d)

# NOTE: the control group's timeout bounds how long a worker may wait for rank 0's next call.
CONTROL_TIMEOUT = dt.timedelta(days=365)
# The default group's: one collective of the model (a prefill chunk's layer) never takes this long.
COLLECTIVE_TIMEOUT = dt.timedelta(minutes=30)


def launched_world_size() -> int | None:
    """The number of ranks this process was started among (torchrun, a kvtier worker, or a
    process group its caller initialized); None for a plain process."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        return None
    try:
        size = int(text)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={text!r} in the environment is not a number of processes") from None
    if size < 1:
        raise ConfigError(f"WORLD_SIZE={text!r} in the environment must be at least 1")
    return size


def backend_for(device_type: str) -> str:
    """NCCL for ranks on GPUs, gloo for ranks on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_default_group(device_type: str, local_rank: int, **how: Any) -> None:
    """Initialize torch.distributed's default group (`how`: init_method, or store/rank/world_size):
    NCCL bound to this rank's GPU, or gloo on the CPU."""
    device_id = torch.device("cuda", local_rank) if device_type == "cuda" else None
    dist.init_process_group(backend_for(device_type), timeout=COLLECTIVE_TIMEOUT, device_id=device_id, **how)


def rank_device(device_type: str, local_rank: int, local_size: int) -> torch.device:
    """The device of the rank with `local_rank` on this machine: its own GPU, or the CPU.

    NOTE: ranks on the CPU share its cores: each takes 1/local_size of them for torch's threads
    (torchrun's OMP_NUM_THREADS=1 guards against the same oversubscription, which makes every
    collective wait for a descheduled rank)."""
    if device_type != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"tensor-parallel rank {local_rank} on this machine needs GPU cuda:{local_rank}, but it has "
            f"{count} GPU(s); start at most {count} ranks per machine"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


@dataclass
class RankGroup:
    """This process's rank among `size` tensor-parallel ranks, its device and the collectives."""

    rank: int
    size: int
    local_rank: int
    local_size: int  # ranks on this machine (they share its cores and host memory)
    device: torch.device
    control: Any  # a gloo ProcessGroup for control messages
    owns_default: bool  # whether joining initialized torch.distributed (close() then destroys it)
    threads_before: int  # torch's CPU threads before joining (restored by close())
    closed: bool = False

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place on every rank; returns `t`."""
        dist.all_reduce(t)
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `t` with rank `src`'s `t` on every rank; returns `t`."""
        dist.broadcast(t, src)
        return t

    def synced(self, sample: Sample, src: int = 0) -> Sample:
        """`sample` (logits -> token id, a 0-d tensor), with rank `src`'s token on every rank:
        each rank then feeds the same token, whatever its own logits or sampler's seed gave."""

        def sample_synced(logits: torch.Tensor) -> torch.Tensor:
            return self.broadcast_(sample(logits).contiguous(), src)

        return sample_synced

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable), on every rank, over the control group."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, over the control group."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    @contextmanager
    def agree(self, what: str) -> Iterator[None]:
        """Run the block on every rank; if it raised on any rank, raise on all of them.

        The rank that failed re-raises its own exception; the others raise its message (as the
        same KvtierError class where it is one), so a start-up error on rank 2 is what rank 0
        reports, rather than a hang in the first collective."""
        failure: BaseException | None = None
        try:
            yield
        except Exception as e:
            failure = e
        reports = self.all_gather_object(None if failure is None else (type(failure), str(failure)))
        if failure is not None:
            raise failure
        for rank, report in enumerate(reports):
            if report is not None:
                cls, message = report
                if isinstance(cls, type) and issubclass(cls, KvtierError):
                    raise cls(f"{message} (rank {rank} of {self.size}, {what})")
                raise RuntimeError(f"rank {rank} of {self.size} failed ({what}): {cls.__name__}: {message}")

    def close(self) -> None:
        """Leave the group: destroys torch.distributed's default group if joining made it, and
        gives torch its CPU threads back. Only the first call acts."""
        if self.closed:
            return
        self.closed = True
        torch.set_num_threads(self.threads_before)
        if dist.is_initialized():
            dist.destroy_process_group(self.control)
            if self.owns_default:
                dist.destroy_process_group()


def join(size: int | None, device_type: str) -> RankGroup:
    """This process's `RankGroup`: of the process group already initialized (a kvtier worker's, or
    the caller's), else of the one torchrun's environment describes (initialized here).

    `size` is the asked number of ranks (None: whatever the launch says); ConfigError when it
    disagrees with the launch, or when there is no launch at all."""
    launched = launched_world_size()
    if launched is None:
        raise ConfigError(
            "this process was not started as a tensor-parallel rank: run it under `torchrun "
            "--nproc-per-node N`, or ask for the ranks (`--tensor-parallel N`) without torchrun"
        )
    if size is not None and size != launched:
        raise ConfigError(
            f"--tensor-parallel {size} disagrees with the {launched} processes this one was started "
            f"among (torchrun --nproc-per-node / WORLD_SIZE); pass --tensor-parallel {launched} or omit it"
        )
    owns = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    threads = torch.get_num_threads()
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(launched)))
    device = rank_device(device_type, local_rank, local_size)
    if owns:
        init_default_group(device_type, local_rank, init_method="env://")
    elif device_type == "cpu" and dist.get_backend() == "nccl":
        raise ConfigError("the process group runs NCCL, which needs the ranks on GPUs; use --device cuda")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    rank = int(dist.get_rank())
    return RankGroup(rank, launched, local_rank, local_size, device, control, owns, threads)
