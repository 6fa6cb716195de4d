"""`bench/experiments/shard_members.py` on a tiny head: both ways timed on every shard, the "before" way a plan of
its own."""

from __future__ import annotations

import argparse

from bench.experiments import shard_members
from my_pkg.flashhead.kernels import torch_ref


def test_both_ways_are_timed_on_each_shard():
    args = argparse.Namespace(hidden=16, vocab=2048, tp=[2, 8], batches=[1, 8], repeats=1, rounds=2)
    rows = shard_members.run(args)
    assert [(r["tp"], r["batch"]) for r in rows] == [(2, 1), (2, 8), (8, 1), (8, 8)]
    assert all(r["now"] > 0 and r["before"] > 0 and r["dense"] > 0 for r in rows)
    assert rows[-1]["empty"] > 0  # 256 tokens in 128 clusters of 16: TP=8 leaves some clusters empty


def test_before_scores_every_padded_slot_and_row_by_row_where_a_cluster_is_empty():
    default = torch_ref.DEFAULT_PLAN
    assert shard_members.before(False).skip_padding_share > 1
    assert shard_members.before(False).grouped_min_rows == default.grouped_min_rows
    assert shard_members.before(True).grouped_min_rows > 1 << 32
