"""What a worker reports about its FlashHead: the status reply's parts and the start-up timing's log lines.

Plain values in (the head, its settings, the step costs; a controller read through the small `Reported`
protocol), contract models out (`FlashHeadController.status`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, Protocol

from my_pkg.contract import FlashHeadState, ReasonCode, SampledEstimate, ServedWay, SpecState, StepCostsReport
from my_pkg.engine.flashhead.spec import effective as effective_spec
from my_pkg.engine.flashhead.telemetry import Counters, RecentSteps
from my_pkg.flashhead.settings import FlashHeadSettings
from my_pkg.flashhead.spec import HeadSpec, resolve_sampled_n_probes
from my_pkg.flashhead.step_costs import StepCosts

__all__ = [
    "DISABLED_REASON",
    "NOT_BUILT_REASON",
    "NO_ASSETS_REASON",
    "log_step_costs",
    "Reported",
    "sampled_estimate",
    "settings_status",
    "status",
    "status_reason",
    "status_without_controller",
    "step_costs_report",
]

logger = logging.getLogger(f"vllm.{__name__}")

NO_ASSETS_REASON = "the model has no FlashHead assets (no flash_head_cache_dir in config.json)"
DISABLED_REASON = "disabled (MY_PKG_FLASHHEAD=0 or PUT enabled=false)"
NOT_BUILT_REASON = "not built yet (built right after vLLM loads the weights, or at the first logits call)"


def step_costs_report(costs: StepCosts | None, served: list[ServedWay], check_every: int) -> StepCostsReport | None:
    """The start-up timing in milliseconds, the batches from which the masked way is the cheaper one (`check_every`:
    one row in this many also gets the dense logits), and the served steps' own times (`StepWays.report`)."""
    if costs is None:
        return None
    return StepCostsReport(
        batches=list(costs.batches),
        dense_ms=_milliseconds(costs.dense_s),
        greedy_ms=_milliseconds(costs.greedy_s),
        sampled_ms=_milliseconds(costs.sampled_s) if costs.sampled_s is not None else None,
        mixed_ms=[None if math.isnan(ms) else ms for ms in _milliseconds(costs.mixed_s)]
        if costs.mixed_s is not None
        else None,
        masked_greedy_ms=_milliseconds(costs.masked_greedy_s) if costs.masked_greedy_s is not None else None,
        masked_sampled_ms=_milliseconds(costs.masked_sampled_s) if costs.masked_sampled_s is not None else None,
        masked_from_greedy=costs.masked_from(sampled=False, check_every=check_every),
        masked_from_sampled=costs.masked_from(sampled=True, check_every=check_every)
        if costs.sampled_s is not None
        else None,
        served=served,
    )


def log_step_costs(costs: StepCosts, report: StepCostsReport) -> None:
    """The start-up timing, logged once; a warning when it is not monotonic in the batch (a busy machine)."""
    logger.info(
        "my_pkg: FlashHead timed beside the dense head at %s rows: dense %s ms, greedy %s ms, sampled %s ms, "
        "masked greedy %s ms, masked sampled %s ms; FlashHead's rows of larger steps are made from the dense "
        "product (the same tokens) from %s greedy rows, %s sampled rows; served steps correct these times",
        report.batches,
        report.dense_ms,
        report.greedy_ms,
        report.sampled_ms,
        report.masked_greedy_ms,
        report.masked_sampled_ms,
        report.masked_from_greedy or "none",
        report.masked_from_sampled or "none",
    )
    for name in ("dense_s", "greedy_s"):
        times = getattr(costs, name)
        if any(later < 0.8 * earlier for earlier, later in zip(times, times[1:])):
            logger.warning(
                "my_pkg: FlashHead's start-up timing is not monotonic in the batch (%s: %s ms); the machine was "
                "busy while it timed: served steps' own times correct it",
                name,
                _milliseconds(times),
            )


def sampled_estimate(head: Any, probe_sampling: bool) -> SampledEstimate | None:
    """How the head estimates sampled rows' tail: off, fitted at build time, or from the weight alone."""
    if head is None:
        return None
    if not probe_sampling or head.sampled_rank == 0:
        return "off"
    return "fitted" if head.tail_fitted else "weight_only"


class Reported(Protocol):
    """What the status reports of a controller (`FlashHeadController`), read as plain attributes."""

    settings: FlashHeadSettings
    head: Any  # a `FlashHead` once built, else None
    available: bool
    unavailable_code: ReasonCode | None
    unavailable_reason: str | None
    num_clusters: int | None
    cluster_size: int | None
    vocab_size: int
    pinned_ids: tuple[int, ...]
    counters: Counters
    recent: RecentSteps
    spec: SpecState | None

    @property
    def draft(self) -> Reported | None: ...


def status(
    source: Reported,
    *,
    extra_memory_bytes: int | None,
    step_costs: StepCostsReport | None,
    head_spec: HeadSpec | None,
) -> FlashHeadState:
    """The status reply of `source`, its drafter's counters and probe count included; `head_spec`: the head's
    parameters before it is built (None once built or without assets)."""
    settings, draft = source.settings, source.draft
    active = source.head is not None and settings.enabled
    code, reason = status_reason(active, settings.enabled, source.unavailable_code, source.unavailable_reason)
    spec = source.spec
    if spec is not None and draft is not None:  # the drafter's probe count when FlashHead serves its head
        spec = spec.model_copy(update={"draft_n_probes": draft.settings.n_probes})
    return FlashHeadState(
        available=source.available,
        active=active,
        reason=reason,
        reason_code=code,
        num_clusters=source.num_clusters,
        cluster_size=source.cluster_size,
        vocab_size=source.vocab_size,
        pinned_token_ids=list(source.pinned_ids),
        extra_memory_bytes=extra_memory_bytes,
        step_costs=step_costs,
        counters=source.counters.snapshot(draft.counters if draft is not None else None),
        recent=source.recent.report(),
        spec=effective_spec(spec, active),
        **settings_status(settings, source.head, source.num_clusters, head_spec),
    )


def status_reason(
    active: bool, enabled: bool, unavailable_code: ReasonCode | None, unavailable_reason: str | None
) -> tuple[ReasonCode | None, str | None]:
    """`(reason_code, reason)` of the status: none while active, else why FlashHead cannot serve
    (`unavailable_code`), is switched off, or is not built yet."""
    if active:
        return None, None
    if unavailable_code is not None:
        return unavailable_code, unavailable_reason
    if not enabled:
        return "disabled", DISABLED_REASON
    return "not_built", NOT_BUILT_REASON


def settings_status(
    settings: FlashHeadSettings, head: Any, num_clusters: int | None, spec: HeadSpec | None
) -> dict[str, Any]:
    """The status fields of the settings and of the head serving them: the head's values once built (`head`),
    else its `spec` (`HeadSpec.resolve`) while the assets are held, else the settings' own."""
    sampled_n_probes, sampled_rank = _sampled(settings, head, num_clusters, spec)
    return {
        "enabled": settings.enabled,
        "n_probes": settings.n_probes,
        "dense_batch_threshold": settings.dense_batch_threshold,
        "probe_sampling": settings.probe_sampling,
        "sampled_n_probes": sampled_n_probes,
        "sampled_rank": sampled_rank,
        "sampled_rescore": head.sampled_rescore if head is not None and settings.probe_sampling else None,
        "sampled_estimate": sampled_estimate(head, settings.probe_sampling),
        "fidelity_every": settings.fidelity_every,
        "backend": head.backend if head is not None else None,
    }


def _sampled(
    settings: FlashHeadSettings, head: Any, clusters: int | None, spec: HeadSpec | None
) -> tuple[int | None, int | None]:
    """`(sampled_n_probes, sampled_rank)` as served (without probe sampling, the greedy rows' probe count)."""
    if head is None and spec is not None:
        return spec.sampled_n_probes, spec.sampled_rank
    rank = head.sampled_rank if head is not None else settings.sampled_rank
    if clusters is None:
        return settings.sampled_n_probes, rank
    if not settings.probe_sampling:
        return min(settings.n_probes, clusters), rank
    if head is not None:
        return head.sampled_n_probes, rank
    return resolve_sampled_n_probes(settings.sampled_n_probes, settings.n_probes, clusters, rank or 0), rank


def status_without_controller(code: ReasonCode = "no_assets", reason: str = NO_ASSETS_REASON) -> FlashHeadState:
    """Status of a worker whose model has no FlashHead controller, for `reason` (every field set)."""
    return FlashHeadState(
        available=False,
        active=False,
        reason=reason,
        reason_code=code,
        enabled=False,
        num_clusters=None,
        cluster_size=None,
        vocab_size=None,
        n_probes=None,
        dense_batch_threshold=None,
        probe_sampling=None,
        sampled_n_probes=None,
        sampled_rank=None,
        sampled_rescore=None,
        sampled_estimate=None,
        pinned_token_ids=None,
        fidelity_every=None,
        backend=None,
        extra_memory_bytes=None,
        step_costs=None,
        counters=Counters().snapshot(),
        recent=RecentSteps().report(),
        spec=None,
    )


def _milliseconds(seconds: Iterable[float]) -> list[float]:
    return [round(value * 1e3, 4) for value in seconds]
