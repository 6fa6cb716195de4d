"""The head's build over the loaded LM head, its warm-up and start-up timing, and the memory it holds.

Contract: :func:`build_head` builds a `FlashHead` over vLLM's loaded head weight (under tensor parallelism
this rank's vocabulary shard, with this rank's share of the centroids for stage 1) from the settings
(`HeadSpec.resolve`) and never raises: a failure comes back in :class:`Built`. :func:`head_step` and
:func:`masked_step` are the built head's decode step on `(hidden, sampled)` the way
`FlashHeadController.compute_logits` runs it (pinned ids included; the step's stop ids and the model's logit
scale aside), by FlashHead's kernels and by the masked dense product; under tensor parallelism stage 1 is this
rank's share (:func:`own_probes`), with no collective. :func:`warm_up` runs the kernels' step once per kind of
row and :func:`measure` times both ways beside vLLM's dense product (`my_pkg.flashhead.step_costs`). Plain values
in (the assets, the head, its pins, its share of stage 1, the settings); the controller keeps what comes out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from my_pkg.engine.flashhead import compact_step
from my_pkg.engine.flashhead.pins import PinnedRows
from my_pkg.flashhead.compact import compact_clusters
from my_pkg.flashhead.head import FlashHead
from my_pkg.flashhead.layout import hidden_major
from my_pkg.flashhead.masked import masked_logits
from my_pkg.flashhead.probes import ShardStage1, merge_probes
from my_pkg.flashhead.settings import FlashHeadSettings
from my_pkg.flashhead.step_costs import StepCosts, measure_step_costs
from my_pkg.flashhead.tail_estimate import TailFactors

__all__ = [
    "Built",
    "Step",
    "build_head",
    "extra_memory_bytes",
    "head_step",
    "masked_step",
    "measure",
    "own_probes",
    "warm_up",
]

logger = logging.getLogger(f"vllm.{__name__}")

#: A decode step on `(hidden [B, H], sampled [B] bool)`: `[B, V]` logits.
Step = Callable[[torch.Tensor, np.ndarray], torch.Tensor]
Dense = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Built:
    """What :func:`build_head` made: this rank's share of stage 1 (made first, so that it scores its share even
    when the head fails), the head and its pinned ids, or the `error` that stopped it."""

    stage1: ShardStage1 | None = None
    head: FlashHead | None = None
    pins: PinnedRows | None = None
    error: Exception | None = None


def build_head(
    settings: FlashHeadSettings,
    weight: torch.Tensor,
    centroids: torch.Tensor,
    assignments: torch.Tensor,
    *,
    vocab_size: int,
    vocab_range: tuple[int, int] | None,
    shard: tuple[int, int] | None,
    tail_factors: TailFactors | None,
    pinned_ids: Sequence[int],
) -> Built:
    """The head over `weight` (the loaded LM head, shared; a CPU head adds its rows in cluster order).

    Under tensor parallelism `weight` is this rank's shard of vLLM's vocab-parallel head, whose rows are the
    tokens `vocab_range = (start, end)` of `vocab_size`, and `shard = (rank, world_size)` names the rank:
    `stage1` scores this rank's share of the global centroids (a view of the head's, no copy), the ranks choose
    the probes together from their shares (the same probes on every rank), the head scores only the candidates
    in its range, and its logits are this shard's columns, which vLLM's gather puts together."""
    built = Built()
    start, end = vocab_range if vocab_range is not None else (0, vocab_size)
    try:
        if not 0 <= start < end <= vocab_size:
            raise ValueError(f"vocabulary shard [{start}, {end}) is outside [0, {vocab_size})")
        if weight.shape[1] != centroids.shape[1]:
            raise ValueError(f"centroids have hidden size {centroids.shape[1]}, the head has {weight.shape[1]}")
        # One copy in stage 1's layout, shared by the head and this rank's share (`layout.py`).
        laid_out = hidden_major(centroids.to(device=weight.device, dtype=weight.dtype))
        if shard is not None:
            built.stage1 = ShardStage1(laid_out, *shard)
        built.head = FlashHead.from_settings(
            weight,
            laid_out,
            assignments[start:end].to(device=weight.device),
            settings=settings,
            vocab_size=end - start,
            allow_empty_clusters=vocab_range is not None,
            tail_factors=tail_factors,
        )
        built.pins = PinnedRows(pinned_ids, (start, end))
    except Exception as exc:  # noqa: BLE001 - the caller serves dense with the reason
        built.error = exc
        return built
    head = built.head
    logger.info(
        "my_pkg: FlashHead active: %d clusters of %d, n_probes=%d, backend=%s",
        head.num_clusters,
        head.cluster_size,
        head.n_probes,
        head.backend,
    )
    return built


def own_probes(
    head: FlashHead, stage1: ShardStage1 | None, width: int | None
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A step's probes without an exchange: None (the head's own stage 1), or under tensor parallelism this rank's
    best `width` clusters of its share, merged as the exchanged ones are (without the other ranks' keys)."""

    def probes(hidden: torch.Tensor) -> torch.Tensor | None:
        if stage1 is None or width is None:
            return None
        return merge_probes(stage1.keys(hidden, width), width, head.num_clusters)

    return probes


def head_step(
    head: FlashHead, pins: PinnedRows | None, stage1: ShardStage1 | None, width: int | None, probe_sampling: bool
) -> Step:
    """The step by FlashHead's kernels (`FlashHead.step_logits`, then the pinned ids exact)."""
    probes = own_probes(head, stage1, width)
    pinned = pins.get((), head.weight) if pins is not None else None

    def step(hidden: torch.Tensor, sampled: np.ndarray) -> torch.Tensor:
        return head.step_logits(
            hidden, sampled=sampled if probe_sampling else None, pinned=pinned, probes=probes(hidden)
        )

    return step


def masked_step(
    head: FlashHead,
    pins: PinnedRows | None,
    stage1: ShardStage1 | None,
    width: int | None,
    probe_sampling: bool,
    dense: Dense,
) -> Step:
    """The masked way's step: `dense` (vLLM's product for the head), then every row masked to FlashHead's answer
    (`my_pkg.flashhead.masked`)."""
    probes = own_probes(head, stage1, width)
    pinned = pins.get((), head.weight) if pins is not None else None

    def step(hidden: torch.Tensor, sampled: np.ndarray) -> torch.Tensor:
        return masked_logits(
            head,
            hidden,
            dense(hidden),
            sampled=sampled if probe_sampling else None,
            pinned=pinned[0] if pinned is not None else None,
            probes=probes(hidden),
        )

    return step


def warm_up(
    head: FlashHead,
    pins: PinnedRows | None,
    stage1: ShardStage1 | None,
    width: int | None,
    hidden: torch.Tensor,
    probe_sampling: bool,
    compact: bool = False,
) -> str | None:
    """Run :func:`head_step` once on `hidden[:2]`, greedy and (with probe sampling) sampled, and with `compact` plan
    them as compact rows, so that kernels are compiled and the sampled rows' tables built (before vLLM sizes its KV
    cache) ahead of the first request; why it failed, or None."""
    rows = hidden[:2].detach()
    try:
        step = head_step(head, pins, stage1, width, probe_sampling)
        for sampled in (False, True) if probe_sampling else (False,):
            step(rows, np.full(rows.shape[0], sampled))
        if compact and probe_sampling and stage1 is None and compact_step.head_draws(head):
            planner = compact_step.compact_head(head)
            temperature = torch.ones(rows.shape[0])
            planner.plan(rows, temperature, pinned=None, postprocess=lambda x: x, clusters=compact_clusters(head))
    except Exception as exc:  # noqa: BLE001 - a head that fails here is dropped, the model stays dense
        return f"FlashHead failed its warm-up step: {type(exc).__name__}: {exc}"
    return None


def on_host(head: FlashHead) -> bool:
    """Whether `head` runs on the host (CPU), where served steps are timed by the host clock and each step takes the
    cheaper of FlashHead's kernels and the masked way (`timing.StepWays`); an accelerator's head is timed at start-up
    only, and stands down when its kernels do not pay (`StepCosts.slower_than_dense`)."""
    return head.weight.device.type == "cpu"


def measure(
    head: FlashHead,
    pins: PinnedRows | None,
    stage1: ShardStage1 | None,
    width: int | None,
    probe_sampling: bool,
    dense: Dense,
) -> StepCosts | None:
    """Time :func:`head_step` beside `dense` at batches of 1, 2, 4, ... rows (`measure_step_costs`, on the head's
    device), and on the host :func:`masked_step` too, under inference mode; None when that fails (logged): without a
    measurement FlashHead's kernels serve every step."""
    try:
        with torch.inference_mode():
            step = head_step(head, pins, stage1, width, probe_sampling)
            masked = masked_step(head, pins, stage1, width, probe_sampling, dense) if on_host(head) else None
            return measure_step_costs(
                step,
                dense,
                int(head.weight.shape[1]),
                dtype=head.weight.dtype,
                sampled_rows=probe_sampling,
                masked_step=masked,
                device=head.weight.device,
            )
    except Exception as exc:  # noqa: BLE001
        logger.warning(
            "my_pkg: FlashHead could not time its steps beside the dense head (%s: %s)", type(exc).__name__, exc
        )
        return None


def extra_memory_bytes(
    head: FlashHead | None, pins: PinnedRows | None, draft: tuple[FlashHead | None, int | None] | None = None
) -> int | None:
    """Device bytes FlashHead holds beyond vLLM's head weight: `head`'s (centroids, cluster map, the sampled rows'
    tables once built, their table in cluster order once a compact row needed it) and the pinned ids' cached weight
    rows; with `draft`, the drafter's head and its own bytes, less the rows in cluster order an EAGLE head shares
    with the target's (None: no head)."""
    own = None
    if head is not None:
        own = int(head.extra_memory_bytes + (pins.nbytes if pins is not None else 0) + compact_step.table_bytes(head))
    if draft is None or draft[1] is None:
        return own
    draft_head, drafter = draft
    assert drafter is not None
    shared = head is not None and draft_head is not None and head.cluster_rows is not None
    if shared and draft_head.cluster_rows is head.cluster_rows:  # one copy for both heads
        drafter -= head.cluster_rows.nbytes
    return (own or 0) + drafter
