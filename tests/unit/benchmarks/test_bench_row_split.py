"""`bench/experiments/row_split.py` on a tiny head: both ways measured, each on its own plan."""

from __future__ import annotations

import argparse

from bench.experiments import row_split
from my_pkg.flashhead.kernels import torch_ref


def test_both_ways_are_timed(monkeypatch):
    monkeypatch.setattr(row_split.torch, "get_num_threads", lambda: 4)
    plan = torch_ref.CpuPlan(min_ids_per_part=16)  # a tiny head's 128 candidates cut in 4 pieces
    args = argparse.Namespace(hidden=32, vocab=1024, batches=[1, 8], repeats=1, rounds=2)
    rows = row_split.run(args, plan)
    assert [r["batch"] for r in rows] == [1, 8] and [r["parts"] for r in rows] == [4, 1]
    for row in rows:
        assert all(row[f"{kind} {way}"] > 0 for kind in row_split.KINDS for way in ("cut", "whole"))


def test_the_whole_way_cuts_no_row(monkeypatch):
    monkeypatch.setattr(row_split.torch, "get_num_threads", lambda: 4)
    parts = []
    row_parts = torch_ref._row_parts
    monkeypatch.setattr(torch_ref, "_row_parts", lambda *a: parts.append(row_parts(*a)) or parts[-1])
    args = argparse.Namespace(hidden=32, vocab=1024, batches=[1], repeats=1, rounds=1)
    row_split.run(args, torch_ref.CpuPlan(min_ids_per_part=16))
    assert 4 in parts and 1 in parts  # the cut way's pieces, and the whole way's one
