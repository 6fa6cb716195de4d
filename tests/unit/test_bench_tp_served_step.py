"""`bench/tp_served_step.py` on a tiny head: two real ranks over vLLM's TP group, timed at start-up, every step
served through the logits processor beside vLLM's own forward."""

from __future__ import annotations

import pytest

from bench import tp_served_step


def test_both_ranks_time_themselves_and_serve_every_step_as_they_agreed(monkeypatch):
    monkeypatch.delenv("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", raising=False)
    args = tp_served_step.parse_args(
        ["--vocab", "2048", "--hidden", "32", "--batches", "1,4", "--rounds", "1", "--repeats", "1", "--no-write"]
    )
    results = tp_served_step.run(args)
    offers = [results[rank]["costs"].dense_from for rank in (0, 1)]
    agreed = None if None in offers else max(offers)
    assert results[0]["agreed"] == results[1]["agreed"] == agreed
    assert results[0]["exchanges"] == results[1]["exchanges"] >= 1
    for rank in (0, 1):
        lines = results[rank]["rows"]
        assert [line["batch"] for line in lines] == [1, 4]
        assert set(lines[0]["kinds"]) == {"greedy", "sampled"} and set(lines[1]["kinds"]) == set(tp_served_step.KINDS)
        for line in lines:
            for kind, timing in line["kinds"].items():
                assert timing["ms"] > 0 and timing["min"] <= timing["ratio"] <= timing["max"]
                exchanged = timing["served_as"].endswith("+x")
                if agreed is not None and (line["batch"], kind) != (1, "greedy"):  # agreed at the first step
                    assert exchanged == (line["batch"] < agreed), (line, agreed)
                    if not exchanged:
                        assert timing["served_as"] == "dense"
    markdown = tp_served_step.to_markdown(results, args, "test machine")
    assert "2,048" in markdown and "| 4 |" in markdown


def test_the_vocabulary_must_split_over_the_ranks():
    with pytest.raises(SystemExit):
        tp_served_step.parse_args(["--vocab", "2047"])
