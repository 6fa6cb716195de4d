"""Data-aware stage 1: fit the centroid vectors to hidden states, and choose the probe count they need.

The package's public API; each module has one job:

* :mod:`.fit`: dense targets of hidden states and the stage-1 fit (the objective is in its docstring);
* :mod:`.choice`: the statistics behind the probe count (agreement curves, Wilson bounds, the probe rule,
  the comparison of the calibrated and weight-only stage 1);
* :mod:`.calibrate`: :func:`calibrate_stage1`, what a build runs: fit, choose, keep;
* :mod:`.self_calibration`: hidden states of the dense model's own samples, for a build without text.

Torch only: loading a Hugging Face model is :mod:`my_pkg.flashhead.hf`'s job.
"""

from __future__ import annotations

from .calibrate import StageOneCalibration, calibrate_stage1
from .choice import (
    CALIBRATED,
    PROBE_MARGIN,
    WEIGHT_ONLY,
    ProbeChoice,
    ProbeRule,
    agreement_curve,
    agreement_lower_bound,
    apply_probe_rule,
    choose_n_probes,
    keep_stage1,
    probes_needed,
    scored_fraction,
)
from .fit import CalibrationResult, ClusterTargets, cluster_targets, fit_stage1, split_rows
from .self_calibration import SELF_CALIBRATION_PROMPTS, SelfCalibration, generate_calibration_states

__all__ = [
    "ClusterTargets",
    "CalibrationResult",
    "ProbeChoice",
    "StageOneCalibration",
    "cluster_targets",
    "split_rows",
    "fit_stage1",
    "probes_needed",
    "agreement_curve",
    "agreement_lower_bound",
    "scored_fraction",
    "choose_n_probes",
    "calibrate_stage1",
    "ProbeRule",
    "apply_probe_rule",
    "keep_stage1",
    "CALIBRATED",
    "WEIGHT_ONLY",
    "PROBE_MARGIN",
    "SELF_CALIBRATION_PROMPTS",
    "SelfCalibration",
    "generate_calibration_states",
]
