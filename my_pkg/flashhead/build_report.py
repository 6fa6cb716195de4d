"""What a build takes, tells while it runs, and returns (:func:`my_pkg.flashhead.build.build_assets`).

The build never prints: it tells a :class:`BuildProgress` each step, in order (the CLI's printer is one, and
prints a line for each as it happens), and returns a :class:`BuildReport`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .calibration import PROBE_MARGIN, SelfCalibration, StageOneCalibration

__all__ = [
    "DEFAULT_TARGET_AGREEMENT",
    "MIN_CALIBRATION_STATES",
    "NO_CALIBRATION_REASON",
    "BuildOptions",
    "HeadShape",
    "CalibrationFit",
    "BuildReport",
    "BuildProgress",
    "QuietProgress",
]

#: The default top-1 agreement a calibrated build chooses ``n_probes`` for.
DEFAULT_TARGET_AGREEMENT = 0.995
#: Fewer calibration states than this cannot show anything: a text or file is refused, self-calibration skipped.
MIN_CALIBRATION_STATES = 20
#: config.json's weight-only reason when no calibration was asked for (the CLI flag's name, as users read it).
NO_CALIBRATION_REASON = "--no-calibration"


@dataclass(frozen=True)
class BuildOptions:
    """How to build; the defaults are the CLI's.

    Stage 1 is calibrated on ``calibration_text`` (run through the model), else on ``calibration_hidden``
    (safetensors, key ``hidden_states``), else on the model's own samples when ``self_calibration`` (weight-only,
    with a reason, when the model cannot run); without any of them it is weight-only.
    """

    cluster_size: int = 16
    n_probes: int | None = None  # None: about 1/32 of the clusters; calibrated: the smallest reaching the target
    seed: int = 0
    iterations: int = 20
    device: str = "cpu"
    output: Path | None = None  # write a converted copy here instead of editing the model directory
    progress: bool = True  # tqdm bars on stderr
    calibration_text: Path | None = None
    calibration_hidden: Path | None = None
    self_calibration: bool = True
    self_calibration_states: int = 8192
    self_calibration_seconds: int = 600
    validation_states: int = 4096  # a file's or text's n_probes is also validated on this many own samples
    probe_margin: float = PROBE_MARGIN
    calibration_max_tokens: int = 16384
    target_agreement: float = DEFAULT_TARGET_AGREEMENT
    target_confidence: float = 0.95


@dataclass(frozen=True)
class HeadShape:
    """The head a build clusters: its checkpoint key, ``vocab_size`` rows of ``hidden_size``, and the clusters."""

    key: str
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    num_clusters: int
    cluster_size: int
    device: str


@dataclass
class CalibrationFit:
    """Stage 1 fitted to ``states`` hidden states of ``source`` (``text``, ``hidden_states`` or ``self``)."""

    result: StageOneCalibration
    source: str
    states: int
    seconds: float


@dataclass
class BuildReport:
    """What a build wrote: the clustering cache at ``cache_path`` and config.json in ``target``."""

    target: Path
    cache_path: Path
    head: HeadShape
    cluster_seconds: float
    n_probes: int
    calibration_record: dict[str, Any]  # config.json's flash_head_calibration
    calibration: CalibrationFit | None = None  # None: weight-only stage 1
    weight_only_reason: str | None = None
    tail_rank: int | None = None  # rank of the fitted tail estimate (None: the weight-only estimate serves)

    @property
    def uneven_clusters(self) -> bool:
        """The vocabulary is not a multiple of the cluster size: cluster sizes differ by one."""
        return self.head.vocab_size % self.head.cluster_size != 0


class BuildProgress(Protocol):
    """What a build tells while it runs, in the order it happens (a class that subclasses this one inherits
    methods that do nothing)."""

    def capturing(self, text_file: Path) -> None:
        """The model is about to run on a calibration text."""

    def cannot_self_calibrate(self, reason: str) -> None:
        """The model cannot run: the build is weight-only."""

    def sampling(self, prompts: int) -> None:
        """Self-calibration is about to sample the model from ``prompts`` prompts."""

    def sampled(self, sample: SelfCalibration) -> None:
        """Self-calibration sampled ``sample.hidden`` states."""

    def too_few_samples(self, reason: str) -> None:
        """Self-calibration sampled too few states: the build is weight-only."""

    def validating_on_heldout_only(self, reason: str) -> None:
        """The model cannot run: a text's or file's ``n_probes`` is validated on the held-out states only."""

    def clustering(self, head: HeadShape) -> None:
        """The head's rows are about to be clustered."""

    def clustered(self, seconds: float) -> None:
        """The clustering is done."""

    def calibrated(self, fit: CalibrationFit) -> None:
        """Stage 1 is fitted and ``n_probes`` chosen."""

    def tail_fitted(self, rank: int, seconds: float) -> None:
        """Sampled rows' tail estimate is fitted to the calibration states."""


class QuietProgress(BuildProgress):
    """Tells nothing: the build's default."""
