"""Evaluate a model directory's FlashHead assets against its dense head (:func:`evaluate_assets`, what
``my-pkg flashhead eval`` runs).

1. Read the assets and the LM head, and build the head with serving's settings (config.json, then the
   environment: :meth:`~.head.FlashHead.from_settings`), so the eval measures what a server would do.
2. Take at most ``samples`` hidden states: from a safetensors file, from the model run on a text, or synthetic.
3. Measure the serving fidelity at the probe counts (:func:`~.fidelity.serving_fidelity`), with the model's
   stop and special ids pinned and its own final-logit soft-cap / scale.
4. Optionally draw the fidelity curves into a PNG (:mod:`.plot`), and run the timed sweep
   (:func:`~.evaluate.evaluate`) with the dense head's own rounding (:func:`~.evaluate.dense_agreement`).

Never prints: the result is an :class:`EvalReport`. Bad input raises ``ValueError`` (or
:class:`~.assets.FlashHeadAssetError`; :class:`~.plot.PlotUnavailable` before any work without matplotlib).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .assets import (
    CALIBRATION_KEY,
    load_assets,
    load_lm_head,
    load_tail_factors,
    read_config,
    stop_and_special_token_ids,
)
from .build_report import DEFAULT_TARGET_AGREEMENT
from .curves import fidelity_curves, plot_probe_counts
from .evaluate import EvalRow, dense_agreement, evaluate, load_hidden_states
from .fidelity import ServingFidelity, logit_postprocess, serving_fidelity
from .head import FlashHead
from .hf import capture_hidden_states
from .settings import default_settings
from .synthetic import synthetic_hidden_states

__all__ = ["EvalOptions", "EvalReport", "evaluate_assets", "calibration_summary", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def calibration_summary(record: Any) -> str:
    """One line on how the assets' stage 1 was built, from config.json's ``flash_head_calibration``."""
    if not isinstance(record, dict):
        return "weight-only (no calibration record: built before calibration was recorded)"
    source = record.get("source")
    if source == "none":
        return f"weight-only ({record.get('reason', 'no reason recorded')})"
    what = {
        "self": "the model's own samples (self-calibration)",
        "text": "a calibration text",
        "hidden_states": "calibration hidden states",
    }.get(source, str(source))
    kept = record.get("stage1", "calibrated")
    summary = (
        f"calibrated on {record.get('rows', '?'):,} states of {what}; n_probes {record.get('n_probes')} chosen "
        f"for top-1 agreement {record.get('target_agreement')}"
    )
    if kept == "weight_only":
        summary += "; the weight-only stage 1 was kept (it needs fewer probes)"
    return summary


@dataclass(frozen=True)
class EvalOptions:
    """What to evaluate on; the defaults are the CLI's. Without ``hidden_states`` or ``text``: synthetic states."""

    hidden_states: Path | None = None  # safetensors with [N, hidden] states (key hidden_states)
    text: Path | None = None  # a text file: capture states by running the model
    probes: tuple[int, ...] | None = None  # probe counts (clamped to the clusters); None: the n_probes serving uses
    samples: int = 1000
    seed: int = 0
    device: str = "cpu"
    sweep: bool = True  # also the timed sweep (evaluate) and the dense head's own rounding
    plot: Path | None = None  # also a PNG of the fidelity curves here


@dataclass
class EvalReport:
    """What an eval measured, and on what: the served head, the states, the fidelity (and the sweep, the plot)."""

    model_dir: Path
    source: str  # "file", "text" or "synthetic"
    source_path: Path | None  # the states file or the text
    device: str
    hidden_states: int
    hidden_dtype: torch.dtype
    dtype: torch.dtype  # the head weight's
    vocab_size: int
    num_clusters: int
    cluster_size: int
    backend: str
    tail_fitted: bool  # sampled rows use the estimate fitted to the calibration states
    calibration: Any  # config.json's flash_head_calibration, as written (None without one)
    pinned: list[int]  # ids scored exactly on every row
    fidelity: list[ServingFidelity]
    sweep: list[EvalRow] | None = None
    dense_ms: float | None = None  # the dense step's time (ms, batch 1), with the sweep
    dense_agreement: float | None = None  # with the sweep, a head below float32: its argmax against float32's
    plot: Path | None = None  # the PNG written

    def fidelity_record(self) -> dict[str, Any]:
        """The serving fidelity as ``eval --json`` prints it."""
        return {
            "model": str(self.model_dir),
            "hidden_states": self.hidden_states,
            "dtype": dtype_name(self.dtype),
            "calibration": self.calibration,
            "tail_estimate": "fitted" if self.tail_fitted else "weight-only",
            "results": [r.as_dict() for r in self.fidelity],
        }


def evaluate_assets(model_dir: str | Path, options: EvalOptions | None = None) -> EvalReport:
    """Evaluate ``model_dir``'s assets as ``options`` say; see the module docstring for the steps."""
    model_dir = Path(model_dir)
    options = options or EvalOptions()
    if options.plot is not None:
        from .plot import require_matplotlib

        require_matplotlib()  # before any work: a missing extra fails at once
    config = read_config(model_dir)
    cent, assign = load_assets(model_dir, config)
    weight, _ = load_lm_head(model_dir, config)
    v = assign.numel()
    hidden, source, source_path = _hidden_states(model_dir, options, weight, v)
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden states must be [N, {weight.shape[1]}], got {tuple(hidden.shape)}")
    hidden = hidden[: options.samples].to(options.device)
    settings = default_settings(config, int(cent.shape[0]))
    head = FlashHead.from_settings(
        weight.to(options.device),
        cent,
        assign,
        vocab_size=v,
        tail_factors=load_tail_factors(model_dir, config),
        settings=settings,
    )
    if options.probes is not None:
        probes = sorted({min(p, head.num_clusters) for p in options.probes})
    else:
        probes = [settings.n_probes]
    pinned = stop_and_special_token_ids(model_dir, config)
    postprocess = logit_postprocess(config)
    report = EvalReport(
        model_dir=model_dir,
        source=source,
        source_path=source_path,
        device=options.device,
        hidden_states=int(hidden.shape[0]),
        hidden_dtype=hidden.dtype,
        dtype=weight.dtype,
        vocab_size=v,
        num_clusters=head.num_clusters,
        cluster_size=head.cluster_size,
        backend=head.backend,
        tail_fitted=head.tail_fitted,
        calibration=config.get(CALIBRATION_KEY),
        pinned=pinned,
        fidelity=serving_fidelity(head, hidden, probes, pinned=pinned, postprocess=postprocess),
    )
    if options.plot is not None:
        report.plot = _plot(options.plot, model_dir, head, hidden, probes, pinned, config)
    if options.sweep:
        report.sweep, report.dense_ms = evaluate(head, hidden, probes)
        if weight.is_floating_point() and weight.element_size() < 4:
            report.dense_agreement = dense_agreement(head, hidden)
    return report


def _hidden_states(
    model_dir: Path, options: EvalOptions, weight: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, str, Path | None]:
    """``(hidden, source, path)``: the states to evaluate on, before the ``samples`` cut."""
    if options.hidden_states and options.text:
        raise ValueError("give --hidden or --text, not both")
    if options.hidden_states:
        return load_hidden_states(options.hidden_states), "file", options.hidden_states
    if options.text:
        try:
            text = options.text.read_text()
        except OSError as e:
            raise ValueError(f"cannot read {options.text}: {e}") from None
        hidden = capture_hidden_states(model_dir, text, max_tokens=options.samples, device=options.device)
        return hidden, "text", options.text
    return synthetic_hidden_states(weight, options.samples, seed=options.seed, vocab_size=vocab_size), "synthetic", None


def _plot(
    path: Path,
    model_dir: Path,
    head: FlashHead,
    hidden: torch.Tensor,
    probes: list[int],
    pinned: list[int],
    config: dict[str, Any],
) -> Path:
    """The agreement and sampled-TV curves as a PNG, with the calibration's target drawn (the default without one)."""
    from .plot import plot_fidelity

    record = config.get(CALIBRATION_KEY)
    target = record.get("target_agreement") if isinstance(record, dict) else None
    target = float(target) if isinstance(target, (int, float)) else DEFAULT_TARGET_AGREEMENT
    curves = fidelity_curves(
        head,
        hidden,
        plot_probe_counts(head.num_clusters, head.n_probes, probes),
        pinned=pinned,
        postprocess=logit_postprocess(config),
    )
    title = (
        f"{model_dir.name}: FlashHead vs the dense head on {hidden.shape[0]:,} hidden states "
        f"(vocab {head.vocab_size:,}, {head.num_clusters:,} clusters of {head.cluster_size})"
    )
    return plot_fidelity(path, curves, served_n_probes=head.n_probes, target_agreement=target, title=title)
