"""`bench/compact_fidelity.py`: its statistics, and a short run on the trained fixture that writes its section."""

from __future__ import annotations

import math

import pytest
import torch

from bench import compact_fidelity
from my_pkg.flashhead.compact_law import RowFilter


def test_the_miss_rate_bound_is_clopper_pearsons():
    assert compact_fidelity.clopper_pearson_upper(0, 4096) == pytest.approx(1 - 0.05 ** (1 / 4096), rel=1e-6)
    assert compact_fidelity.clopper_pearson_upper(5, 100) == pytest.approx(0.1023, abs=2e-4)


def test_the_dense_law_applies_vllms_filters_in_order():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, -5.0])
    assert compact_fidelity.dense_law(logits, RowFilter(top_k=2)).gt(0).tolist() == [True, True, True, False, False]
    kept = compact_fidelity.dense_law(logits, RowFilter(min_p=math.exp(-1.5)))
    assert kept.gt(0).tolist() == [True, True, True, False, False]
    assert torch.equal(compact_fidelity.dense_law(logits, RowFilter()), torch.softmax(logits.double(), 0))


@pytest.mark.slow
def test_a_short_run_reports_every_setting_and_writes_its_section(monkeypatch):
    written = {}
    monkeypatch.setattr(compact_fidelity, "write_section", lambda name, md: written.setdefault(name, md))
    compact_fidelity.main(["--rows", "16"])
    table = written["compact-fidelity"]
    for label, *_ in compact_fidelity.SETTINGS:
        assert f"| {label} | docstrings | 16 |" in table and f"| {label} | code | 16 |" in table
    assert "Command: `python -m" in table and "miss rows of 32" in table
    assert "exact set 14 clusters (10 with both top_k and top_p)" in table  # as served: `compact_clusters`
