"""One armed decode step's rows: which go dense, and the two ways to FlashHead's answer for the others.

Contract: :func:`all_dense_reason` says why a whole step goes dense (None: FlashHead serves some rows);
:func:`dense_rows` counts the rows that go dense for their request; :class:`FlashRows` are the others, and
:func:`exchanged_probes` their probes under tensor parallelism. FlashHead's rows get the same tokens either
way (`timing.StepWays` chooses): :func:`kernels_way` scores them with `FlashHead.step_logits` and the pinned
ids (`pins.PinnedRows`), then fills the dense rows with vLLM's product; :func:`masked_way` takes vLLM's
product for the whole step and masks FlashHead's rows to FlashHead's answer (`my_pkg.flashhead.masked`).
Both run the live fidelity check when handed one (`telemetry`) and make the host wait for nothing. Plain
values in; the controller keeps the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from my_pkg.contract import DenseReason
from my_pkg.engine.flashhead.pins import PinnedRows
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.engine.flashhead.telemetry import Counters, FidelityCheck, HeadTimer, RecentSteps
from my_pkg.flashhead.head import FlashHead, PinnedIds
from my_pkg.flashhead.masked import masked_logits
from my_pkg.flashhead.probes import merge_probes
from my_pkg.flashhead.settings import FlashHeadSettings
from my_pkg.flashhead.staging import index_tensor

__all__ = [
    "FlashRows",
    "all_dense_reason",
    "dense_rows",
    "exchanged_probes",
    "count_served",
    "kernels_way",
    "masked_way",
    "serve",
]

Product = Callable[[torch.Tensor], torch.Tensor]
Pinned = PinnedIds | None


def all_dense_reason(
    rows: StepRows, num_rows: int, settings: FlashHeadSettings, built: bool, exchange_missing: bool
) -> str | None:
    """Why every row of a step of `num_rows` goes dense (a `rows_dense` counter's label), in this order: the
    step's own reason, rows other than the armed ones, FlashHead off, no head (`built` False), a batch above
    the threshold, and a tensor-parallel step whose exchange did not happen (`exchange_missing`); None: none."""
    if rows.all_dense is not None:
        return rows.all_dense
    if rows.num_rows != num_rows:
        return "unexpected_rows"
    if not settings.enabled:
        return "disabled"
    if not built:
        return "unavailable"
    threshold = settings.dense_batch_threshold
    if threshold is not None and num_rows > threshold:
        return "batch_threshold"
    if exchange_missing:
        return "error"
    return None


def dense_rows(rows: StepRows, counters: Counters) -> np.ndarray:
    """The rows of the step that go dense for their request (`StepRows.dense_codes`), counted by reason."""
    dense = np.flatnonzero(rows.dense_codes)
    if dense.size:
        reasons = np.bincount(rows.dense_codes[dense])
        for code in np.flatnonzero(reasons):
            counters.rows_dense[DenseReason(code).label] += int(reasons[code])
    return dense


def exchanged_probes(
    exchanged: torch.Tensor | None, flash: FlashRows, width: int | None, num_clusters: int
) -> torch.Tensor | None:
    """Under tensor parallelism the FlashHead rows' probes: the best of every rank's `width` keys in `exchanged`
    (`merge_probes`), as the full stage 1 would choose them; None without an exchange (the head's own stage 1)."""
    if exchanged is None:
        return None
    keys = exchanged if flash.index is None else exchanged.index_select(0, flash.index)
    if width is None:
        raise RuntimeError("keys were exchanged on a step without a stage-1 exchange")
    return merge_probes(keys, width, num_clusters)


def count_served(
    counters: Counters, recent: RecentSteps, rows: StepRows, greedy: int, sampled: int, dense: int, masked: bool
) -> None:
    """Count a served step's FlashHead rows (`greedy` and `sampled`; all of them made the masked way when
    `masked`, the verify rows among them) and its `dense` rows."""
    num_flash = greedy + sampled
    if masked:
        counters.rows_flashhead_masked += num_flash
    if rows.verify_rows is not None:
        counters.rows_flashhead_verify += int(np.count_nonzero(rows.dense_codes[rows.verify_rows] == 0))
    counters.rows_flashhead += num_flash
    recent.add(greedy, sampled, dense, num_flash if masked else 0)


class FlashRows:
    """The rows of a step FlashHead serves: their `hidden`, `sampled` flags and `index` in the step (None: all)."""

    def __init__(self, hidden: torch.Tensor, rows: StepRows, dense_rows: np.ndarray) -> None:
        self.hidden, self.sampled, self.index = hidden, rows.sampled, None
        if dense_rows.size:  # FlashHead's answer only for the rows FlashHead serves
            flash = np.flatnonzero(rows.dense_codes == 0)
            self.index = index_tensor(flash, hidden.device)
            self.hidden, self.sampled = hidden.index_select(0, self.index), self.sampled[flash]


def masked_way(
    head: FlashHead,
    hidden: torch.Tensor,
    flash: FlashRows,
    dense: Product,
    *,
    sampled: np.ndarray | None,
    pins: Pinned,
    postprocess: Product,
    probes: torch.Tensor | None,
    check: tuple[FidelityCheck, int] | None,
) -> torch.Tensor:
    """What FlashHead's kernels would give every FlashHead row, made from the dense product of the step; `check`:
    the live fidelity check and its `every`, against the dense logits already at hand."""
    logits = dense(hidden)
    part = logits if flash.index is None else logits.index_select(0, flash.index)
    masked = masked_logits(
        head,
        flash.hidden,
        part,
        sampled=sampled,
        pinned=pins.ids if pins is not None else None,
        postprocess=postprocess,
        probes=probes,
    )
    if check is not None:
        fidelity, every = check
        fidelity.check(every, flash.hidden, masked, None, lambda rows: part[: rows.shape[0]], flash.sampled)
    return masked if flash.index is None else logits.index_copy_(0, flash.index, masked.to(logits.dtype))


def kernels_way(
    head: FlashHead,
    hidden: torch.Tensor,
    flash: FlashRows,
    dense_rows: np.ndarray,
    dense: Product,
    *,
    sampled: np.ndarray | None,
    pins: Pinned,
    postprocess: Product,
    probes: torch.Tensor | None,
    timer: HeadTimer,
    check: tuple[FidelityCheck, int] | None,
) -> torch.Tensor:
    """FlashHead's rows by its kernels, the `dense_rows` by `dense`; `timer` times the head's part; `check`: the
    live fidelity check and its `every`."""
    token = timer.start(hidden.device)
    # What vLLM's sampler gets, as the eval scores it: candidates, estimated logits for sampled rows, and every
    # pinned id (EOS, specials, the step's stop ids) exact.
    flash_logits = head.step_logits(flash.hidden, sampled=sampled, pinned=pins, postprocess=postprocess, probes=probes)
    if flash.index is None:
        logits = flash_logits
    else:
        logits = torch.empty((hidden.shape[0], head.vocab_size), dtype=flash_logits.dtype, device=hidden.device)
        logits.index_copy_(0, flash.index, flash_logits)
    timer.stop(token)
    if check is not None:
        fidelity, every = check
        fidelity.check(every, flash.hidden, logits, flash.index, dense, flash.sampled)
    if dense_rows.size:
        index = index_tensor(dense_rows, hidden.device)
        logits[index] = dense(hidden.index_select(0, index)).to(logits.dtype)
    return logits


def serve(
    way: str,
    head: FlashHead,
    hidden: torch.Tensor,
    flash: FlashRows,
    dense_rows: np.ndarray,
    dense: Product,
    *,
    probe_sampling: bool,
    pinned_rows: PinnedRows,
    stop_ids: tuple[int, ...],
    postprocess: Product,
    probes: torch.Tensor | None,
    timer: HeadTimer,
    check: tuple[FidelityCheck, int] | None,
) -> torch.Tensor:
    """The step's logits by `way` (`"masked"`: :func:`masked_way`, else :func:`kernels_way`), the pinned ids being
    the model's and the step's `stop_ids`; sampled rows sample only with `probe_sampling`."""
    pins = pinned_rows.get(stop_ids, head.weight)
    sampled = flash.sampled if probe_sampling else None
    if way == "masked":
        return masked_way(
            head, hidden, flash, dense, sampled=sampled, pins=pins, postprocess=postprocess, probes=probes, check=check
        )
    return kernels_way(
        head,
        hidden,
        flash,
        dense_rows,
        dense,
        sampled=sampled,
        pins=pins,
        postprocess=postprocess,
        probes=probes,
        timer=timer,
        check=check,
    )
