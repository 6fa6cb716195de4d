"""The build's stage-1 calibration (``my_pkg.flashhead.calibration.calibrate``): the probe count chosen on
held-out and validation states, and the stage 1 (calibrated or weight-only) that meets the promise with the
fewest probes, down to what ``my-pkg flashhead build`` writes."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import my_pkg.flashhead.calibration.calibrate as calibrate
from my_pkg.cli import main
from my_pkg.flashhead.assets import CACHE_DIR_NAME, CACHE_FILE_NAME, CALIBRATION_KEY, read_config
from my_pkg.flashhead.calibration import (
    CALIBRATED,
    WEIGHT_ONLY,
    agreement_curve,
    agreement_lower_bound,
    calibrate_stage1,
    cluster_targets,
    probes_needed,
)
from my_pkg.flashhead.synthetic import synthetic_hidden_states

from .conftest import lm_like_states

V = 1024


def test_calibrate_stage1_chooses_on_heldout_and_compares_with_weight_only(calibration_clusters):
    weight, res = calibration_clusters
    hidden = lm_like_states(weight, 2000, seed=4)
    cal = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=10)
    held = hidden[cal.fit.heldout_rows]
    targets = cluster_targets(weight, res.assignments, held)
    curve = agreement_curve(probes_needed(cal.centroids, held, targets), res.num_clusters)
    lower = agreement_lower_bound(curve, held.shape[0], 0.95)
    # The rule: the bound reaches the target and the estimate shows at most half the misses it allows (margin 2).
    ok = (lower >= 0.9) & (curve >= 0.95)
    assert ok[cal.n_probes] and not ok[cal.n_probes - 1] and cal.choice.certified
    assert cal.choice.agreement == pytest.approx(float(curve[cal.n_probes]))
    assert cal.weight_only.n_probes > cal.n_probes
    assert cal.weight_only_same_probes.n_probes == cal.n_probes
    record = cal.record()
    assert record["n_probes"] == cal.n_probes and record["heldout_rows"] == 400 and record["rows"] == 2000
    assert record["weight_only_heldout_agreement"] < record["heldout_agreement"]
    assert record["target_agreement"] == 0.9 and record["confidence"] == 0.95


def test_calibrate_stage1_writes_the_count_every_validation_set_needs(calibration_clusters):
    """A validation set from another distribution that needs more probes raises the written count; its record."""
    weight, res = calibration_clusters
    hidden = lm_like_states(weight, 2000, seed=4)
    shifted = synthetic_hidden_states(weight, 1500, noise=2.5, seed=9)  # no shared offset, noisier: other text
    alone = calibrate_stage1(weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=10)
    both = calibrate_stage1(
        weight, res.assignments, res.centroids, hidden, target_agreement=0.9, epochs=10, validation={"shifted": shifted}
    )
    assert torch.equal(alone.centroids, both.centroids)  # validation states never reach the fit
    rows, need, at = both.validation["shifted"]
    assert rows == 1500 and need.n_probes > alone.n_probes and both.n_probes >= need.n_probes
    targets = cluster_targets(weight, res.assignments, shifted)
    curve = agreement_curve(probes_needed(both.centroids, shifted, targets), res.num_clusters)
    assert float(curve[both.n_probes]) >= 0.95 and at.agreement == pytest.approx(float(curve[both.n_probes]))
    record = both.record()
    assert record["validation"]["shifted"]["rows"] == 1500 and record["validation_rows"] == 400 + 1500
    assert record["validation_agreement_lower_bound"] >= 0.9 and record["margin"] == 2.0


def test_calibrate_stage1_rejects_a_probe_count_beyond_the_clusters(calibration_clusters):
    weight, res = calibration_clusters
    hidden = lm_like_states(weight, 50, seed=1)
    with pytest.raises(ValueError, match="n_probes"):
        calibrate_stage1(weight, res.assignments, res.centroids, hidden, n_probes=res.num_clusters + 1)


def _states(weight: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Plain synthetic states (no shared offset)."""
    return synthetic_hidden_states(weight, n, noise=1.5, seed=seed)


def _spoil_the_fit(monkeypatch):
    """A fit that returns random vectors: the calibrated stage 1 then clearly needs more probes."""
    real = calibrate.fit_stage1

    def spoiled(*args, **kwargs):
        result = real(*args, **{**kwargs, "epochs": 1})
        result.centroids = torch.randn(result.centroids.shape, generator=torch.Generator().manual_seed(0))
        return result

    monkeypatch.setattr(calibrate, "fit_stage1", spoiled)


def _needs(centroids, weight, assignments, states, target=0.9):
    needed = probes_needed(centroids, states, cluster_targets(weight, assignments, states))
    curve = agreement_curve(needed, int(assignments.max()) + 1)
    return int(torch.nonzero(curve >= 1 - (1 - target) / 2).flatten()[0])


def test_calibrate_stage1_keeps_weight_only_when_the_fit_needs_more_probes(calibration_clusters, monkeypatch):
    weight, res = calibration_clusters
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
    kept, base = (load_file(str(d / CACHE_DIR_NAME / CACHE_FILE_NAME)) for d in (out_dir, tmp_path / "none"))
    assert torch.equal(kept["centroids"], base["centroids"])
    # eval's summary line says which stage 1 serves.
    assert main(["flashhead", "eval", str(out_dir), "--hidden", str(states), "--probes", "4"]) == 0
    assert "the weight-only stage 1 was kept" in capsys.readouterr().out
