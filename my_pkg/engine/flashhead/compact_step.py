"""A decode step's compact rows: the sampled rows the plugin draws itself, and what the sampler hook needs for it.

Contract: :func:`rows_to_draw` says which rows of an armed step are drawn from the compact law
(`my_pkg.flashhead.compact_law`): the step's `StepRows.compact` rows (sampled, no penalty, no dense reason; the
model runner's hooks leave it None on a speculative step or without the sampler hook), on a single-rank CPU head
with an estimate and `compact_sampling` on.  :func:`serve` gives the step's logits (the compact rows' placeholder:
exact on their exact set, ``-inf`` elsewhere; the other FlashHead rows by `FlashHead.step_logits`; the dense rows by
vLLM's product) and the :class:`StepPlan` the sampler hook draws from (`patches/compact_sampler.py`), matched to the
step by the identity of the logits tensor.  :func:`draw` makes that draw and counts it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.engine.flashhead.step import count_served
from my_pkg.engine.flashhead.telemetry import Counters, FidelityCheck, HeadTimer, RecentSteps
from my_pkg.flashhead.compact import CompactHead, CompactRows, compact_clusters
from my_pkg.flashhead.compact_law import RowFilter
from my_pkg.flashhead.compact_law import draw as compact_draw
from my_pkg.flashhead.gumbel import row_keys
from my_pkg.flashhead.head import FlashHead, PinnedIds
from my_pkg.flashhead.settings import FlashHeadSettings
from my_pkg.flashhead.staging import index_tensor

__all__ = ["PlanSlot", "Served", "StepPlan", "draw", "rows_to_draw", "serve"]

Product = Callable[[torch.Tensor], torch.Tensor]
_COMPACT_HEADS: weakref.WeakKeyDictionary[FlashHead, CompactHead] = weakref.WeakKeyDictionary()


@dataclass
class StepPlan:
    """What the sampler hook needs to draw a step's compact rows."""

    logits: torch.Tensor  # the step's logits as `compute_logits` returned them
    rows: np.ndarray  # the compact rows' positions in the step, in `compact`'s row order
    compact: CompactRows
    head: CompactHead
    min_p: np.ndarray  # per compact row
    others: np.ndarray  # bool per step row: the sampled rows vLLM's sampler draws (greedy rows need no draw)

    def filters(self, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> list[RowFilter]:
        """The compact rows' filters from the sampler's per-row `top_k` / `top_p` (None: no row uses it)."""
        k = top_k.tolist() if top_k is not None else None
        p = top_p.tolist() if top_p is not None else None
        return [
            RowFilter(
                top_k=int(k[row]) if k is not None else None,
                top_p=float(p[row]) if p is not None else 1.0,
                min_p=float(self.min_p[i]),
            )
            for i, row in enumerate(self.rows.tolist())
        ]


class PlanSlot:
    """The last step's plan, until the sampler hook takes it; a plan it never takes is counted (`unmatched_rows`)."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self.plan: StepPlan | None = None

    def put(self, plan: StepPlan) -> None:
        self.drop()
        self.plan = plan

    def drop(self) -> None:
        if self.plan is not None:
            self._counters.compact["unmatched_rows"] += int(self.plan.rows.size)
            self.plan = None

    def take(self, logits: torch.Tensor) -> StepPlan | None:
        """The plan of the step whose logits are `logits` (compared by identity), once; another plan is dropped."""
        if self.plan is not None and self.plan.logits is logits:
            plan, self.plan = self.plan, None
            return plan
        self.drop()
        return None


@dataclass
class Served:
    """Where a served step is counted and timed, its live fidelity check, and the slot its plan goes to."""

    counters: Counters
    recent: RecentSteps
    timer: HeadTimer
    fidelity: FidelityCheck
    slot: PlanSlot


def compact_head(head: FlashHead) -> CompactHead:
    """The head's :class:`CompactHead`, made on first use."""
    found = _COMPACT_HEADS.get(head)
    if found is None:
        found = _COMPACT_HEADS[head] = CompactHead(head)
    return found


def table_bytes(head: FlashHead) -> int:
    """Bytes of the head's estimate table in slot order, each layout once a compact step needed it (0 before)."""
    found = _COMPACT_HEADS.get(head)
    return found.nbytes if found is not None else 0


def head_draws(head: FlashHead) -> bool:
    """Whether `head` can plan compact rows: a CPU head with a sampled rows' estimate."""
    return head.weight.device.type == "cpu" and bool(head.estimate.rank)


def rows_to_draw(
    rows: StepRows, settings: FlashHeadSettings, head: FlashHead, vocab_range: tuple[int, int] | None
) -> np.ndarray | None:
    """The step's rows drawn from the compact law (ascending), or None."""
    if rows.compact is None or rows.temperature is None or rows.min_p is None or rows.verify_rows is not None:
        return None
    if not (settings.compact_sampling and settings.probe_sampling) or vocab_range is not None:
        return None
    if not head_draws(head):
        return None
    chosen = np.flatnonzero(rows.compact & (rows.dense_codes == 0))
    return chosen if chosen.size else None


def serve(
    head: FlashHead,
    hidden: torch.Tensor,
    rows: StepRows,
    compact: np.ndarray,
    dense_rows: np.ndarray,
    dense: Product,
    pins: PinnedIds | None,
    postprocess: Product,
    served: Served,
    check_every: int,
) -> torch.Tensor:
    """The step's logits; the plan of its `compact` rows goes to `served.slot` (the module docstring).  The live
    fidelity check (one row in `check_every`, 0: off) runs on the other FlashHead rows."""
    assert rows.temperature is not None and rows.min_p is not None
    planner = compact_head(head)
    timer = served.timer
    token = timer.start(hidden.device)
    groups = _by_exact_set(rows, compact)
    indices = [index_tensor(group, hidden.device) for group, _ in groups]
    plans = [
        planner.plan(
            hidden.index_select(0, index),
            torch.from_numpy(rows.temperature[group]),
            pinned=pins,
            postprocess=postprocess,
            clusters=compact_clusters(head, top_k_with_top_p=top_k_with_top_p),
        )
        for index, (group, top_k_with_top_p) in zip(indices, groups, strict=True)
    ]
    logits = torch.empty((hidden.shape[0], head.vocab_size), dtype=plans[0][0].dtype, device=hidden.device)
    for index, (placeholder, _) in zip(indices, plans, strict=True):
        logits.index_copy_(0, index, placeholder)
    compact = np.concatenate([group for group, _ in groups])
    planned = CompactRows.concat([part for _, part in plans])
    is_compact = np.zeros(rows.num_rows, dtype=bool)
    is_compact[compact] = True
    others = np.flatnonzero((rows.dense_codes == 0) & ~is_compact)
    if others.size:
        other_index = index_tensor(others, hidden.device)
        other_hidden = hidden.index_select(0, other_index)
        sampled = rows.sampled[others]
        part = head.step_logits(other_hidden, sampled=sampled, pinned=pins, postprocess=postprocess)
        logits.index_copy_(0, other_index, part.to(logits.dtype))
    timer.stop(token)
    if check_every and others.size:
        served.fidelity.check(check_every, other_hidden, logits, other_index, dense, sampled)
    if dense_rows.size:
        dense_index = index_tensor(dense_rows, hidden.device)
        logits[dense_index] = dense(hidden.index_select(0, dense_index)).to(logits.dtype)
    flash_sampled = int(np.count_nonzero(rows.sampled[rows.dense_codes == 0]))
    greedy = rows.num_rows - int(dense_rows.size) - flash_sampled
    count_served(served.counters, served.recent, rows, greedy, flash_sampled, int(dense_rows.size), False)
    served.slot.put(StepPlan(logits, compact, planned, planner, rows.min_p[compact], rows.sampled & ~is_compact))
    return logits


def _by_exact_set(rows: StepRows, compact: np.ndarray) -> list[tuple[np.ndarray, bool]]:
    """The `compact` rows by the size of their exact set: `(rows, with both top_k and top_p)`, each group planned at
    once (`compact_clusters`)."""
    wide = rows.top_k_with_top_p[compact] if rows.top_k_with_top_p is not None else np.zeros(compact.size, bool)
    groups = [(compact[~wide], False), (compact[wide], True)]
    return [(group, kind) for group, kind in groups if group.size]


def draw(
    plan: StepPlan,
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor,
    tally: Counter,
) -> torch.Tensor:
    """``[len(plan.rows)]`` tokens of the plan's rows, from ``logits`` (the step's rows as vLLM's sampler holds them:
    processed, divided by the temperature) with ``seeds`` (one per compact row, drawn as vLLM draws them); counts
    what the draw did in ``tally``."""
    compact = plan.compact
    # Read only the exact sets: flat positions row * V + id (no copy of the placeholder rows).
    offsets = index_tensor(plan.rows, logits.device).view(-1, 1) * logits.shape[1]
    exact = logits.reshape(-1).take(offsets + compact.exact_ids).float()
    exact.masked_fill_(~compact.exact_valid, float("-inf"))
    drawn = compact_draw(
        compact.exact_ids,
        exact,
        compact.atoms,
        plan.filters(top_k, top_p),
        row_keys(seeds),
        lambda row, clusters: plan.head.resolve(compact, row, clusters),
        plan.head.head.vocab_size,
    )
    tally["rows"] += compact.num_rows
    tally["resolved_clusters"] += drawn.resolved_clusters
    tally["over_budget_rows"] += drawn.over_budget_rows
    tally["atom_rows"] += drawn.atom_rows
    tally["bound_rows"] += drawn.bound_rows
    tally["bound_sum"] += drawn.bound_sum
    return drawn.tokens
