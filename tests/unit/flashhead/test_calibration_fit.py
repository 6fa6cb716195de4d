"""Stage-1 fit (``my_pkg.flashhead.calibration.fit``): dense targets, the fit and what its scores mean."""

import pytest
import torch

from my_pkg.flashhead.calibration import agreement_curve, cluster_targets, fit_stage1, probes_needed
from my_pkg.flashhead.clustering import random_balanced_assignment

from .conftest import lm_like_states


@pytest.fixture(scope="module")
def fitted(calibration_clusters):
    weight, res = calibration_clusters
    return fit_stage1(weight, res.assignments, lm_like_states(weight, 3000, seed=1), res.centroids, seed=0)


def test_targets_match_dense_softmax_and_do_not_depend_on_chunking():
    torch.manual_seed(0)
    v = 203  # not a multiple of 16: short clusters are padded in memory, padding must not count
    weight = torch.randn(v, 12)
    assignments = random_balanced_assignment(v, 16, seed=1)
    hidden = 2.0 * torch.randn(40, 12)
    small = cluster_targets(weight, assignments, hidden, top_k=5, chunk_bytes=1)
    big = cluster_targets(weight, assignments, hidden, top_k=5)
    for a, b in zip(vars(small).values(), vars(big).values()):
        torch.testing.assert_close(a, b)  # float sums differ in the last bit between batch shapes
    logits = hidden @ weight.t()
    c = int(assignments.max()) + 1
    log_mass = torch.stack([torch.logsumexp(logits[:, assignments == k], dim=1) for k in range(c)], dim=1)
    torch.testing.assert_close(big.log_z, torch.logsumexp(logits, dim=1))
    torch.testing.assert_close(big.top_log_mass, torch.topk(log_mass, 5, dim=1).values)
    assert torch.equal(big.winners[:, 0], assignments[logits.argmax(1)])
    assert (big.winners[:, 1:] == -1).all()  # random rows: no ties


def test_fit_raises_heldout_agreement_over_weight_only(calibration_clusters, fitted):
    weight, res = calibration_clusters
    assert fitted.best_epoch >= 1 and min(fitted.heldout_loss) < fitted.heldout_loss[0]
    unseen = lm_like_states(weight, 2000, seed=2)
    targets = cluster_targets(weight, res.assignments, unseen)
    weight_only = agreement_curve(probes_needed(res.centroids, unseen, targets), res.num_clusters)
    calibrated = agreement_curve(probes_needed(fitted.centroids, unseen, targets), res.num_clusters)
    for p in (2, 4, 8, 16):
        assert calibrated[p] > weight_only[p] + 0.05, (p, float(calibrated[p]), float(weight_only[p]))


def test_fit_is_deterministic_for_a_seed(calibration_clusters):
    weight, res = calibration_clusters
    hidden = lm_like_states(weight, 600, seed=6)
    first, again, other = (
        fit_stage1(weight, res.assignments, hidden, res.centroids, seed=seed, epochs=2) for seed in (0, 0, 1)
    )
    assert torch.equal(first.centroids, again.centroids) and torch.equal(first.heldout_rows, again.heldout_rows)
    assert not torch.equal(first.heldout_rows, other.heldout_rows)


def test_fitted_scores_stay_in_logit_units(calibration_clusters, fitted):
    """``size_c * exp(hidden @ centroid_c)`` estimates the cluster's mass: serving uses it for unprobed tokens."""
    weight, res = calibration_clusters
    unseen = lm_like_states(weight, 1000, seed=3)
    logits = unseen @ weight.t()
    log_size = torch.log(torch.bincount(res.assignments).float())
    log_mass = torch.stack(
        [torch.logsumexp(logits[:, res.assignments == k], dim=1) for k in range(res.num_clusters)], dim=1
    )
    estimate = unseen @ fitted.centroids.t() + log_size
    total_error = (torch.logsumexp(estimate, dim=1) - torch.logsumexp(logits, dim=1)).abs().median()
    heaviest = log_mass.argmax(1, keepdim=True)
    heaviest_error = (estimate.gather(1, heaviest) - log_mass.gather(1, heaviest)).abs().median()
    weight_only = (
        (torch.logsumexp(unseen @ res.centroids.t() + log_size, dim=1) - torch.logsumexp(logits, dim=1)).abs().median()
    )
    assert total_error < 2.0 and heaviest_error < 2.0, (float(total_error), float(heaviest_error))
    assert total_error < weight_only / 2


def test_fit_rejects_bad_input(calibration_clusters):
    weight, res = calibration_clusters
    hidden = lm_like_states(weight, 50, seed=1)
    with pytest.raises(ValueError, match=r"hidden states must be \[N, 32\]"):
        fit_stage1(weight, res.assignments, hidden[:, :31], res.centroids)
    with pytest.raises(ValueError, match="heldout_fraction"):
        fit_stage1(weight, res.assignments, hidden, res.centroids, heldout_fraction=1.0)
    with pytest.raises(ValueError, match="at least 2"):
        fit_stage1(weight, res.assignments, hidden[:1], res.centroids)
    bad = hidden.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fit_stage1(weight, res.assignments, bad, res.centroids)
