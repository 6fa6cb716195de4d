"""`bench/experiments/compact_row.py` on a small shape: both sides draw in-vocabulary tokens; it prints a row."""

from __future__ import annotations

import torch

from bench.experiments import compact_row
from tests.support.heads import random_head


def test_both_sides_draw_one_token_per_row_of_the_vocabulary():
    head, generator = random_head(1024, 32, sampled_rank=4)
    compact, full_row = compact_row.sides(head, torch.randn(3, 32, generator=generator) * 0.3)
    for side in (compact, full_row):
        tokens = side()
        assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 1024)).all())


def test_it_prints_a_row_per_shape_and_batch(capsys):
    argv = ["--shapes", "2048x64", "--batches", "1,2", "--rounds", "1", "--threads", "1", "--hidden-scale", "0.5"]
    assert compact_row.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2,048 × 64 |")]
    assert len(rows) == 2
