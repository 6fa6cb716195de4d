"""The hidden states a build fits stage 1 to, and the model's own samples that validate a text's ``n_probes``.

Sources, by :class:`~.build_report.BuildOptions`: a text run through the model, a safetensors file, or the model's
own samples (self-calibration). Runs before the build writes anything: bad input raises ``ValueError`` with the
reason and leaves the model directory untouched. A model that cannot run makes the build weight-only
(:class:`WeightOnly`) rather than fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .build_report import MIN_CALIBRATION_STATES, NO_CALIBRATION_REASON, BuildOptions, BuildProgress
from .calibration import SELF_CALIBRATION_PROMPTS, generate_calibration_states
from .evaluate import load_hidden_states
from .hf import capture_hidden_states, load_causal_lm

__all__ = ["CalibrationStates", "WeightOnly", "calibration_states", "validation_states"]


@dataclass
class CalibrationStates:
    """Checked states to fit stage 1 to, and where they came from."""

    hidden: torch.Tensor  # [N, H] float32
    source: str  # "text", "hidden_states" or "self"
    self_calibration: dict[str, Any] | None = None  # how the model's own samples were made (source "self")


@dataclass
class WeightOnly:
    """No calibration states: the build's stage 1 is weight-only."""

    reason: str  # config.json's record of why


def calibration_states(
    model_dir: Path, options: BuildOptions, hidden_size: int, progress: BuildProgress
) -> CalibrationStates | WeightOnly:
    """The states ``options`` ask for, checked against the head's ``hidden_size``; or why the build is weight-only."""
    if options.calibration_text is not None:
        path = options.calibration_text
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read calibration text {path}: {e}") from None
        if not text.strip():
            raise ValueError(f"calibration text {path} is empty")
        progress.capturing(path)
        hidden = capture_hidden_states(
            model_dir,
            text,
            max_tokens=options.calibration_max_tokens,
            device=options.device,
            progress=options.progress,
        )
        source = "text"
    elif options.calibration_hidden is not None:
        path = options.calibration_hidden
        if not path.is_file():
            raise ValueError(f"calibration hidden states {path} not found")
        try:
            hidden = load_hidden_states(path)
        except Exception as e:  # noqa: BLE001 - safetensors reports a malformed file with its own types
            raise ValueError(f"cannot read calibration hidden states {path}: {e}") from None
        source = "hidden_states"
    elif options.self_calibration:
        return _self_calibration_states(model_dir, options, progress)
    else:
        return WeightOnly(NO_CALIBRATION_REASON)
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(
            f"calibration hidden states must be [N, {hidden_size}] (the head's hidden size), got {tuple(hidden.shape)}"
        )
    if hidden.shape[0] < MIN_CALIBRATION_STATES:
        raise ValueError(f"calibration needs at least {MIN_CALIBRATION_STATES} hidden states, got {hidden.shape[0]}")
    if not bool(torch.isfinite(hidden).all()):
        raise ValueError("calibration hidden states contain non-finite values")
    return CalibrationStates(hidden.float(), source)


def _self_calibration_states(
    model_dir: Path, options: BuildOptions, progress: BuildProgress
) -> CalibrationStates | WeightOnly:
    """States of the model's own samples; weight-only when the checkpoint cannot be run (no ``transformers``, a
    head-only file, an unknown architecture) or gives too few."""
    try:
        model, tokenizer = load_causal_lm(model_dir, options.device)
    except RuntimeError as e:
        reason = f"cannot run the model: {e}"
        progress.cannot_self_calibrate(reason)
        return WeightOnly(reason)
    progress.sampling(len(SELF_CALIBRATION_PROMPTS))
    sample = generate_calibration_states(
        model,
        tokenizer,
        max_states=options.self_calibration_states,
        time_budget_s=float(options.self_calibration_seconds),
        seed=options.seed,
        progress=options.progress,
    )
    del model
    progress.sampled(sample)
    if sample.hidden.shape[0] < MIN_CALIBRATION_STATES:
        reason = f"self-calibration sampled only {sample.hidden.shape[0]} states"
        progress.too_few_samples(reason)
        return WeightOnly(reason)
    return CalibrationStates(sample.hidden.float(), "self", self_calibration=sample.record())


def validation_states(model_dir: Path, options: BuildOptions, progress: BuildProgress) -> dict[str, torch.Tensor]:
    """States of the model's own samples to validate a text's or file's ``n_probes`` on (empty when it cannot run)."""
    if options.validation_states == 0:
        return {}
    try:
        model, tokenizer = load_causal_lm(model_dir, options.device)
    except RuntimeError as e:
        progress.validating_on_heldout_only(str(e))
        return {}
    sample = generate_calibration_states(
        model,
        tokenizer,
        max_states=options.validation_states,
        seed=options.seed + 1,
        time_budget_s=float(options.self_calibration_seconds),
        progress=options.progress,
    )
    if sample.hidden.shape[0] < MIN_CALIBRATION_STATES:
        return {}
    return {"model samples": sample.hidden}
