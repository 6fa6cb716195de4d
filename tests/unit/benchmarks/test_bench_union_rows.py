"""`bench/experiments/union_rows.py` on a tiny head: both ways timed with the same logits, each way on its own plan,
and the union's share measured on what the rows really score."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.experiments import union_rows
from my_pkg.flashhead.kernels import torch_ref


def _args(**kw) -> argparse.Namespace:
    base = dict(hidden=32, vocab=1024, dtype="bfloat16", batches=[1, 4], shared=[0.0, 0.9], repeats=1, rounds=2)
    return argparse.Namespace(**{**base, **kw})


def test_both_ways_are_timed_with_the_same_logits():
    rows = union_rows.run(_args())
    assert [(r["shared"], r["batch"]) for r in rows] == [(0.0, 1), (0.0, 4), (0.9, 1), (0.9, 4)]
    for row in rows:
        assert all(row[f"{kind} {way}"] > 0 for kind in union_rows.KINDS for way in union_rows.WAYS)
        assert row["dense"] > 0
        if torch_ref._mm_columns_exact(torch.bfloat16, 32):
            assert row["greedy equal"] and row["sampled equal"]
    # One row shares nothing with itself; rows that point the same way share candidates.
    by_key = {(r["shared"], r["batch"]): r for r in rows}
    assert by_key[(0.0, 1)]["greedy share"] == 1.0
    assert by_key[(0.9, 4)]["greedy share"] < by_key[(0.0, 4)]["greedy share"]


def test_the_rows_way_scores_no_union(monkeypatch):
    unions = []
    union = torch_ref._logits_union
    monkeypatch.setattr(torch_ref, "_logits_union", lambda *a, **kw: unions.append(1) or union(*a, **kw))
    monkeypatch.setattr(torch_ref, "_mm_columns_exact", lambda dtype, hidden_size: True)
    head = union_rows._head(1024, 32, torch.bfloat16)
    hidden = torch.randn(4, 32).bfloat16()
    head.cpu_plan = torch_ref.CpuPlan(union_min_rows=1 << 30)
    head.step_logits(hidden)
    assert unions == []
    head.cpu_plan = None
    head.step_logits(hidden)
    assert unions == [1]


def test_the_share_counts_distinct_ids_over_all_ids():
    head = union_rows._head(1024, 32, torch.float32)
    hidden = torch.randn(1, 32)
    assert union_rows.union_share(head, hidden.expand(3, -1), "greedy") == pytest.approx(1 / 3)
    assert union_rows.union_share(head, hidden.expand(2, -1), "sampled") == pytest.approx(1 / 2)
    assert union_rows.union_share(head, hidden, "sampled") == 1.0


def test_the_trained_fixture_rows_share_some_of_their_ids():
    shares = union_rows.fixture_shares([1, 8], draws=3)
    assert shares[1] == {"greedy": 1.0, "sampled": 1.0}
    assert 0.0 < shares[8]["greedy"] < 1.0 and 0.0 < shares[8]["sampled"] < 1.0
