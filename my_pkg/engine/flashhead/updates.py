"""The admin API's FlashHead update in one worker: what the served model refuses, and applying the rest.

Contract: the contract (`FlashHeadUpdate`) has already checked the update's fields and types; :func:`refusals`
checks what the model decides (FlashHead available, `n_probes` at most the clusters, `draft_n_probes` only
with a FlashHead drafter and at most its clusters) and :func:`apply` sets an accepted update, effective from
the next step. The controllers reach it as :class:`Served` values (settings, head, ways); nothing here
imports the controller.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, Protocol

from my_pkg.contract import FlashHeadUpdate, SpecState
from my_pkg.engine.flashhead.timing import StepWays
from my_pkg.flashhead.settings import FlashHeadSettings

__all__ = ["Served", "apply", "as_update", "refusals"]

logger = logging.getLogger(f"vllm.{__name__}")


class Served(Protocol):
    """What an update changes on a model's FlashHead (the target's or the drafter's controller)."""

    settings: FlashHeadSettings
    head: Any  # a `FlashHead` once built, else None
    ways: StepWays


def as_update(update: FlashHeadUpdate | dict[str, Any]) -> FlashHeadUpdate:
    """The contract model; a plain mapping is validated into it."""
    return update if isinstance(update, FlashHeadUpdate) else FlashHeadUpdate.model_validate(update)


def refusals(
    update: FlashHeadUpdate,
    *,
    unavailable_reason: str | None,
    num_clusters: int | None,
    has_draft: bool,
    draft_clusters: int | None,
    spec: SpecState | None,
) -> list[str]:
    """What the served model refuses in `update` (empty: nothing): FlashHead must be available
    (`unavailable_reason` None), `n_probes` at most `num_clusters`, and `draft_n_probes` needs a FlashHead
    drafter (`has_draft`; `spec` says why there is none) and at most its `draft_clusters`."""
    if unavailable_reason is not None:
        return [f"FlashHead is not available on this model: {unavailable_reason}"]
    if update.n_probes is not None and num_clusters is not None and update.n_probes > num_clusters:
        return [f"n_probes must be <= the number of clusters ({num_clusters})"]
    if update.draft_n_probes is not None:
        if not has_draft:
            part = spec.draft.reason_code if spec is not None else "no speculative decoding"
            return [f"draft_n_probes: FlashHead does not serve the drafter's head on this model ({part})"]
        if draft_clusters is not None and update.draft_n_probes > draft_clusters:
            return [f"draft_n_probes must be <= the draft model's number of clusters ({draft_clusters})"]
    return []


def apply(update: FlashHeadUpdate, target: Served, draft: Served | None) -> None:
    """Apply an update that :func:`refusals` accepted to `target` and its `draft`. `draft_n_probes` is the
    drafter's `n_probes`; `enabled` and `dense_batch_threshold` apply to the drafter's head too."""
    for name in update.model_fields_set - {"draft_n_probes"}:
        setattr(target.settings, name, getattr(update, name))
    if update.n_probes is not None and target.head is not None:
        target.head.n_probes = update.n_probes
        target.ways.forget_kernels()  # served steps time the new probe count; nothing is timed here
    if draft is not None:  # the drafter's head: its own probe count, the target's switch and threshold
        for name in ("enabled", "dense_batch_threshold"):
            if name in update.model_fields_set:
                setattr(draft.settings, name, getattr(update, name))
        if update.draft_n_probes is not None:
            draft.settings.n_probes = update.draft_n_probes
            if draft.head is not None:
                draft.head.n_probes = update.draft_n_probes
                draft.ways.forget_kernels()
    logger.info(
        "my_pkg: FlashHead settings now %s%s",
        asdict(target.settings),
        f", draft_n_probes={draft.settings.n_probes}" if draft is not None else "",
    )
