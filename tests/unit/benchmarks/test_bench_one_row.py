"""`bench/experiments/one_row.py` on a tiny head: every product and step timed both ways, and the head as served again
afterwards, whatever happens inside the "before" block."""

from __future__ import annotations

import pytest
import torch

from bench._report import median_ms
from bench.experiments import one_row
from my_pkg.flashhead import layout


@pytest.mark.parametrize("dtype, cold_mb", [(torch.float32, 1), (torch.bfloat16, 0)])
def test_every_part_is_timed_before_and_as_served(dtype, cold_mb):
    result = one_row.run_shape(2048, 32, dtype, [1, 2], rounds=2, repeats=1, cold_mb=cold_mb)
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["dense"] > 0
        assert all(row[f"{part} {way}"] > 0 for part in one_row.PARTS for way in one_row.WAYS)
    markdown = one_row.to_markdown([result], rounds=2, threads=1, cold_mb=cold_mb)
    assert markdown.count("| 2,048 × 32 |") == 2
    assert ("1 MiB written before each call" in markdown) == bool(cold_mb)


def test_a_cold_call_writes_the_eviction_buffer_before_each_call_outside_the_timing():
    evict = torch.zeros(8)
    seen = []
    ms = median_ms(lambda: seen.append(float(evict[0])), 3, evict)
    assert seen == [1.0, 2.0, 3.0] and ms >= 0


def test_before_this_change_is_undone_even_when_the_block_fails():
    head = one_row._head(2048, 32, torch.float32)
    stored = head._tail_tables().projected
    assert not stored.is_contiguous()  # hidden-major as served
    with pytest.raises(RuntimeError), one_row.before_this_change(head, stored.contiguous()):
        assert head._tail_tables().projected.is_contiguous()
        assert not layout.prefers_vector_product(torch.zeros(4, 4, dtype=torch.bfloat16))
        raise RuntimeError("inside")
    assert head._tail_tables().projected is stored
    assert layout.prefers_vector_product(torch.zeros(4, 4, dtype=torch.bfloat16))
