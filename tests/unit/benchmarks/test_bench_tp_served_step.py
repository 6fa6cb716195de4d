"""`bench/tp_served_step.py` on a tiny head: two real ranks over vLLM's TP group, timed at start-up, every step
served through the logits processor beside vLLM's own forward."""

from __future__ import annotations

import pytest

from bench import tp_served_step


@pytest.mark.slow
def test_both_ranks_time_themselves_and_exchange_on_every_step(monkeypatch):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    args = tp_served_step.parse_args(
        ["--vocab", "2048", "--hidden", "32", "--batches", "1,4", "--rounds", "1", "--repeats", "1", "--no-write"]
    )
    results = tp_served_step.run(args)
    assert all(results[rank]["costs"].masked_greedy_ms is not None for rank in (0, 1))
    assert results[0]["exchanges"] == results[1]["exchanges"] >= 1
    for rank in (0, 1):
        lines = results[rank]["rows"]
        assert [line["batch"] for line in lines] == [1, 4]
        assert set(lines[0]["kinds"]) == {"greedy", "sampled"} and set(lines[1]["kinds"]) == set(tp_served_step.KINDS)
        for line in lines:
            for timing in line["kinds"].values():
                assert timing["ms"] > 0 and timing["min"] <= timing["ratio"] <= timing["max"]
                assert timing["served_as"] in ("flashhead+x", "masked+x")  # every armed step exchanges
    markdown = tp_served_step.to_markdown(results, args, "test machine")
    assert "2,048" in markdown and "| 4 |" in markdown


def test_the_vocabulary_must_split_over_the_ranks():
    with pytest.raises(SystemExit):
        tp_served_step.parse_args(["--vocab", "2047"])
