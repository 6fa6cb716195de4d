"""`bench/experiments/shard_members.py` on a tiny head: both ways timed on every shard, kernel settings restored."""

from __future__ import annotations

import argparse

import pytest

from bench.experiments import shard_members
from my_pkg.flashhead.kernels import torch_ref


def test_both_ways_are_timed_on_each_shard_and_the_settings_restored():
    saved = torch_ref._SKIP_PADDING_SHARE, torch_ref._GROUPED_MIN_ROWS
    args = argparse.Namespace(hidden=16, vocab=2048, tp=[2, 8], batches=[1, 8], repeats=1, rounds=2)
    rows = shard_members.run(args)
    assert (torch_ref._SKIP_PADDING_SHARE, torch_ref._GROUPED_MIN_ROWS) == saved
    assert [(r["tp"], r["batch"]) for r in rows] == [(2, 1), (2, 8), (8, 1), (8, 8)]
    assert all(r["now"] > 0 and r["before"] > 0 and r["dense"] > 0 for r in rows)
    assert rows[-1]["empty"] > 0  # 256 tokens in 128 clusters of 16: TP=8 leaves some clusters empty


def test_the_settings_are_restored_when_a_call_fails(monkeypatch):
    saved = torch_ref._SKIP_PADDING_SHARE, torch_ref._GROUPED_MIN_ROWS
    with pytest.raises(RuntimeError), shard_members.before(True):
        assert torch_ref._SKIP_PADDING_SHARE > 1 and torch_ref._GROUPED_MIN_ROWS > 1 << 32
        raise RuntimeError("boom")
    assert (torch_ref._SKIP_PADDING_SHARE, torch_ref._GROUPED_MIN_ROWS) == saved
