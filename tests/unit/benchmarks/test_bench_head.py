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


def test_the_dense_baseline_is_vllms_cpu_product_with_the_same_logits():
    """On CPU with vLLM installed the dense side is vLLM's oneDNN GEMM over the packed weight (as vLLM serves
    the head), not `F.linear`, which is 2-3x slower from a few rows on; both give the same logits."""
    from bench._report import dense_head

    weight = torch.randn(300, 24)
    hidden = torch.randn(5, 24)
    fn, name = dense_head(weight)
    assert "oneDNN" in name  # the test environment installs vLLM's CPU build
    torch.testing.assert_close(fn(hidden), torch.nn.functional.linear(hidden, weight), rtol=1e-4, atol=1e-4)
