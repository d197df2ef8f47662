"""Batched sampling: each row as its sequence alone would draw it, from the right distribution,
in a number of operators that does not grow ~13 a row."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.engine.batch.sample import sample_all
from kvtier.engine.batch.sequence import Sequence
from kvtier.engine.sampling import Sampler, SamplingParams, sample_rows
from kvtier.sparse.opcount import OpCounter

CPU = torch.device("cpu")
MIXED = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=2.0, top_k=1, seed=5),
]


def seq(params: SamplingParams) -> Sequence:
    return Sequence("r", [1, 2], params, b"", lambda d: None, Sampler(params, CPU))


def test_batched_rows_equal_each_sequence_alone() -> None:
    torch.manual_seed(0)
    steps = [torch.randn(len(MIXED), 1000) * 3 for _ in range(12)]
    batched = [seq(p) for p in MIXED]
    alone = [Sampler(p, CPU) for p in MIXED]  # same seeds: the same streams of numbers
    for logits in steps:
        got = sample_all(batched, logits.clone())
        want = [int(s(logits[i].clone())) for i, s in enumerate(alone)]
        assert got == want


def test_top_k_and_top_p_support() -> None:
    logits = torch.linspace(4.0, -4.0, 64)[None].repeat(2, 1)  # token 0 the likeliest
    k, p = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=7), CPU), None
    probs = logits[0].softmax(-1)
    need = int((probs.cumsum(-1) < 0.6).sum()) + 1  # the fewest tokens whose mass reaches 0.6
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.6, seed=8), CPU)
    seen_k, seen_p = set(), set()
    for _ in range(400):
        a, b = sample_rows(logits, [k, p]).tolist()
        seen_k.add(a)
        seen_p.add(b)
    assert seen_k == {0, 1, 2}
    assert seen_p == set(range(need))


def test_frequencies_follow_the_tempered_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    s = Sampler(SamplingParams(temperature=0.8, seed=11), CPU)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[int(sample_rows(logits, [s])[0])] += 1
    want = (logits[0] / 0.8).softmax(-1)
    for j in range(4):  # within 5 standard deviations of a binomial count
        sd = math.sqrt(n * want[j] * (1 - want[j]))
        assert abs(counts[j] - n * want[j]) < 5 * sd, (j, counts.tolist(), (n * want).tolist())
    assert counts[4] == 0  # mass ~1e-13


@pytest.mark.parametrize("rows", [16, 64])
def test_a_batch_runs_a_few_operators_per_row(rows: int) -> None:
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=i) for i in range(rows)]
    seqs = [seq(p) for p in params]
    logits = torch.randn(rows, 512)
    with OpCounter() as ops:
        sample_all(seqs, logits)
    # a row's own draw (one exponential_) plus the batch's ~20; one sequence at a time was ~13 a row
    assert ops.total <= rows + 30, ops.counts
