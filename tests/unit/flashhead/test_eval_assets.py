"""``evaluate_assets``: the report of an eval, and the stage-1 summary of config.json's record."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from my_pkg.cli import build_parser
from my_pkg.flashhead.build import build_assets
from my_pkg.flashhead.build_report import BuildOptions
from my_pkg.flashhead.eval_assets import EvalOptions, calibration_summary, evaluate_assets


@pytest.fixture
def built(make_model, tmp_path):
    """A weight-only build (13 clusters, n_probes 2) and a file of 40 states."""
    model, head = make_model()
    build_assets(model, BuildOptions(n_probes=2, self_calibration=False, iterations=4, progress=False))
    states = tmp_path / "states.safetensors"
    save_file({"hidden_states": 4.0 * head[:40] + torch.randn(40, head.shape[1])}, str(states))
    return model, states


def test_eval_of_a_states_file_at_the_served_probe_count(built):
    model, states = built
    report = evaluate_assets(model, EvalOptions(hidden_states=states, sweep=False))
    assert (report.source, report.source_path, report.hidden_states) == ("file", states, 40)
    assert [r.n_probes for r in report.fidelity] == [2]  # config.json's, as serving uses
    assert report.sweep is None and report.dense_ms is None and report.dense_agreement is None
    assert (report.vocab_size, report.num_clusters, report.cluster_size) == (200, 13, 16)
    assert report.calibration == {"source": "none", "reason": "--no-calibration"} and not report.tail_fitted
    record = report.fidelity_record()
    assert record["model"] == str(model) and record["dtype"] == "float32" and record["tail_estimate"] == "weight-only"
    assert record["results"] == [report.fidelity[0].as_dict()]


def test_eval_on_synthetic_states_sweeps_the_clamped_probe_counts(built):
    model, _ = built
    report = evaluate_assets(model, EvalOptions(probes=(99, 1, 13), samples=30))
    assert report.source == "synthetic" and report.source_path is None and report.hidden_states == 30
    assert [r.n_probes for r in report.fidelity] == [1, 13]
    assert [r.n_probes for r in report.sweep] == [1, 13] and report.sweep[1].top1 == 1.0
    assert report.dense_ms > 0 and report.dense_agreement is None  # a float32 head has no rounding to report


def test_eval_refuses_two_sources_and_a_wrong_width(built, tmp_path):
    model, states = built
    with pytest.raises(ValueError, match="not both"):
        evaluate_assets(model, EvalOptions(hidden_states=states, text=tmp_path / "t.txt"))
    wide = tmp_path / "wide.safetensors"
    save_file({"hidden_states": torch.randn(5, 25)}, str(wide))
    with pytest.raises(ValueError, match=r"must be \[N, 24\]"):
        evaluate_assets(model, EvalOptions(hidden_states=wide))


def test_the_clis_defaults_are_the_librarys():
    args = build_parser().parse_args(["flashhead", "eval", "model"])
    assert (args.samples, args.seed) == (EvalOptions().samples, EvalOptions().seed)


@pytest.mark.parametrize(
    ("record", "summary"),
    [
        (None, "weight-only (no calibration record: built before calibration was recorded)"),
        ({"source": "none", "reason": "--no-calibration"}, "weight-only (--no-calibration)"),
        (
            {"source": "text", "rows": 1500, "n_probes": 4, "target_agreement": 0.99},
            "calibrated on 1,500 states of a calibration text; n_probes 4 chosen for top-1 agreement 0.99",
        ),
        (
            {"source": "self", "rows": 600, "n_probes": 3, "target_agreement": 0.995, "stage1": "weight_only"},
            "calibrated on 600 states of the model's own samples (self-calibration); n_probes 3 chosen for top-1 "
            "agreement 0.995; the weight-only stage 1 was kept (it needs fewer probes)",
        ),
    ],
)
def test_calibration_summary(record, summary):
    assert calibration_summary(record) == summary
