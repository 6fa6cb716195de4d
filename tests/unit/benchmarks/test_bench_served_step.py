"""`bench/served_step.py` on a tiny head: the controller times itself, and every step is timed as it serves it."""

from __future__ import annotations

import pytest
import torch

from bench import served_step


def test_every_kind_and_batch_is_timed_with_the_plan_the_start_up_timing_gives(monkeypatch):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    result = served_step.bench_shape(4096, 32, torch.float32, [1, 8], rounds=2, repeats=1)
    costs = result["costs"]
    assert costs is not None and costs.batches[0] == 1
    assert [line["batch"] for line in result["rows"]] == [1, 8]
    assert set(result["rows"][0]["kinds"]) == {"greedy", "sampled"}  # no mixed step of one row
    assert set(result["rows"][1]["kinds"]) == {"greedy", "sampled", "mixed"}
    for line in result["rows"]:
        for timing in line["kinds"].values():
            assert timing["plan"] in ("flashhead", "masked")
            assert timing["ms"] > 0 and timing["min"] <= timing["ratio"] <= timing["max"]
    markdown = served_step.to_markdown([result], torch.float32, 2, "test machine")
    assert "4,096 × 32" in markdown and "| 8 |" in markdown


def test_the_benchmark_refuses_a_server_setting_that_turns_the_timing_off(monkeypatch):
    monkeypatch.setenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", "never")
    with pytest.raises(SystemExit, match="did not time itself"):
        served_step.bench_shape(2048, 16, torch.float32, [1], rounds=1, repeats=1)
