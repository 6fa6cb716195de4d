"""A model's FlashHead assets in one worker, and whether FlashHead can serve the model with them.

Contract: :func:`read_assets` reads the centroids, the cluster map, the fitted tail estimate and the
pinned ids named by a model directory's config.json, and never raises: a failure becomes the reason
FlashHead cannot serve (`assets_invalid`). :func:`unavailability` is the first reason among the caller's,
missing assets and a cluster map that does not cover the vocabulary (None: FlashHead can serve). Plain
values in and out; the controller (`controller.py`) keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from my_pkg.contract import ReasonCode
from my_pkg.engine.flashhead.report import NO_ASSETS_REASON
from my_pkg.flashhead.assets import load_assets, load_tail_factors, stop_and_special_token_ids
from my_pkg.flashhead.tail_estimate import TailFactors

__all__ = ["ModelAssets", "cluster_shape", "read_assets", "unavailability"]


@dataclass
class ModelAssets:
    """What a model directory gives FlashHead; `unavailable` says why it cannot serve (None: it may)."""

    centroids: torch.Tensor | None = None
    assignments: torch.Tensor | None = None
    tail_factors: TailFactors | None = None
    pinned_ids: set[int] = field(default_factory=set)
    unavailable: tuple[ReasonCode, str] | None = None

    def arguments(self) -> dict[str, Any]:
        """These assets as the controller's keyword arguments."""
        return {
            "centroids": self.centroids,
            "assignments": self.assignments,
            "tail_factors": self.tail_factors,
            "pinned_ids": self.pinned_ids,
            "unavailable": self.unavailable,
        }


def read_assets(
    model_dir: str | None,
    config: dict[str, Any],
    *,
    unavailable: tuple[ReasonCode, str] | None = None,
    pinned_ids: Iterable[int] = (),
) -> ModelAssets:
    """The assets config.json names, beside `pinned_ids` (the tokenizer's EOS and special ids) and the stop
    and special ids the model directory names; nothing is read when the caller already knows FlashHead is
    `unavailable`."""
    assets = ModelAssets(pinned_ids=set(pinned_ids), unavailable=unavailable)
    if unavailable is not None:
        return assets
    try:
        if model_dir is None:
            raise FileNotFoundError("the model directory could not be resolved")
        assets.centroids, assets.assignments = load_assets(Path(model_dir), config)
        assets.tail_factors = load_tail_factors(Path(model_dir), config)
        assets.pinned_ids.update(stop_and_special_token_ids(model_dir, config))
    except Exception as exc:  # noqa: BLE001 - bad assets mean dense, never a crash
        assets.unavailable = ("assets_invalid", f"FlashHead assets could not be loaded: {exc}")
    return assets


def cluster_shape(centroids: torch.Tensor, assignments: torch.Tensor) -> tuple[int, int]:
    """`(num_clusters, cluster_size)` of the assets: the largest cluster's size."""
    return int(centroids.shape[0]), int(torch.bincount(assignments.flatten().long()).max())


def unavailability(
    centroids: torch.Tensor | None,
    assignments: torch.Tensor | None,
    vocab_size: int,
    unavailable: tuple[ReasonCode, str] | None = None,
) -> tuple[ReasonCode, str] | None:
    """Why FlashHead cannot serve a model of `vocab_size` tokens with these assets: `unavailable` first,
    then no assets, then a cluster map of another vocabulary; None when it can."""
    if unavailable is not None:
        return unavailable
    if centroids is None or assignments is None:
        return "no_assets", NO_ASSETS_REASON
    if int(assignments.shape[0]) != vocab_size:
        return "assets_mismatch", (
            f"FlashHead assets do not match the model: cluster_assignments covers "
            f"{assignments.shape[0]} tokens, the vocabulary has {vocab_size}"
        )
    return None
