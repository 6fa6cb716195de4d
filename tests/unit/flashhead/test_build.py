"""``build_assets``: what it writes, what it tells while it runs, and the report it returns."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from my_pkg.cli import build_parser
from my_pkg.flashhead.assets import CACHE_DIR_NAME, CALIBRATION_KEY, read_config
from my_pkg.flashhead.build import build_assets
from my_pkg.flashhead.build_report import BuildOptions, BuildProgress
from my_pkg.flashhead.calibration import PROBE_MARGIN

QUICK = {"iterations": 4, "progress": False}


class Recorder(BuildProgress):
    """Records the name of each step the build tells."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def __getattribute__(self, name: str):
        if name in BuildProgress.__dict__ and not name.startswith("_"):
            self.steps.append(name)
        return object.__getattribute__(self, name)


def _states(head: torch.Tensor, n: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, head.shape[0], (n,), generator=g)
    return 4.0 * head[targets] + torch.randn(n, head.shape[1], generator=g)


def test_weight_only_build_reports_what_it_wrote(make_model):
    model, _ = make_model()
    progress = Recorder()
    report = build_assets(model, BuildOptions(n_probes=3, self_calibration=False, **QUICK), progress)
    assert progress.steps == ["clustering", "clustered"]
    config = read_config(model)
    assert report.n_probes == config["n_probes"] == 3
    assert report.calibration_record == config[CALIBRATION_KEY] == {"source": "none", "reason": "--no-calibration"}
    assert report.weight_only_reason == "--no-calibration" and report.calibration is None and report.tail_rank is None
    assert report.target == model and report.cache_path.is_file() and report.cache_path.parent.name == CACHE_DIR_NAME
    assert (report.head.key, report.head.vocab_size, report.head.hidden_size) == ("lm_head.weight", 200, 24)
    assert report.head.num_clusters == 13 and report.uneven_clusters  # 200 = 8 x 16 + 5 x 15


def test_a_checkpoint_that_cannot_run_builds_weight_only_and_says_why(make_model, tmp_path):
    model, _ = make_model(256, 32)
    progress = Recorder()
    report = build_assets(model, BuildOptions(output=tmp_path / "out", **QUICK), progress)
    assert progress.steps == ["cannot_self_calibrate", "clustering", "clustered"]
    assert report.weight_only_reason.startswith("cannot run the model")
    assert report.target == (tmp_path / "out").resolve() and not report.uneven_clusters
    assert read_config(tmp_path / "out")[CALIBRATION_KEY]["reason"] == report.weight_only_reason


def test_build_calibrated_on_a_states_file(make_model, tmp_path):
    model, head = make_model()
    states = tmp_path / "states.safetensors"
    save_file({"hidden_states": _states(head, 600)}, str(states))
    options = BuildOptions(calibration_hidden=states, target_agreement=0.9, validation_states=0, **QUICK)
    progress = Recorder()
    report = build_assets(model, options, progress)
    assert progress.steps == ["clustering", "clustered", "calibrated", "tail_fitted"]
    fit = report.calibration
    assert fit is not None and (fit.source, fit.states) == ("hidden_states", 600)
    assert report.n_probes == fit.result.n_probes == read_config(model)["n_probes"]
    assert report.calibration_record["source"] == "hidden_states" and report.weight_only_reason is None
    assert report.calibration_record["tail_estimate"] == {"rank": report.tail_rank, "states": 600}


@pytest.mark.parametrize(("rows", "message"), [(5, "at least 20"), (600, "non-finite")])
def test_bad_states_raise_before_anything_is_written(make_model, tmp_path, rows, message):
    model, head = make_model()
    hidden = _states(head, rows)
    hidden[0, 0] = float("nan")
    states = tmp_path / "states.safetensors"
    save_file({"hidden_states": hidden}, str(states))
    with pytest.raises(ValueError, match=message):
        build_assets(model, BuildOptions(calibration_hidden=states, **QUICK))
    assert not (model / CACHE_DIR_NAME).exists() and "n_probes" not in read_config(model)


def test_the_clis_defaults_are_the_librarys():
    args = build_parser().parse_args(["flashhead", "build", "model"])
    defaults = BuildOptions()
    flags = {"device": "auto", "progress": True, "calibration_text": None, "self_calibration": True}
    for field in dataclasses.fields(BuildOptions):
        if field.name not in flags:
            assert getattr(args, field.name) == getattr(defaults, field.name), field.name
    assert defaults.probe_margin == PROBE_MARGIN
