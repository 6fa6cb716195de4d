"""`FlashHead.step_logits`: the logits serving hands to vLLM's sampler for one decode step."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.kernels.torch_ref import token_logits as _token_logits
from my_pkg.flashhead.spec import default_sampled_n_probes
from my_pkg.flashhead.tail_estimate import build_tail_tables, default_tail_rank
from tests.support.heads import random_head

VOCAB, HIDDEN, PAD = 333, 37, 5  # 21 clusters, the last ones one member short (padded in memory)


def _head(n_probes: int = 3, dtype: torch.dtype = torch.float32, **kw) -> FlashHead:
    return random_head(VOCAB, HIDDEN, pad=PAD, n_probes=n_probes, dtype=dtype, assignment_seed=1, spectrum=True, **kw)[
        0
    ]


def _hidden(rows: int, seed: int = 1) -> torch.Tensor:
    return 2.0 * torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _token_cluster(head: FlashHead) -> torch.Tensor:
    cluster = torch.empty(head.vocab_size, dtype=torch.long)
    cluster[head.members.flatten()] = torch.arange(head.num_clusters).repeat_interleave(head.cluster_size)
    return cluster


def _top_clusters(head: FlashHead, hidden: torch.Tensor, probes: int) -> list[set[int]]:
    scores = hidden.to(head.weight.dtype) @ head.centroids.T
    return [set(row.tolist()) for row in torch.topk(scores, probes, dim=1).indices]


def test_greedy_rows_are_exact_on_the_top_clusters_and_minus_inf_elsewhere():
    head = _head()
    hidden = _hidden(4)
    logits = head.step_logits(hidden)
    dense = head.dense_logits(hidden)
    cluster = _token_cluster(head)
    for row, probed in enumerate(_top_clusters(head, hidden, head.n_probes)):
        in_probed = torch.tensor([int(c) in probed for c in cluster])
        torch.testing.assert_close(logits[row][in_probed], dense[row][in_probed])
        assert (logits[row][~in_probed] == float("-inf")).all()
    assert int(torch.isfinite(logits).sum(1).max()) <= head.n_probes * head.cluster_size


def test_sampled_rows_probe_more_clusters_and_estimate_the_others_from_a_low_rank_head():
    head = _head(n_probes=1)
    head.sampled_n_probes, head.sampled_rescore = 2, 0  # estimates only, outside two clusters
    hidden = _hidden(3)
    logits = head.step_logits(hidden, sampled=torch.ones(3, dtype=torch.bool))
    dense = head.dense_logits(hidden)
    cluster = _token_cluster(head)
    tables = build_tail_tables(head.weight, VOCAB, head.sampled_rank)  # seeded: the head's own tables
    torch.testing.assert_close(tables.basis.T @ tables.basis, torch.eye(head.sampled_rank))
    estimates = (hidden @ tables.basis) @ (head.weight[:VOCAB] @ tables.basis).T  # h B B.T w_v
    assert torch.isfinite(logits).all()
    for row, probed in enumerate(_top_clusters(head, hidden, head.sampled_n_probes)):
        in_probed = torch.tensor([int(c) in probed for c in cluster])
        assert int(in_probed.sum()) > 16  # more than the greedy rows' one cluster
        torch.testing.assert_close(logits[row][in_probed], dense[row][in_probed])
        torch.testing.assert_close(logits[row][~in_probed], estimates[row][~in_probed], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rank", [1, 3, 8])
def test_the_low_rank_head_keeps_almost_all_the_energy_an_exact_svd_keeps(rank):
    weight = _head().weight[:VOCAB]
    singular = torch.linalg.svdvals(weight)
    tables = build_tail_tables(weight, VOCAB, rank)
    kept = float((tables.projected**2).sum())  # ||W B||^2
    assert kept <= float((singular[:rank] ** 2).sum()) * (1 + 1e-5)
    assert kept >= 0.99 * float((singular[:rank] ** 2).sum())
    with pytest.raises(ValueError, match="rank"):
        build_tail_tables(weight, VOCAB, 0)


def test_rank_zero_gives_sampled_rows_minus_inf_outside_their_probes():
    head = _head(n_probes=1, sampled_rank=0)
    hidden = _hidden(2)
    logits = head.step_logits(hidden, sampled=np.ones(2, bool), postprocess=lambda x: torch.tanh(x / 2) * 2)
    assert (torch.isfinite(logits).sum(1) == 16 * head.sampled_n_probes).all()


def test_the_estimates_get_closer_to_the_exact_logits_with_the_rank():
    hidden = _hidden(8)
    errors = []
    for rank in (1, 4, 16, HIDDEN):
        head = _head(n_probes=1, sampled_rank=rank)
        logits = head.step_logits(hidden, sampled=np.ones(8, bool))
        errors.append(float((logits - head.dense_logits(hidden)).abs().mean()))
        assert head.extra_memory_bytes > _head().extra_memory_bytes  # the tables, once built
    assert errors[0] > errors[1] > errors[2] > 0.0
    assert errors[3] < 1e-4  # full rank: the exact head


def test_mixed_batch_rows_equal_the_rows_computed_alone_and_are_deterministic():
    head = _head()
    hidden = _hidden(5)
    sampled = np.array([True, False, False, True, False])
    pinned = torch.tensor([7, 300])
    logits = head.step_logits(hidden, sampled=sampled, pinned=pinned)
    for row in range(5):
        alone = head.step_logits(hidden[row : row + 1], sampled=sampled[row : row + 1], pinned=pinned)
        torch.testing.assert_close(logits[row : row + 1], alone, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(logits[row]).all() == bool(sampled[row])
    assert torch.equal(logits, head.step_logits(hidden, sampled=torch.from_numpy(sampled), pinned=pinned))


def test_pinned_ids_are_exact_on_every_row_probed_or_not():
    head = _head(n_probes=1, sampled_n_probes=1)
    hidden = _hidden(6)
    dense = head.dense_logits(hidden)
    cluster = _token_cluster(head)
    # A token of a cluster no row probes, even with the sampled rows' probes.
    probed = set().union(*_top_clusters(head, hidden, head.sampled_n_probes))
    far = next(t for t in range(VOCAB) if int(cluster[t]) not in probed)
    pinned = torch.tensor([far, 0])
    for sampled in (None, np.array([True, False] * 3)):
        logits = head.step_logits(hidden, sampled=sampled, pinned=pinned)
        torch.testing.assert_close(logits[:, pinned], dense[:, pinned])
    assert (head.step_logits(hidden)[:, far] == float("-inf")).all()  # without the pin it is not scored


def test_postprocess_applies_to_finite_values_only():
    head = _head()
    hidden = _hidden(4) * 3
    cap = 2.0

    def soft_cap(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    sampled = np.array([True, False, True, False])
    pinned = torch.tensor([11])
    raw = head.step_logits(hidden, sampled=sampled, pinned=pinned)
    capped = head.step_logits(hidden, sampled=sampled, pinned=pinned, postprocess=soft_cap)
    finite = torch.isfinite(raw)
    assert torch.equal(torch.isfinite(capped), finite)  # tanh would map -inf to -cap
    torch.testing.assert_close(capped[finite], soft_cap(raw[finite]))
    assert capped[finite].abs().max() <= cap


def test_every_cluster_probed_gives_the_dense_logits_on_every_row():
    head = _head(n_probes=21)
    hidden = _hidden(4)
    logits = head.step_logits(hidden, sampled=np.array([True, False, True, False]))
    torch.testing.assert_close(logits, head.dense_logits(hidden))


def test_sampled_n_probes_setting():
    head = _head(n_probes=4, sampled_n_probes=5)
    assert head.sampled_n_probes == 5
    head.n_probes = 15
    assert head.scored_rows_per_step(sampled=True, pinned=2) == 21 + 5 * 16 + 2 + 21 + math.ceil(5 * (37 + VOCAB) / 37)
    head.sampled_n_probes = None  # the default: no cluster, the estimate chooses the exact tokens
    assert head.sampled_n_probes == default_sampled_n_probes(15, 21, head.sampled_rank) == 0
    assert default_sampled_n_probes(15, 21, 0) == 15  # without an estimate: as many as greedy rows
    assert default_sampled_n_probes(21, 21, 5) == default_sampled_n_probes(30, 21, 5) == 21  # every cluster: exact
    assert default_sampled_n_probes(1, 800, 0) == 1
    assert head.sampled_rank == default_tail_rank(HIDDEN) == 5  # ceil(37 / 8)
    assert default_tail_rank(2048) == 64 and default_tail_rank(256) == 32
    # No stage 1: neither centroids nor candidates; the weight-only estimate's V / 16 tokens and the pinned ids.
    assert head.scored_rows_per_step(sampled=True, pinned=2) == 2 + 21 + math.ceil(5 * (37 + VOCAB) / 37)
    assert head.scored_rows_per_step(sampled=False) == 21 + 15 * 16
    head.sampled_rank = 0
    assert head.sampled_n_probes == 15  # an explicit 0 too needs the estimate to choose the tokens
    for bad in (-1, 22, True, 2.0):
        with pytest.raises(ValueError, match="sampled_n_probes"):
            head.sampled_n_probes = bad
    for bad in (-1, HIDDEN + 1, 1.5):
        with pytest.raises(ValueError, match="sampled_rank"):
            head.sampled_rank = bad


def test_bad_sampled_mask_is_refused():
    head = _head()
    with pytest.raises(ValueError, match="sampled has 2 entries for 3 rows"):
        head.step_logits(_hidden(3), sampled=np.array([True, False]))


def test_bf16_head_keeps_its_dtype():
    head = _head(dtype=torch.bfloat16)
    hidden = _hidden(3).to(torch.bfloat16)
    logits = head.step_logits(hidden, sampled=np.array([True, False, True]), pinned=torch.tensor([3]))
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, VOCAB)
    assert torch.isfinite(logits[0]).all() and not torch.isfinite(logits[1]).all()


def test_row_indices_reach_the_device_as_int64_without_changing():
    from my_pkg.flashhead.staging import index_tensor

    rows = np.array([3, 0, 7], dtype=np.int32)
    staged = index_tensor(rows, torch.device("cpu"))
    assert staged.dtype == torch.int64 and staged.tolist() == [3, 0, 7]


def test_the_best_estimated_tail_tokens_are_rescored_exactly():
    head = _head(sampled_n_probes=3)
    assert head.sampled_rescore == math.ceil(VOCAB / 16) == 21  # the weight-only estimate: V / 16
    head.sampled_rescore = 20
    hidden = _hidden(4)
    logits = head.step_logits(hidden, sampled=np.ones(4, bool))
    dense = head.dense_logits(hidden)
    tables = build_tail_tables(head.weight, VOCAB, head.sampled_rank)
    estimates = (hidden @ tables.basis) @ (head.weight[:VOCAB] @ tables.basis).T
    cluster = _token_cluster(head)
    for row, probed in enumerate(_top_clusters(head, hidden, head.sampled_n_probes)):
        tail = torch.tensor([int(c) not in probed for c in cluster])
        best = torch.topk(torch.where(tail, estimates[row], float("-inf")), 20).indices
        rescored = torch.zeros(VOCAB, dtype=torch.bool)
        rescored[best] = True
        torch.testing.assert_close(logits[row][~tail | rescored], dense[row][~tail | rescored])
        torch.testing.assert_close(
            logits[row][tail & ~rescored], estimates[row][tail & ~rescored], rtol=1e-3, atol=1e-3
        )
    assert head.scored_rows_per_step(sampled=True) == head.scored_rows_per_step(sampled=False) + 20 + math.ceil(
        head.sampled_rank * (HIDDEN + VOCAB) / HIDDEN
    )
    with pytest.raises(ValueError):
        head.sampled_rescore = -1


def test_by_default_a_sampled_row_scores_exactly_the_tokens_its_estimate_ranks_best_without_stage_1():
    head = _head(n_probes=2)
    assert head.sampled_n_probes == 0
    hidden = _hidden(4)
    dense = head.dense_logits(hidden)
    tables = build_tail_tables(head.weight, VOCAB, head.sampled_rank)
    estimates = (hidden @ tables.basis) @ (head.weight[:VOCAB] @ tables.basis).T
    pinned = torch.tensor([4, 200])

    def no_stage_1(*args, **kwargs):
        raise AssertionError("stage 1 ran for sampled rows that probe no cluster")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(head.candidate_rows, "kernels", replace(head.kernels, stage1_scores=no_stage_1))
        logits = head.step_logits(hidden, sampled=np.ones(4, bool), pinned=pinned)
    for row in range(4):
        exact = torch.zeros(VOCAB, dtype=torch.bool)
        exact[torch.topk(estimates[row], head.sampled_rescore).indices] = True
        exact[pinned] = True
        torch.testing.assert_close(logits[row][exact], dense[row][exact])
        torch.testing.assert_close(logits[row][~exact], estimates[row][~exact], rtol=1e-3, atol=1e-3)
        assert not torch.allclose(logits[row][~exact], dense[row][~exact], atol=1e-3)  # estimates, not exact


@pytest.mark.parametrize("rows", [4, 20])  # 20: scored cluster by cluster
def test_a_mixed_batch_scores_both_kinds_in_one_pass_with_the_logits_of_each_kind_alone(rows, monkeypatch):

    head = _head(n_probes=2)
    hidden = _hidden(rows, seed=3)
    mixed = np.arange(rows) % 3 != 1
    greedy = head.step_logits(hidden[~mixed])
    sampled = head.step_logits(hidden[mixed], sampled=np.ones(int(mixed.sum()), bool))
    passes = []
    spy = replace(head.kernels, token_logits=lambda *a: passes.append(a[2].shape) or _token_logits(*a))
    monkeypatch.setattr(head.candidate_rows, "kernels", spy)
    both = head.step_logits(hidden, sampled=mixed)
    assert passes == [(rows, head.n_probes * head.cluster_size)]  # one pass; the sampled rows' 21 ids padded
    assert torch.equal(both[~mixed], greedy) and torch.equal(both[mixed], sampled)


def test_a_fitted_estimate_gets_v_over_32_exact_tokens_and_every_cluster_probed_still_gives_the_dense_logits():
    from my_pkg.flashhead.tail_estimate import fit_tail_factors

    weight = _head().weight
    states = _hidden(64, seed=5)
    head = _head(n_probes=3, tail_factors=fit_tail_factors(weight, VOCAB, default_tail_rank(HIDDEN), states))
    assert head.tail_fitted and head.sampled_rescore == math.ceil(VOCAB / 32) == 11
    head.n_probes = head.num_clusters
    assert head.sampled_n_probes == head.num_clusters
    hidden = _hidden(3)
    torch.testing.assert_close(head.step_logits(hidden, sampled=np.ones(3, bool)), head.dense_logits(hidden))


def test_a_fitted_estimate_lowers_its_rank_to_keep_a_sampled_row_within_the_budget():
    from my_pkg.flashhead.spec import SAMPLED_ROW_BUDGET, default_sampled_rank
    from my_pkg.flashhead.tail_estimate import fit_tail_factors

    assert default_sampled_rank(128_256, 2048, fitted_rank=64) == 64  # the budget never binds at 2,048-wide heads
    assert default_sampled_rank(8192, 256, fitted_rank=32) == 29  # the trained fixture: ceil(256 / 8) = 32 is over
    assert default_sampled_rank(8192, 256) == 32  # weight-only: ceil(H / 8)
    assert default_sampled_rank(8192, 256, fitted_rank=16) == 32  # factors shorter than that: weight-only too
    factors = fit_tail_factors(_head().weight, VOCAB, default_tail_rank(HIDDEN), _hidden(64, seed=5))
    head = _head(n_probes=3, tail_factors=factors)
    assert factors.rank == 5 and head.sampled_rank == 3 and head.tail_fitted
    assert head.scored_rows_per_step(sampled=True) <= SAMPLED_ROW_BUDGET * VOCAB
    head.sampled_rank = factors.rank  # what the default was: over the budget at this narrow head
    assert head.scored_rows_per_step(sampled=True) > SAMPLED_ROW_BUDGET * VOCAB
    assert _head(n_probes=3).sampled_rank == 5  # weight-only
