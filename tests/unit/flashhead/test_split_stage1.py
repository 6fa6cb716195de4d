"""Stage 1 split over tensor-parallel ranks: each share's best keys, exchanged and merged, are the full
stage 1's probes bit for bit, ties included; the head serves the same logits from the same probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from my_pkg.flashhead.probes import (
    NO_KEY,
    ShardStage1,
    centroid_share,
    cluster_keys,
    key_ids,
    merge_probes,
    select_probes,
)
from tests.support.heads import random_head


def _split(centroids: torch.Tensor, hidden: torch.Tensor, world: int, width: int) -> torch.Tensor:
    """The exchange as the ranks make it: each share's keys, concatenated in rank order (`[B, world * width]`)."""
    shares = [ShardStage1(centroids, rank, world) for rank in range(world)]
    return torch.cat([share.keys(hidden, width) for share in shares], dim=1)


def _tied_problem(clusters: int, hidden_size: int = 6, rows: int = 16, seed: int = 0):
    """Small-integer centroids and hidden states (every score exact in float32, whatever the matmul's
    shape or order), many centroids repeated: scores tie often, also across the shares' boundaries."""
    generator = torch.Generator().manual_seed(seed)
    distinct = torch.randint(-3, 4, (max(2, clusters // 4), hidden_size), generator=generator).float()
    centroids = distinct[torch.randint(0, distinct.shape[0], (clusters,), generator=generator)]
    hidden = torch.randint(-2, 3, (rows, hidden_size), generator=generator).float()
    return centroids, hidden


def test_keys_order_by_score_then_by_the_smaller_cluster_id():
    scores = torch.tensor([[0.5, -0.0, 0.0, -2.0, 0.5, float("inf"), -1.0, 3.0]])
    order = key_ids(torch.sort(cluster_keys(scores), descending=True).values, 8)
    assert order.tolist() == [[5, 7, 0, 4, 2, 1, 6, 3]]  # ties (0.5) keep the smaller id first; -0.0 below 0.0
    assert select_probes(scores, 3).tolist() == [[5, 7, 0]]
    half = scores.to(torch.bfloat16)
    assert torch.equal(cluster_keys(half), cluster_keys(half.float()))  # widened exactly


def test_the_full_stage_1_breaks_ties_by_the_smaller_id():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0]])
    assert select_probes(scores, 2).tolist() == [[1, 2]]
    assert select_probes(scores, 4).tolist() == [[1, 2, 3, 5]]


@pytest.mark.parametrize(("clusters", "world"), [(40, 2), (37, 3), (37, 2), (5, 3)])
@pytest.mark.parametrize("n_probes", [1, 4, 5])
def test_split_probes_equal_the_full_stage_1_bit_for_bit_ties_included(clusters, world, n_probes):
    centroids, hidden = _tied_problem(clusters)
    scores = hidden @ centroids.T
    assert (scores.unsqueeze(2) == scores.unsqueeze(1)).sum() > scores.numel()  # ties are there
    full = select_probes(scores, n_probes)
    merged = merge_probes(_split(centroids, hidden, world, n_probes), n_probes, clusters)
    assert merged.dtype == torch.int64
    assert torch.equal(merged, full)


@pytest.mark.parametrize(("clusters", "world"), [(37, 2), (37, 3), (64, 4)])
def test_a_wider_exchange_serves_every_smaller_probe_count(clusters, world):
    """Greedy and sampled rows of one step probe different counts from one exchange of the larger."""
    centroids, hidden = _tied_problem(clusters, seed=3)
    exchanged = _split(centroids, hidden, world, 9)
    ranked = merge_probes(exchanged, 9, clusters)
    for p in (1, 3, 9):
        assert torch.equal(ranked[:, :p], select_probes(hidden @ centroids.T, p))


def test_random_float_scores_split_and_merged_equal_the_full_stage_1():
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(8, 1001, generator=generator)
    scores[:, 500] = scores[:, 499]  # a tie across the two-share boundary (500 | 501)
    for world in (2, 3):
        parts = []
        for rank in range(world):
            start, end = centroid_share(1001, rank, world)
            parts.append(torch.topk(cluster_keys(scores[:, start:end], start), 17, sorted=True).values)
        assert torch.equal(merge_probes(torch.cat(parts, 1), 17, 1001), select_probes(scores, 17))


def test_shares_cover_the_clusters_once_and_short_shares_pad_with_no_key():
    assert [centroid_share(37, r, 3) for r in range(3)] == [(0, 12), (12, 24), (24, 37)]
    centroids, hidden = _tied_problem(5)
    keys = ShardStage1(centroids, 0, 3).keys(hidden, 4)  # one cluster in this share: three empty slots
    assert keys.shape == (16, 4)
    assert (keys[:, 1:] == NO_KEY).all() and (keys[:, 0] != NO_KEY).all()
    assert (key_ids(keys, 5)[:, 0] == 0).all()
    with pytest.raises(ValueError):
        centroid_share(10, 2, 2)


def test_a_share_that_was_not_scored_ranks_last_and_full_probes_still_take_every_cluster():
    centroids, hidden = _tied_problem(37)
    shares = [ShardStage1(centroids, rank, 3) for rank in range(3)]
    exchanged = torch.cat(
        [shares[0].keys(hidden, 37), shares[1].unscored_keys(hidden.shape[0], 37), shares[2].keys(hidden, 37)], 1
    )
    every = merge_probes(exchanged, 37, 37)
    assert all(sorted(row) == list(range(37)) for row in every.tolist())
    few = merge_probes(exchanged, 5, 37)
    assert not ((few >= 12) & (few < 24)).any()  # the unscored share is never preferred
    scored = torch.cat([torch.arange(0, 12), torch.arange(24, 37)])
    expected = scored[select_probes(hidden @ centroids[scored].T, 5)]
    assert torch.equal(few, expected)


def test_no_key_decodes_inside_the_cluster_map():
    assert key_ids(torch.full((2, 3), NO_KEY), 7).max() < 7


# ---- the head: the same probes give the same logits ------------------------------------------------------


def _shard_head(sampled_n_probes=None):
    head, generator = random_head(
        300, 24, pad=4, n_probes=3, assignment_seed=2, spectrum=True, sampled_n_probes=sampled_n_probes
    )
    return head, 2.0 * torch.randn(6, 24, generator=generator)


@pytest.mark.parametrize("sampled_n_probes", [None, 5, 2])
@pytest.mark.parametrize("sampled", [None, [True] * 6, [True, False, False, True, False, True]])
def test_step_logits_from_exchanged_probes_equal_its_own_stage_1(sampled_n_probes, sampled):
    head, hidden = _shard_head(sampled_n_probes)
    mask = None if sampled is None else np.asarray(sampled)
    pinned = torch.tensor([0, 299])
    own = head.step_logits(hidden, sampled=mask, pinned=pinned)
    width = max(head.n_probes, head.sampled_n_probes)
    scores = hidden @ head.centroids.T
    exchanged = torch.cat([cluster_keys(scores[:, :9], 0), cluster_keys(scores[:, 9:], 9)], 1)
    probes = merge_probes(exchanged, width, head.num_clusters)
    given = head.step_logits(hidden, sampled=mask, pinned=pinned, probes=probes)
    assert torch.equal(given, own)


def test_step_logits_refuses_probes_narrower_than_the_rows_need():
    head, hidden = _shard_head(sampled_n_probes=5)
    probes = head.select_probes(hidden, n_probes=3)
    head.step_logits(hidden, probes=probes)  # greedy rows need 3
    with pytest.raises(ValueError, match="probes must be"):
        head.step_logits(hidden, sampled=np.ones(6, bool), probes=probes)  # sampled rows need 5
