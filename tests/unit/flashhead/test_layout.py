"""Stage 1's centroids and the estimate's table are stored hidden-major on CPU in float32, with the same values
and scores; one bfloat16 row is multiplied by `torch.mv`, with `F.linear`'s values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from my_pkg.flashhead.layout import hidden_major, linear
from my_pkg.flashhead.probes import ShardStage1
from tests.support.heads import random_head


def _matrix(rows: int = 21, cols: int = 37, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_hidden_major_keeps_the_values_and_stores_them_transposed_on_cpu_float32():
    matrix = _matrix()
    stored = hidden_major(matrix)
    assert torch.equal(stored, matrix)
    assert stored.t().is_contiguous() and not stored.is_contiguous()
    assert hidden_major(stored) is stored  # already laid out: no second copy


def test_hidden_major_keeps_bfloat16_row_major():
    matrix = _matrix(dtype=torch.bfloat16)
    stored = hidden_major(matrix.t().contiguous().t())
    assert torch.equal(stored, matrix) and stored.is_contiguous()


def test_a_cpu_float32_head_scores_stage_1_with_hidden_major_centroids():
    head, *_ = random_head(333, 37, n_probes=4)
    assert head.centroids.t().is_contiguous()
    hidden = torch.randn(1, 37, generator=torch.Generator().manual_seed(1))
    hidden_major_scores = hidden @ head.centroids.t().contiguous()
    row_major_scores = torch.nn.functional.linear(hidden, head.centroids.contiguous())
    assert not torch.equal(hidden_major_scores, row_major_scores)  # the layouts round differently: the path shows
    assert torch.equal(head.select_probes(hidden), torch.topk(hidden_major_scores, 4, dim=1).indices)
    # Serving's step probes the same clusters: its finite logits are their members (and nothing else).
    logits = head.step_logits(hidden, sampled=np.zeros(1, bool))
    members = head.members[head.select_probes(hidden)[0]].flatten().unique()
    assert torch.equal(torch.isfinite(logits[0]).nonzero().flatten(), members)


def test_a_tensor_parallel_share_scores_hidden_major_centroids():
    centroids = _matrix()
    shard = ShardStage1(centroids, 1, 2)
    assert shard.centroids.t().is_contiguous()
    assert torch.equal(shard.centroids, centroids[shard.start : shard.end])
    assert shard.nbytes == shard.centroids.numel() * 4 + shard.centroids.shape[0] * 8


def test_a_share_of_hidden_major_centroids_is_a_view_of_them():
    centroids = hidden_major(_matrix())
    shard = ShardStage1(centroids, 1, 2)
    assert shard.centroids.untyped_storage().data_ptr() == centroids.untyped_storage().data_ptr()
    hidden = torch.randn(3, 37, generator=torch.Generator().manual_seed(2))
    scores = torch.nn.functional.linear(hidden, shard.centroids)
    torch.testing.assert_close(scores, hidden @ centroids[shard.start : shard.end].t(), rtol=1e-6, atol=1e-6)


def _calls_to_mv(monkeypatch) -> list[tuple[int, ...]]:
    """Shapes of the matrices `torch.mv` multiplies from here on (it still computes)."""
    seen: list[tuple[int, ...]] = []
    real_mv = torch.mv

    def spy(matrix, vector, *args, **kwargs):
        seen.append(tuple(matrix.shape))
        return real_mv(matrix, vector, *args, **kwargs)

    monkeypatch.setattr(torch, "mv", spy)
    return seen


def test_one_bfloat16_row_is_multiplied_by_torch_mv_with_f_linears_values(monkeypatch):
    seen = _calls_to_mv(monkeypatch)
    matrix = _matrix(333, 64, dtype=torch.bfloat16)
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = linear(row, matrix)
    assert seen == [(333, 64)] and got.shape == (1, 333) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.nn.functional.linear(row, matrix))


@pytest.mark.parametrize(
    "rows, dtype, transposed",
    [
        (2, torch.bfloat16, False),  # several rows: one product by every row
        (1, torch.float32, False),  # float32's matrix-vector kernel was no faster
        (1, torch.float16, False),  # float16's was slower
        (1, torch.bfloat16, True),  # torch.mv streams a row-major matrix only
    ],
)
def test_other_products_stay_with_f_linear(monkeypatch, rows, dtype, transposed):
    seen = _calls_to_mv(monkeypatch)
    matrix = _matrix(333, 64, dtype=dtype)
    if transposed:
        matrix = matrix.t().contiguous().t()
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = linear(hidden, matrix)
    assert seen == []
    assert torch.equal(got, torch.nn.functional.linear(hidden, matrix))


def test_a_bfloat16_heads_one_row_steps_score_stage_1_and_the_estimate_by_torch_mv(monkeypatch):
    head, generator = random_head(4096, 64, n_probes=8, dtype=torch.bfloat16)
    hidden = torch.randn(1, 64, generator=generator).to(torch.bfloat16)
    head.step_logits(hidden, sampled=np.ones(1, bool))  # builds the estimate's tables, untimed
    seen = _calls_to_mv(monkeypatch)
    head.step_logits(hidden, sampled=np.zeros(1, bool))
    head.step_logits(hidden, sampled=np.ones(1, bool))
    rank = head._tail_tables().rank
    assert seen == [(head.num_clusters, 64), (4096, rank)]  # stage 1 of the greedy row, the sampled row's estimate
    two = hidden.expand(2, -1).contiguous()
    head.step_logits(two, sampled=np.zeros(2, bool))
    head.step_logits(two, sampled=np.ones(2, bool))
    assert len(seen) == 2  # two rows of a kind: F.linear
    head.step_logits(two, sampled=np.array([False, True]))  # one row of each: each product has one row
    assert seen[2:] == seen[:2]


def test_a_cpu_float32_heads_estimate_table_is_stored_hidden_major_with_the_same_estimates():
    head, generator = random_head(4096, 64, n_probes=8)
    tables = head._tail_tables()
    assert tables.projected.t().is_contiguous() and not tables.projected.is_contiguous()
    hidden = torch.randn(3, 64, generator=generator)
    row_major = torch.nn.functional.linear(hidden @ tables.basis, tables.projected.contiguous())
    torch.testing.assert_close(tables.estimates(hidden), row_major, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_heads_estimate_table_stays_row_major():
    head, _ = random_head(4096, 64, n_probes=8, dtype=torch.bfloat16)
    assert head._tail_tables().projected.is_contiguous()
