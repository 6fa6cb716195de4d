"""`bench/experiments/tp_compact_step.py` on a tiny head: two real ranks over vLLM's TP group draw the same tokens
from the compact rows they planned whole, and a row per batch is printed."""

from __future__ import annotations

import pytest

from bench.experiments import tp_compact_step


@pytest.mark.slow
def test_both_ranks_draw_the_same_tokens_and_a_row_per_batch_is_printed(monkeypatch, capsys):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    argv = ["--vocab", "4096", "--hidden", "32", "--batches", "1,4", "--rounds", "1", "--repeats", "1"]
    assert tp_compact_step.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2
    assert all(row.rstrip().endswith("| True |") for row in rows), rows  # the ranks drew alike


def test_the_vocabulary_must_split_over_the_ranks():
    with pytest.raises(SystemExit):
        tp_compact_step.main(["--vocab", "4095"])
