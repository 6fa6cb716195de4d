"""`bench/head.py`'s table: one column pair per kind of step, whichever batch measured it first."""

from __future__ import annotations

import torch

from bench import head


def _kind(ms: float) -> dict[str, float]:
    return {"ms": ms, "ratio": 2.0, "min": 1.5, "max": 2.5}


def test_a_kind_missing_at_batch_1_gets_one_column_pair():
    rows = [
        {"batch": 1, "dense": 10.0, "kinds": {"greedy": _kind(1.0), "sampled": _kind(2.0)}},  # no mixed batch of 1
        {"batch": 2, "dense": 20.0, "kinds": {"greedy": _kind(3.0), "sampled": _kind(4.0), "mixed": _kind(5.0)}},
        {"batch": 4, "dense": 40.0, "kinds": {"greedy": _kind(6.0), "sampled": _kind(7.0), "mixed": _kind(8.0)}},
    ]
    result = {
        "vocab": 1024, "hidden": 32, "clusters": 64, "probes": 8, "sampled_probes": 8, "rank": 4, "pinned": 3,
        "rows_greedy": 195, "rows_sampled": 400, "backend": "torch", "extra_bytes": 2**20, "tables_s": 0.1,
        "rounds": 2, "rows": rows, "worst": (2.0, 1, "greedy"),
    }  # fmt: skip
    lines = head.to_markdown([result], torch.device("cpu"), torch.float32, machine="test machine").splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == (
        "| batch | dense ms | greedy ms | greedy speed-up (spread) | sampled ms | sampled speed-up (spread) "
        "| mixed ms | mixed speed-up (spread) |"
    )
    assert all(line.count("|") == 9 for line in table)
    assert table[2].endswith("| n/a | n/a |") and "| 8.00 |" in table[4]
