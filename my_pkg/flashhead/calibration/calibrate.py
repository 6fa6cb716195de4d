"""The build's stage-1 calibration: fit the vectors, choose ``n_probes``, keep the better stage 1.

:func:`calibrate_stage1` runs the stages in order and returns a :class:`StageOneCalibration`, whose
``record()`` is what config.json keeps under ``flash_head_calibration``:

1. dense float32 targets of every state (:func:`~.fit.cluster_targets`);
2. the fit, early-stopped on a held-out split (:func:`~.fit.fit_stage1`);
3. the probe count, judged on the held-out split and on every validation set (:func:`~.choice.apply_probe_rule`);
4. the fitted and the weight-only stage 1 compared under that rule (:func:`~.choice.keep_stage1`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .choice import (
    CALIBRATED,
    PROBE_MARGIN,
    WEIGHT_ONLY,
    ProbeChoice,
    ProbeRule,
    apply_probe_rule,
    check_target,
    choose_n_probes,
    keep_stage1,
    probes_needed,
)
from .fit import CalibrationResult, ClusterTargets, cluster_targets, fit_stage1

__all__ = ["StageOneCalibration", "calibrate_stage1"]


@dataclass
class StageOneCalibration:
    """Outcome of :func:`calibrate_stage1`: the vectors to write, the probe count and the evidence.

    ``choice``: the kept vectors at the probe count to write (held-out split).  ``weight_only``: the
    weight-only vectors on the held-out split at the count the rule gives them; ``weight_only_same_probes``:
    them at ``choice.n_probes``.
    """

    centroids: torch.Tensor
    choice: ProbeChoice
    weight_only: ProbeChoice
    weight_only_same_probes: ProbeChoice
    fit: CalibrationResult
    num_pinned: int
    target_agreement: float
    confidence: float
    margin: float = 1.0
    # name -> (states, the count that set alone needs, the set judged at the written count)
    validation: dict[str, tuple[int, ProbeChoice, ProbeChoice]] = field(default_factory=dict)
    pooled: ProbeChoice | None = None  # every validation state (held-out split included) at the written count
    stage1: str = "calibrated"  # the variant kept: CALIBRATED or WEIGHT_ONLY (`centroids` are its vectors)
    stage1_reason: str = ""  # one line: why that variant was kept
    variants: dict[str, ProbeRule] = field(default_factory=dict)  # each variant under the rule, count free
    fitted_centroids: torch.Tensor | None = None  # the fitted vectors, kept or not
    calibrated_same_probes: ProbeChoice | None = None  # the fitted vectors at ``choice.n_probes`` (held-out split)

    @property
    def n_probes(self) -> int:
        return self.choice.n_probes

    def record(self) -> dict[str, Any]:
        """What config.json keeps about the calibration (``flash_head_calibration``)."""
        return {
            "rows": int(self.fit.fit_rows.numel() + self.fit.heldout_rows.numel()),
            "fit_rows": int(self.fit.fit_rows.numel()),
            "heldout_rows": int(self.fit.heldout_rows.numel()),
            "target_agreement": self.target_agreement,
            "confidence": self.confidence,
            "n_probes": self.n_probes,
            "scored_fraction": round(self.choice.scored_fraction, 6),
            "heldout_agreement": round(self.choice.agreement, 6),
            "heldout_agreement_lower_bound": round(self.choice.agreement_lower, 6),
            "target_reached": self.choice.reached,
            "target_certified": self.choice.certified,
            "weight_only_heldout_agreement": round(self.weight_only_same_probes.agreement, 6),
            "weight_only_n_probes": self.weight_only.n_probes,
            "stage1": self.stage1,
            "stage1_reason": self.stage1_reason,
            "stage1_variants": {
                name: {
                    "n_probes_needed": rule.n_probes,
                    "meets_target": rule.meets,
                    "agreement": round(rule.pooled.agreement, 6),
                    "agreement_lower_bound": round(rule.pooled.agreement_lower, 6),
                    "scored_fraction": round(rule.pooled.scored_fraction, 6),
                }
                for name, rule in self.variants.items()
            },
            "pinned_ids": self.num_pinned,
            "epochs": self.fit.epochs,
            "best_epoch": self.fit.best_epoch,
            "margin": self.margin,
            "validation_rows": None
            if self.pooled is None
            else int(self.fit.heldout_rows.numel() + sum(rows for rows, _, _ in self.validation.values())),
            "validation_agreement_lower_bound": None if self.pooled is None else round(self.pooled.agreement_lower, 6),
            "validation": {
                name: {
                    "rows": rows,
                    "n_probes_needed": alone.n_probes,
                    "agreement": round(at.agreement, 6),
                    "agreement_lower_bound": round(at.agreement_lower, 6),
                }
                for name, (rows, alone, at) in self.validation.items()
            },
        }


def calibrate_stage1(
    weight: torch.Tensor,
    assignments: torch.Tensor,
    init: torch.Tensor,
    hidden: torch.Tensor,
    *,
    pinned_ids: Iterable[int] = (),
    target_agreement: float = 0.995,
    confidence: float = 0.95,
    n_probes: int | None = None,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    margin: float = PROBE_MARGIN,
    validation: dict[str, torch.Tensor] | None = None,
    keep_best: bool = True,
    device: str | torch.device = "cpu",
    progress: bool = False,
    **fit_options: Any,
) -> StageOneCalibration:
    """Fit the stage-1 vectors, choose ``n_probes`` on states the fit never saw, and keep the better stage 1.

    1. Dense float32 targets of every state (:func:`cluster_targets`).
    2. Fit on the fitting split, early-stopped on the held-out split (:func:`fit_stage1`).
    3. The probe count (or ``n_probes`` when given), judged on the held-out split and on every ``validation``
       set (states of another source, e.g. the model's own samples when calibrating on a text), stage 1 scored
       in the head's dtype as serving scores it: the smallest count at which every set's estimate shows at most
       ``1 / margin`` of the misses the target allows and the one-sided ``confidence`` lower bound over all
       these states pooled reaches the target (:func:`apply_probe_rule`).
    4. The weight-only ``init`` is judged by the same rule on the same states; with ``keep_best`` the stage 1
       that meets the target with fewer probes is kept (:func:`keep_stage1`), else the fitted one.
    """
    c = init.shape[0]
    check_target(target_agreement, confidence)
    if n_probes is not None and not 1 <= n_probes <= c:
        raise ValueError(f"n_probes must lie in [1, {c}], got {n_probes}")
    v = assignments.numel()
    pinned = sorted({int(i) for i in pinned_ids if 0 <= int(i) < v})
    top_k = fit_options.pop("top_k", 64)
    targets = cluster_targets(
        weight, assignments, hidden, num_clusters=c, pinned_ids=pinned, top_k=top_k, device=device, progress=progress
    )
    fit = fit_stage1(
        weight,
        assignments,
        hidden,
        init,
        pinned_ids=pinned,
        heldout_fraction=heldout_fraction,
        seed=seed,
        device=device,
        targets=targets,
        progress=progress,
        **fit_options,
    )
    layout = (c, int(torch.bincount(assignments, minlength=c).max()), v)
    held_h, held_t = hidden[fit.heldout_rows].to(device), targets.rows(fit.heldout_rows)
    sets: dict[str, tuple[torch.Tensor, ClusterTargets]] = {"heldout": (held_h, held_t)}
    for name, states in (validation or {}).items():
        states = states.to(device)
        t = cluster_targets(weight, assignments, states, num_clusters=c, pinned_ids=pinned, top_k=1, device=device)
        sets[name] = (states, t)
    rule = dict(
        num_pinned=len(pinned),
        target_agreement=target_agreement,
        confidence=confidence,
        margin=margin,
        n_probes=n_probes,
    )

    def needed_by(centroids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: probes_needed(centroids, h, t, dtype=weight.dtype) for name, (h, t) in sets.items()}

    needed = {CALIBRATED: needed_by(fit.centroids), WEIGHT_ONLY: needed_by(init)}
    # What each variant needs under the rule (the record's figures), and each at the count to write.
    free = {name: apply_probe_rule(n, *layout, **{**rule, "n_probes": None}) for name, n in needed.items()}
    fixed = free if n_probes is None else {name: apply_probe_rule(n, *layout, **rule) for name, n in needed.items()}
    if keep_best:
        kept, reason = keep_stage1(fixed[CALIBRATED], fixed[WEIGHT_ONLY], fixed_probes=n_probes is not None)
    else:
        kept, reason = CALIBRATED, "kept the calibrated stage 1 (no comparison asked for)"
    chosen = fixed[kept]
    written = chosen.n_probes
    choose = dict(target_agreement=target_agreement, confidence=confidence, margin=margin)
    held_init = needed[WEIGHT_ONLY]["heldout"]
    return StageOneCalibration(
        centroids=fit.centroids if kept == CALIBRATED else init.detach().to("cpu", torch.float32).clone(),
        choice=chosen.at["heldout"],
        weight_only=free[WEIGHT_ONLY].at["heldout"],
        weight_only_same_probes=choose_n_probes(held_init, *layout, num_pinned=len(pinned), n_probes=written, **choose),
        fit=fit,
        num_pinned=len(pinned),
        target_agreement=target_agreement,
        confidence=confidence,
        margin=margin,
        pooled=chosen.pooled,
        validation={
            name: (int(sets[name][0].shape[0]), chosen.per_set[name], chosen.at[name])
            for name in sets
            if name != "heldout"
        },
        stage1=kept,
        stage1_reason=reason,
        variants=free,
        calibrated_same_probes=choose_n_probes(
            needed[CALIBRATED]["heldout"], *layout, num_pinned=len(pinned), n_probes=written, **choose
        ),
        fitted_centroids=fit.centroids,
    )
