"""Stage 1's centroids are stored hidden-major on CPU in float32, with the same values and scores."""

from __future__ import annotations

import numpy as np
import torch

from my_pkg.flashhead.layout import hidden_major
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
