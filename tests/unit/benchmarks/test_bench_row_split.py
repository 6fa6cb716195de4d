"""`bench/experiments/row_split.py` on a tiny head: both ways measured, and the cut restored whatever happens."""

from __future__ import annotations

import argparse

import pytest

from bench.experiments import row_split
from my_pkg.flashhead.kernels import torch_ref


def test_both_ways_are_timed_and_the_cut_is_restored(monkeypatch):
    monkeypatch.setattr(row_split.torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch_ref, "_MIN_IDS_PER_PART", 16)  # a tiny head's 128 candidates cut in 4 pieces
    args = argparse.Namespace(hidden=32, vocab=1024, batches=[1, 8], repeats=1, rounds=2)
    before = torch_ref._MIN_IDS_PER_PART
    rows = row_split.run(args)
    assert torch_ref._MIN_IDS_PER_PART == before
    assert [r["batch"] for r in rows] == [1, 8] and [r["parts"] for r in rows] == [4, 1]
    for row in rows:
        assert all(row[f"{kind} {way}"] > 0 for kind in row_split.KINDS for way in ("cut", "whole"))


def test_the_cut_is_restored_when_a_step_fails(monkeypatch):
    before = torch_ref._MIN_IDS_PER_PART
    step_logits = row_split.FlashHead.step_logits

    def fail_once_uncut(self, *args, **kwargs):  # the "whole" way's first step
        if torch_ref._MIN_IDS_PER_PART != before:
            raise RuntimeError("boom")
        return step_logits(self, *args, **kwargs)

    monkeypatch.setattr(row_split.FlashHead, "step_logits", fail_once_uncut)
    with pytest.raises(RuntimeError):
        row_split.run(argparse.Namespace(hidden=32, vocab=1024, batches=[1], repeats=1, rounds=1))
    assert torch_ref._MIN_IDS_PER_PART == before
