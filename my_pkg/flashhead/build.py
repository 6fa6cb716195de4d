"""Build FlashHead's assets for a model directory (:func:`build_assets`, what ``my-pkg flashhead build`` runs).

1. Read the LM head (``vocab_size`` rows) and check ``n_probes`` against the cluster count.
2. Gather the calibration states (:mod:`.calibration_states`), before anything is written.
3. Cluster the head's rows (:func:`~.clustering.balanced_kmeans`).
4. With calibration states: fit stage 1 and choose ``n_probes`` (:func:`~.calibration.calibrate_stage1`), then fit
   sampled rows' tail estimate to the same states.
5. Write the clustering cache, the tail estimate (a weight-only build removes a stale one) and config.json, in the
   model directory or in a converted copy (``output``).

Never prints: each step is told to a :class:`~.build_report.BuildProgress`, and the result is a
:class:`~.build_report.BuildReport`. Bad input raises ``ValueError`` (or :class:`~.assets.FlashHeadAssetError`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .assets import (
    CACHE_DIR_NAME,
    TAIL_FILE_NAME,
    load_lm_head,
    prepare_output_dir,
    read_config,
    save_clustering_cache,
    save_tail_factors,
    stop_and_special_token_ids,
    text_config,
    update_config,
)
from .build_report import BuildOptions, BuildProgress, BuildReport, CalibrationFit, HeadShape, QuietProgress
from .calibration import calibrate_stage1
from .calibration_states import CalibrationStates, WeightOnly, calibration_states, validation_states
from .clustering import ClusteringResult, balanced_kmeans, cluster_capacities
from .spec import default_n_probes
from .tail_estimate import TailFactors, default_tail_rank, fit_tail_factors

__all__ = ["build_assets"]


def build_assets(
    model_dir: str | Path, options: BuildOptions | None = None, progress: BuildProgress | None = None
) -> BuildReport:
    """Build and write the assets of ``model_dir`` as ``options`` say; see the module docstring for the steps."""
    model_dir = Path(model_dir)
    options = options or BuildOptions()
    progress = progress or QuietProgress()
    config = read_config(model_dir)
    weight, key = load_lm_head(model_dir, config)
    vocab = text_config(config).get("vocab_size", config.get("vocab_size"))
    v = weight.shape[0] if vocab is None else int(vocab)
    if v > weight.shape[0]:
        raise ValueError(f"config vocab_size {v} exceeds the {weight.shape[0]} rows of {key}")
    weight = weight[:v]
    n_clusters = cluster_capacities(v, options.cluster_size).numel()
    n_probes = options.n_probes if options.n_probes is not None else default_n_probes(n_clusters)
    if n_probes > n_clusters:
        raise ValueError(f"--n-probes {n_probes} exceeds the {n_clusters} clusters")
    states = calibration_states(model_dir, options, weight.shape[1], progress)
    target = prepare_output_dir(model_dir, options.output) if options.output else model_dir
    head = HeadShape(key, v, int(weight.shape[1]), weight.dtype, n_clusters, options.cluster_size, options.device)
    progress.clustering(head)
    t0 = time.perf_counter()
    res = balanced_kmeans(
        weight,
        options.cluster_size,
        iterations=options.iterations,
        seed=options.seed,
        device=options.device,
        progress=options.progress,
    )
    cluster_seconds = time.perf_counter() - t0
    progress.clustered(cluster_seconds)
    centroids, fit, tail = res.centroids, None, None
    if isinstance(states, WeightOnly):
        record = {"source": "none", "reason": states.reason}
    else:
        pinned = stop_and_special_token_ids(model_dir, config)
        fit = _calibrate(model_dir, options, weight, res, states, pinned, progress)
        centroids, n_probes = fit.result.centroids, fit.result.n_probes
        record = {**fit.result.record(), "source": states.source}
        if states.self_calibration is not None:
            record["self_calibration"] = states.self_calibration
        tail = _fit_tail(weight, states.hidden, options.device, progress)
        record["tail_estimate"] = {"rank": tail.rank, "states": int(states.hidden.shape[0])}
    path = save_clustering_cache(target, centroids, res.assignments)
    _write_tail(target, tail)
    update_config(target, n_probes, calibration=record)
    return BuildReport(
        target=Path(target),
        cache_path=path,
        head=head,
        cluster_seconds=cluster_seconds,
        n_probes=n_probes,
        calibration_record=record,
        calibration=fit,
        weight_only_reason=states.reason if isinstance(states, WeightOnly) else None,
        tail_rank=None if tail is None else tail.rank,
    )


def _calibrate(
    model_dir: Path,
    options: BuildOptions,
    weight: torch.Tensor,
    clustering: ClusteringResult,
    states: CalibrationStates,
    pinned: list[int],
    progress: BuildProgress,
) -> CalibrationFit:
    """Fit the stage-1 vectors to the calibration states and choose ``n_probes``."""
    validation = validation_states(model_dir, options, progress) if states.source != "self" else {}
    t0 = time.perf_counter()
    result = calibrate_stage1(
        weight,
        clustering.assignments,
        clustering.centroids,
        states.hidden,
        pinned_ids=pinned,
        target_agreement=options.target_agreement,
        confidence=options.target_confidence,
        n_probes=options.n_probes,
        seed=options.seed,
        margin=options.probe_margin,
        validation=validation,
        device=options.device,
        progress=options.progress,
    )
    fit = CalibrationFit(result, states.source, int(states.hidden.shape[0]), time.perf_counter() - t0)
    progress.calibrated(fit)
    return fit


def _fit_tail(weight: torch.Tensor, hidden: torch.Tensor, device: str, progress: BuildProgress) -> TailFactors:
    """Sampled rows' tail estimate fitted to the calibration states (``tail_estimate.safetensors``)."""
    t0 = time.perf_counter()
    rank = min(default_tail_rank(weight.shape[1]), *weight.shape)
    factors = fit_tail_factors(weight.to(device), weight.shape[0], rank, hidden.to(device))
    progress.tail_fitted(rank, time.perf_counter() - t0)
    return factors


def _write_tail(target: Path, factors: TailFactors | None) -> None:
    """Write the fitted tail estimate, or remove a stale one (a weight-only build serves the weight-only estimate)."""
    if factors is not None:
        save_tail_factors(target, factors)
    else:
        (Path(target) / CACHE_DIR_NAME / TAIL_FILE_NAME).unlink(missing_ok=True)
