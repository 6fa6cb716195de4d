"""What a worker reports about its FlashHead: the status reply's parts and the start-up timing's log lines.

Plain values in (the head, its settings, the step costs), contract models out; the controller assembles
them into its `FlashHeadState` (`FlashHeadController.status`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from my_pkg.contract import FlashHeadState, ReasonCode, SampledEstimate, ServedWay, StepCostsReport
from my_pkg.engine.flashhead.telemetry import Counters, RecentSteps
from my_pkg.flashhead.step_costs import StepCosts

__all__ = [
    "DISABLED_REASON",
    "NOT_BUILT_REASON",
    "NO_ASSETS_REASON",
    "log_step_costs",
    "sampled_estimate",
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
