"""`bench/plot_steps.py` reads the step times it plots: a row's decode steps, or with `prefill`
its prefill steps, labelled with the order that ran and leaving warm-up rows out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.plot_steps import step_lines

ROWS = [
    {"method": "hip", "warmup": True, "prefill_step_s": [9.0, 1.0, 1.0], "decode_step_times_s": [1, 2, 3]},
    {
        "method": "hip,prefill_order=layer",
        "prefill_order": "layer",
        "prefill_tokens_per_s": 14900.98,
        "prefill_step_s": [4.0, 0.9, 0.9, 1.6],
        "decode_step_times_s": [0.5, 0.02, 0.02],
    },
]


def test_prefill_lines_are_the_timed_rows_prefill_steps(tmp_path: Path) -> None:
    path = tmp_path / "cli.json"
    path.write_text(json.dumps({"code": "abc1234", "rows": ROWS}))
    ((label, steps),) = step_lines([path], None, prefill=True)
    assert steps == [4.0, 0.9, 0.9, 1.6]
    assert label == "hip,prefill_order=layer at abc1234 by layer, 14,901 tok/s"
    decode = step_lines([path], None)
    assert [s for _, s in decode] == [[1.0, 2.0, 3.0], [0.5, 0.02, 0.02]]


def test_a_file_without_prefill_steps_is_named(tmp_path: Path) -> None:
    path = tmp_path / "offload.json"
    path.write_text(json.dumps({"rows": [{"method": "hip", "decode_steps_s": [1, 2, 3]}]}))
    with pytest.raises(SystemExit, match=r"offload\.json: no row with prefill step times"):
        step_lines([path], None, prefill=True)
