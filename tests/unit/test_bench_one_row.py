"""`bench/one_row.py` on a tiny head: every product and step timed both ways, and the head as served again
afterwards, whatever happens inside the "before" block."""

from __future__ import annotations

import pytest
import torch

from bench import one_row
from my_pkg.flashhead import layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_part_is_timed_before_and_as_served(dtype):
    result = one_row.run_shape(2048, 32, dtype, [1, 2], rounds=2, repeats=1)
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["dense"] > 0
        assert all(row[f"{part} {way}"] > 0 for part in one_row.PARTS for way in one_row.WAYS)
    markdown = one_row.to_markdown([result], rounds=2, threads=1)
    assert markdown.count("| 2,048 × 32 |") == 2


def test_before_this_change_is_undone_even_when_the_block_fails():
    head = one_row._head(2048, 32, torch.float32)
    stored = head._tail_tables().projected
    assert not stored.is_contiguous()  # hidden-major as served
    with pytest.raises(RuntimeError), one_row.before_this_change(head):
        assert head._tail_tables().projected.is_contiguous()
        assert not layout.prefers_vector_product(torch.zeros(4, 4, dtype=torch.bfloat16))
        raise RuntimeError("inside")
    assert head._tail_tables().projected is stored
    assert layout.prefers_vector_product(torch.zeros(4, 4, dtype=torch.bfloat16))
