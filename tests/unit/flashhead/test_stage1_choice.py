"""The builder keeps the stage 1 (calibrated or weight-only) that meets the promise with the fewest probes."""

import pytest
import torch
from safetensors.torch import save_file

import my_pkg.flashhead.calibration as calibration
from my_pkg.cli import main
from my_pkg.flashhead.assets import CACHE_DIR_NAME, CACHE_FILE_NAME, CALIBRATION_KEY, read_config
from my_pkg.flashhead.calibration import (
    CALIBRATED,
    WEIGHT_ONLY,
    agreement_curve,
    apply_probe_rule,
    calibrate_stage1,
    cluster_targets,
    keep_stage1,
    probes_needed,
)
from my_pkg.flashhead.clustering import balanced_kmeans
from my_pkg.flashhead.synthetic import synthetic_head, synthetic_hidden_states

C, CAP, V = 64, 16, 1024


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


@pytest.fixture(scope="module")
def clustered():
    weight = synthetic_head(V, 32, seed=3)
    return weight, balanced_kmeans(weight, CAP, iterations=8, progress=False)


def _states(weight, n, seed):
    return synthetic_hidden_states(weight, n, noise=1.5, seed=seed)


def _spoil_the_fit(monkeypatch):
    """A fit that returns random vectors: the calibrated stage 1 then clearly needs more probes."""
    real = calibration.fit_stage1

    def spoiled(*args, **kwargs):
        result = real(*args, **{**kwargs, "epochs": 1})
        result.centroids = torch.randn(result.centroids.shape, generator=torch.Generator().manual_seed(0))
        return result

    monkeypatch.setattr(calibration, "fit_stage1", spoiled)


def _needs(centroids, weight, assignments, states, target=0.9):
    needed = probes_needed(centroids, states, cluster_targets(weight, assignments, states))
    curve = agreement_curve(needed, int(assignments.max()) + 1)
    return int(torch.nonzero(curve >= 1 - (1 - target) / 2).flatten()[0])


def test_calibrate_stage1_keeps_weight_only_when_the_fit_needs_more_probes(clustered, monkeypatch):
    weight, res = clustered
    hidden = _states(weight, 1500, seed=4)
    good = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=6)
    assert good.stage1 == CALIBRATED and good.record()["stage1"] == CALIBRATED
    assert torch.equal(good.centroids, good.fitted_centroids)

    _spoil_the_fit(monkeypatch)
    cal = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9)
    assert cal.stage1 == WEIGHT_ONLY and torch.equal(cal.centroids, res.centroids.float())
    assert not torch.equal(cal.fitted_centroids, cal.centroids)
    variants = cal.record()["stage1_variants"]
    assert variants[WEIGHT_ONLY]["n_probes_needed"] == cal.n_probes < variants[CALIBRATED]["n_probes_needed"]
    # The figures are the held-out states' own: recomputed independently for the weight-only vectors.
    held = hidden[cal.fit.heldout_rows]
    assert cal.n_probes >= _needs(res.centroids, weight, res.assignments, held)
    assert cal.record()["stage1"] == WEIGHT_ONLY and cal.record()["n_probes"] == cal.n_probes
    # Asked not to compare, the builder keeps the fitted vectors whatever they need.
    forced = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9, keep_best=False)
    assert forced.stage1 == CALIBRATED and forced.n_probes == variants[CALIBRATED]["n_probes_needed"]


def test_cli_build_writes_the_kept_stage1_and_records_both(make_model, tmp_path, monkeypatch, capsys):
    path, head = make_model(V, 32)
    states = tmp_path / "states.safetensors"
    save_file({"hidden_states": _states(head, 600, seed=2)}, str(states))
    common = ["flashhead", "build", str(path), "--no-progress", "--iterations", "4", "--target-agreement", "0.9"]
    assert main([*common, "--output", str(tmp_path / "none"), "--no-calibration"]) == 0
    _spoil_the_fit(monkeypatch)
    out_dir = tmp_path / "kept"
    assert main([*common, "--output", str(out_dir), "--calibration-hidden", str(states)]) == 0
    out = capsys.readouterr().out
    assert "kept the weight-only stage 1" in out
    record = read_config(out_dir)[CALIBRATION_KEY]
    assert record["stage1"] == WEIGHT_ONLY and record["source"] == "hidden_states"
    needed = {name: v["n_probes_needed"] for name, v in record["stage1_variants"].items()}
    assert needed[WEIGHT_ONLY] == record["n_probes"] == read_config(out_dir)["n_probes"] < needed[CALIBRATED]
    assert record["stage1_reason"].startswith("kept the weight-only stage 1")
    # The weight-only vectors are written: the same as a --no-calibration build's (same seed, same clusters).
    from safetensors.torch import load_file

    kept, base = (load_file(str(d / CACHE_DIR_NAME / CACHE_FILE_NAME)) for d in (out_dir, tmp_path / "none"))
    assert torch.equal(kept["centroids"], base["centroids"])
    # eval's summary line says which stage 1 serves.
    assert main(["flashhead", "eval", str(out_dir), "--hidden", str(states), "--probes", "4"]) == 0
    assert "the weight-only stage 1 was kept" in capsys.readouterr().out
