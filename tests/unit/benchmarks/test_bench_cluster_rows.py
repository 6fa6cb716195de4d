"""`bench/experiments/cluster_rows.py` on a tiny head: both heads timed for every measure, logits checked equal."""

from __future__ import annotations

import argparse

from bench.experiments import cluster_rows


def test_both_heads_are_timed_for_every_measure_at_every_shape_and_batch():
    args = argparse.Namespace(shapes=[(2048, 16), (1024, 8)], dtype="float32", batches=[1, 8], repeats=1, rounds=2)
    rows = cluster_rows.run(args)
    assert [(r["shape"], r["batch"]) for r in rows] == [("2048x16", 1), ("2048x16", 8), ("1024x8", 1), ("1024x8", 8)]
    for row in rows:
        assert row["dense"] > 0
        for measure in ("stage 2", "greedy step", "sampled step"):
            assert row[f"{measure}, copy"] > 0 and row[f"{measure}, head"] > 0 and row[f"{measure} gain"] > 0
