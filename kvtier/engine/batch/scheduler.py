"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest
first: a decoding one takes 1 token, one still in prefill takes a chunk of what is left of the
budget (chunked prefill, interleaved with the decodes). Then waiting sequences join, FIFO,
while budget, `max_num_seqs` and pages last. When a running sequence needs a page and none is
free, the newest running sequence is preempted: its pages are released (full ones stay in the
prefix cache, and move to its host tier when the pool evicts them) and it goes back to the front
of the queue; its re-admission copies the cached pages back and recomputes only the partial last
page, so a preemption costs a swap, not a prefill.

A sequence with a store of its own (`Sequence.own`: a method of its own, KV in device memory)
holds no pages and is never preempted; it runs its prefill in its store's fixed spans, each
whole, in a step whose budget has room for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtier.engine.batch.kv_manager import KVCacheManager
from kvtier.engine.batch.sequence import Sequence, Status
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits: sequences in the running batch, and tokens computed per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}"
            )


class Scheduler:
    """The waiting queue and the running batch. Used by the engine thread only."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queue or batch and free its pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's (sequence, tokens to compute) pairs, in token-stream order. Mutates."""
        budget = self.cfg.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted by an earlier sequence of this loop
            n = self._tokens(seq, budget)
            if n == 0:
                continue  # its next span waits for a step with room
            while not self.kv.allocate(seq, seq.num_computed + n):
                self._preempt(self._victim())
                preempted = True
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is Status.RUNNING:
                out.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            seq = self.waiting[0]
            n = self._tokens(seq, budget)
            if n == 0:
                break  # FIFO: its first span waits for a step with room
            found = self.kv.admit(seq)
            n = self._tokens(seq, budget)
            if not self.kv.allocate(seq, seq.num_computed + n):
                self.kv.free(seq)  # hand the prefix hits back; retry on a later step
                break
            self.kv.record_admission(seq, found)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out

    @staticmethod
    def _tokens(seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes in a step with `budget` left: a chunk of what is pending, or
        for a sequence with its own store its next whole span (0 when it does not fit)."""
        if seq.own is None:
            return min(seq.num_pending, budget)
        n = seq.own.next_span(seq.num_computed)
        return n if n <= budget else 0

    def _victim(self) -> Sequence:
        """The newest running sequence that holds pages (one with its own store holds none)."""
        return next(s for s in reversed(self.running) if s.own is None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
