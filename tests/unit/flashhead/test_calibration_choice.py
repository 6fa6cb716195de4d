"""The statistics behind the probe count (``my_pkg.flashhead.calibration.choice``): agreement per probe count,
the choice with its confidence bound, the rule over several validation sets, and which stage 1 is kept."""

import pytest
import torch

from my_pkg.flashhead.calibration import (
    CALIBRATED,
    WEIGHT_ONLY,
    agreement_curve,
    apply_probe_rule,
    choose_n_probes,
    cluster_targets,
    keep_stage1,
    probes_needed,
    scored_fraction,
)

from .conftest import greedy_agreement, lm_like_states

C, CAP, V = 64, 16, 1024


def test_probes_needed_matches_flashhead_greedy_with_pins_and_ties(calibration_clusters):
    weight, res = calibration_clusters
    weight = weight.clone()
    hidden = lm_like_states(weight, 600, seed=11)
    dense_top = (hidden @ weight.t()).argmax(1)
    # A tie across clusters: a copy of a frequently winning row in another cluster.
    winner = int(dense_top.mode().values)
    twin = int(torch.nonzero(res.assignments != res.assignments[winner])[0])
    weight[twin] = weight[winner]
    pinned = [int(dense_top[1]), 7]
    targets = cluster_targets(weight, res.assignments, hidden, pinned_ids=pinned)
    assert (targets.winners[:, 1] >= 0).any() and targets.pinned_winner.any()
    needed = probes_needed(res.centroids, hidden, targets)
    curve = agreement_curve(needed, res.num_clusters)
    for p in (1, 3, 8, 20, res.num_clusters):
        assert float(curve[p]) == pytest.approx(
            greedy_agreement(weight, res.centroids, res.assignments, hidden, p, pinned), abs=1e-12
        )
    assert float(curve[res.num_clusters]) == 1.0


def test_choose_n_probes_is_the_smallest_reaching_the_target():
    needed = torch.tensor([0] * 50 + [1] * 30 + [2] * 15 + [5] * 4 + [9])  # 100 rows, 9 clusters
    estimate = dict(confidence=0.5)  # the held-out estimate itself
    choice = choose_n_probes(needed, 9, 16, 160, target_agreement=0.95, num_pinned=2, **estimate)
    assert choice.n_probes == 2 and choice.agreement == pytest.approx(0.95) and choice.reached and choice.certified
    assert choice.scored_fraction == pytest.approx(scored_fraction(9, 2, 16, 160, 2)) == pytest.approx(43 / 160)
    assert choose_n_probes(needed, 9, 16, 160, target_agreement=0.96, **estimate).n_probes == 5
    full = choose_n_probes(needed, 9, 16, 160, target_agreement=1.0, **estimate)
    assert full.n_probes == 9 and full.agreement == 1.0 and not full.reached and full.certified
    given = choose_n_probes(needed, 9, 16, 160, target_agreement=0.96, n_probes=3, **estimate)
    assert given.n_probes == 3 and given.agreement == pytest.approx(0.95) and not given.certified
    for bad in (dict(target_agreement=1.5), dict(confidence=1.0), dict(confidence=0.3), dict(n_probes=10)):
        with pytest.raises(ValueError):
            choose_n_probes(needed, 9, 16, 160, **bad)


def test_choose_n_probes_with_confidence_needs_evidence_not_just_the_estimate():
    # 2,000 held-out rows: 12 misses at 1 probe (0.994), 8 at 2 (0.996), 2 at 3 (0.999), none at 4.
    needed = torch.tensor([1] * 1988 + [2] * 4 + [3] * 6 + [4] * 2)
    assert choose_n_probes(needed, 50, 16, 800, target_agreement=0.995, confidence=0.5).n_probes == 2
    choice = choose_n_probes(needed, 50, 16, 800, target_agreement=0.995, confidence=0.95)
    assert choice.n_probes == 3 and choice.certified and choice.agreement == pytest.approx(0.999)
    # Wilson score bound, one-sided 95%.
    z, n, p = 1.6448536269514722, 2000, 0.999
    wilson = (p + z * z / (2 * n) - z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5) / (1 + z * z / n)
    assert choice.agreement_lower == pytest.approx(wilson) and choice.agreement_lower >= 0.995
    # Too few rows to show 0.995 below all clusters: the estimate decides, uncertified.
    few = choose_n_probes(needed[::20], 50, 16, 800, target_agreement=0.995, confidence=0.95)
    assert few.n_probes == 1 and few.agreement == 1.0 and few.reached and not few.certified


def _needing(counts: dict[int, int]) -> torch.Tensor:
    """Held-out ``probes_needed`` where ``counts[k]`` states need ``k`` probes."""
    return torch.cat([torch.full((n,), k, dtype=torch.int64) for k, n in counts.items()])


def _rule(needed: dict[str, torch.Tensor], **kw):
    return apply_probe_rule(needed, C, CAP, V, target_agreement=0.99, confidence=0.95, margin=2.0, **kw)


def test_probe_rule_is_the_smallest_count_meeting_every_set_and_the_pooled_bound():
    # 2,000 states: 1 % need 20 probes, the rest 3; the margin (<= 0.5 % misses per set) needs all of them.
    rule = _rule({"heldout": _needing({3: 1980, 20: 20})})
    assert rule.n_probes == 20 and rule.meets and rule.pooled.agreement == 1.0
    # A second set that needs more raises the count; each set alone keeps what it needs.
    both = _rule({"heldout": _needing({3: 2000}), "samples": _needing({3: 1000, 7: 1000})})
    assert both.n_probes == 7 and both.per_set["heldout"].n_probes == 3 and both.per_set["samples"].n_probes == 7
    # Misses beyond every count below all clusters: the rule cannot be met.
    never = _rule({"heldout": _needing({3: 900, C: 100})})
    assert not never.meets and never.n_probes == C


def test_keep_stage1_keeps_the_variant_needing_fewer_probes():
    few, many = _rule({"heldout": _needing({2: 1000})}), _rule({"heldout": _needing({9: 1000})})
    kept, reason = keep_stage1(few, many)
    assert kept == CALIBRATED and "n_probes=2" in reason and "needs 9" in reason
    kept, reason = keep_stage1(many, few)
    assert kept == WEIGHT_ONLY and "weight-only" in reason and "n_probes=2" in reason and "\n" not in reason
    # A tie goes to the higher pooled agreement, then to the calibrated one.
    sure, unsure = _rule({"heldout": _needing({4: 1000})}), _rule({"heldout": _needing({4: 998, 5: 2})})
    assert sure.n_probes == unsure.n_probes == 4 and sure.meets and unsure.meets
    assert keep_stage1(unsure, sure)[0] == WEIGHT_ONLY and keep_stage1(sure, unsure)[0] == CALIBRATED
    assert keep_stage1(sure, sure)[0] == CALIBRATED


def test_keep_stage1_prefers_the_variant_meeting_the_target_and_explains_when_neither_does():
    meets = _rule({"heldout": _needing({12: 1000})})
    fails = _rule({"heldout": _needing({2: 900, C: 100})})  # few probes for most states, never the target
    assert keep_stage1(fails, meets)[0] == WEIGHT_ONLY and keep_stage1(meets, fails)[0] == CALIBRATED
    worse = _rule({"heldout": _needing({2: 800, C: 200})})
    kept, reason = keep_stage1(worse, fails)
    assert not worse.meets and not fails.meets
    assert reason.startswith("neither stage 1 meets the target") and "\n" not in reason
    # With a fixed count the higher agreement there wins.
    at5 = dict(n_probes=5)
    low, high = _rule({"heldout": _needing({6: 1000})}, **at5), _rule({"heldout": _needing({5: 1000})}, **at5)
    kept, reason = keep_stage1(low, high, fixed_probes=True)
    assert kept == WEIGHT_ONLY and reason.startswith("n_probes fixed at 5")
