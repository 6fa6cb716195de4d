"""Which rows of a decode step FlashHead or the dense head serves faster, measured on this machine.

Where FlashHead stops paying depends on the machine, the dtype, the head's shape and the kind of rows:
a dense head whose product is a packed GEMM costs little more for 8 rows than for one, while each
FlashHead row costs its own candidates (a sampled row its estimate too).  Instead of a table of
known machines, :func:`measure_step_costs` times both on this one, on the head as it will serve, at
batches of 1, 2, 4, ... rows (as many as a time budget allows), and :class:`StepCosts` predicts a
step's cost from the measured points:

* ``g`` greedy FlashHead rows cost the measured greedy step time at ``g`` rows, ``s`` sampled ones the
  sampled step time at ``s``; a step with both costs the two added, less what the measured mixed steps
  (every other row sampled) of ``g + s`` rows saved on such a sum; each FlashHead row adds the live
  fidelity check's share of a dense row; rows served dense cost the dense head's time at their count;
* between measured batches the times are interpolated linearly; beyond the largest measured batch each
  side's time grows at the rate it grew between the last two (a dense GEMM costs less per row at 32
  rows than at 8, so growing in proportion would overstate it).

:meth:`StepCosts.plan` picks the cheapest of three ways to serve a step: every row as asked
(``flashhead``), the sampled rows on the dense head and the greedy ones on FlashHead (``sampled_dense``),
or every row on the dense head (``dense``).  A way that uses FlashHead counts 10 % more: a step within
10 % of a tie goes wholly to the dense head, whose logits are exact, so that a prediction somewhat off
near the tie does not make the step slower than dense (the start-up times of one head varied by 10–20 %
at some batches from one run to the next on a shared 2-core machine, docs/benchmarks.md).  The margin
covers the dense rows of a step split between the heads too: such a step adds two timings' errors, and
puts its logits together from both heads' outputs, which no timing sees.  An exact tie goes to the way
with more dense rows.

Tensor-parallel ranks time their own parts and exchange their timings once (:func:`pack_costs`,
:func:`unpack_costs`); :func:`slowest_costs` makes them one, from which every rank plans alike.
Imports torch and numpy only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Literal

import numpy as np
import torch

__all__ = [
    "MEASURED_BATCHES",
    "MEASURE_BUDGET_S",
    "PACKED_COSTS",
    "StepCosts",
    "StepPlan",
    "measure_step_costs",
    "pack_costs",
    "retime_greedy",
    "slowest_costs",
    "unpack_costs",
]

#: How a step's rows are served: as asked, its sampled rows dense, or every row dense.
StepPlan = Literal["flashhead", "sampled_dense", "dense"]

#: Batches :func:`measure_step_costs` times, in this order, until its budget is spent.
MEASURED_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Seconds :func:`measure_step_costs`'s first pass may spend before it starts another batch (batch 1 is always
#: timed); its second pass over the same batches takes about as long again.
MEASURE_BUDGET_S = 4.0
#: float64 values :func:`pack_costs` packs a timing into: the batches, then the dense, greedy, sampled and mixed times
#: at each, each padded to ``len(MEASURED_BATCHES)`` with NaN.
PACKED_COSTS = 5 * len(MEASURED_BATCHES)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step (the fastest of a few runs) at each of ``batches`` rows: the dense head, FlashHead
    with every row greedy, FlashHead with every row sampled (None when sampled rows are served as greedy
    ones), and FlashHead with every other row sampled (``mixed_s``: NaN at one row, which cannot mix; None
    when not timed)."""

    batches: tuple[int, ...]
    dense_s: tuple[float, ...]
    greedy_s: tuple[float, ...]
    sampled_s: tuple[float, ...] | None
    mixed_s: tuple[float, ...] | None = None
    #: FlashHead's predicted time counts this many times over (the module docstring says why).
    margin: float = 1.1

    def __post_init__(self) -> None:
        sizes = {len(self.batches), len(self.dense_s), len(self.greedy_s)}
        for times in (self.sampled_s, self.mixed_s):
            if times is not None:
                sizes.add(len(times))
        if self.mixed_s is not None and self.sampled_s is None:
            raise ValueError("StepCosts: mixed steps were timed without sampled rows")
        if len(sizes) != 1 or not self.batches:
            raise ValueError("StepCosts needs one time per batch on every side, and at least one batch")
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError(f"batches must be increasing positive row counts, got {self.batches}")

    def _at(self, times: Sequence[float], rows: int) -> float:
        last = self.batches[-1]
        if rows <= last:
            return float(np.interp(rows, self.batches, times))
        if len(self.batches) == 1:
            return times[-1] * rows / last
        slope = (times[-1] - times[-2]) / (last - self.batches[-2])
        return times[-1] + max(slope, 0.0) * (rows - last)

    def flashhead_s(self, greedy: int, sampled: int) -> float:
        """Predicted seconds of FlashHead for a step of ``greedy`` and ``sampled`` rows.  A mixed step pays both
        kinds' fixed costs (stage 1 for its greedy rows, the estimate's ``[V, r]`` table for its sampled ones),
        so it is predicted as a step of each kind alone, added, less what the timed mixed steps of as many rows
        saved on that sum (:meth:`mixed_saving_s`: the kinds share one pass over the head).  Without sampled
        times (sampled rows scored as greedy) one greedy step of all the rows."""
        if self.sampled_s is None:
            return self._at(self.greedy_s, greedy + sampled) if greedy + sampled else 0.0
        if not sampled:
            return self._at(self.greedy_s, greedy) if greedy else 0.0
        if not greedy:
            return self._at(self.sampled_s, sampled)
        alone = (self._at(self.greedy_s, greedy), self._at(self.sampled_s, sampled))
        return max(*alone, sum(alone) - self.mixed_saving_s(greedy + sampled))

    def mixed_saving_s(self, rows: int) -> float:
        """What a timed mixed step of ``rows`` rows (every other row sampled) cost less than a greedy step of half
        its rows and a sampled step of the other half (negative where it cost more), interpolated between the
        timed batches and held beyond them; 0 where no mixed step was timed."""
        batches, saved = self._mixed_savings
        return float(np.interp(rows, batches, saved)) if batches else 0.0

    @cached_property
    def _mixed_savings(self) -> tuple[list[int], list[float]]:
        """The timed mixed steps' batches and savings (:meth:`mixed_saving_s`), computed once, not per step."""
        if self.mixed_s is None or self.sampled_s is None:
            return [], []
        timed = [(b, m) for b, m in zip(self.batches, self.mixed_s, strict=True) if b >= 2 and not math.isnan(m)]
        # `_mixed(b)` samples b // 2 rows and leaves the other b - b // 2 greedy.
        saved = [self._at(self.greedy_s, b - b // 2) + self._at(self.sampled_s, b // 2) - m for b, m in timed]
        return [b for b, _ in timed], saved

    def dense_s_at(self, rows: int) -> float:
        """Predicted seconds of the dense head for a step of ``rows`` rows."""
        return self._at(self.dense_s, rows) if rows else 0.0

    def plan(self, greedy: int, sampled: int, dense: int = 0, *, check_every: int = 0) -> StepPlan:
        """The cheapest way to serve a step whose ``greedy`` and ``sampled`` rows FlashHead may serve and
        whose ``dense`` rows need the dense head anyway. ``check_every`` > 0: one FlashHead row in that many
        also gets the dense head's logits (the live fidelity check), a dense row's time each."""
        if greedy + sampled == 0:
            return "flashhead"
        check_s = self.dense_s_at(1) / check_every if check_every > 0 else 0.0

        def served(greedy: int, sampled: int, dense: int) -> float:
            flashhead = self.flashhead_s(greedy, sampled) + (greedy + sampled) * check_s
            return self.margin * (flashhead + self.dense_s_at(dense))

        costs: dict[StepPlan, float] = {
            "dense": self.dense_s_at(greedy + sampled + dense),
            "sampled_dense": served(greedy, 0, sampled + dense) if sampled else math.inf,
            "flashhead": served(greedy, sampled, dense),
        }
        return min(costs, key=costs.__getitem__)  # the first of equal costs: more rows exact

    def dense_from(self, *, sampled: bool, check_every: int = 0) -> int | None:
        """The smallest measured batch at which a step of only greedy (or only sampled) rows is not served
        by FlashHead, None when FlashHead serves it at every measured batch."""
        for rows in self.batches:
            greedy_rows, sampled_rows = (0, rows) if sampled else (rows, 0)
            if self.plan(greedy_rows, sampled_rows, check_every=check_every) != "flashhead":
                return rows
        return None

    def dense_from_every_kind(self, *, check_every: int = 0) -> int | None:
        """The smallest timed batch from which a step is served dense whatever its rows (greedy only, sampled only
        or every other row sampled), at that batch and every larger timed one; None when FlashHead serves some
        kind at the largest.  Tensor-parallel ranks serve every step from this batch of their agreed timing
        (:func:`slowest_costs`) dense, without their stage-1 exchange."""
        found = None
        for rows in reversed(self.batches):
            kinds = [(rows, 0)]
            if self.sampled_s is not None:  # sampled only, and mixed as the mixed steps were timed
                kinds += [(0, rows), (rows - rows // 2, rows // 2)]
            if any(self.plan(greedy, sampled, check_every=check_every) != "dense" for greedy, sampled in kinds):
                return found
            found = rows
        return found


def pack_costs(costs: StepCosts | None) -> torch.Tensor:
    """``costs`` as ``PACKED_COSTS`` float64 values (all NaN for None, or for a timing at more batches than
    ``MEASURED_BATCHES``), for :func:`unpack_costs` on another process."""
    width = len(MEASURED_BATCHES)
    table = torch.full((5, width), math.nan, dtype=torch.float64)
    if costs is not None and len(costs.batches) <= width:
        for side, times in enumerate((costs.batches, costs.dense_s, costs.greedy_s, costs.sampled_s, costs.mixed_s)):
            if times is not None:
                table[side, : len(times)] = torch.tensor(times, dtype=torch.float64)
    return table.flatten()


def unpack_costs(packed: torch.Tensor) -> StepCosts | None:
    """The timing :func:`pack_costs` packed (None for none)."""
    table = packed.detach().to(device="cpu", dtype=torch.float64).reshape(5, -1)
    timed = int((~torch.isnan(table[0])).sum())
    if timed == 0:
        return None

    def side(index: int) -> tuple[float, ...] | None:
        times = tuple(float(t) for t in table[index, :timed])
        return None if index >= 3 and all(math.isnan(t) for t in times) else times

    return StepCosts(tuple(int(b) for b in table[0, :timed]), side(1), side(2), side(3), side(4))


def slowest_costs(timings: Sequence[StepCosts | None]) -> StepCosts | None:
    """One timing for tensor-parallel ranks that timed their own parts: each side's time at each batch is the slowest
    rank's (a step lasts as long as its slowest rank: vLLM's logits gather waits for every rank), at the batches
    every rank timed.  None when some rank has no timing, or no batch is common; a side some rank did not time
    (sampled or mixed steps) is left out."""
    if not timings or any(costs is None for costs in timings):
        return None
    batches = sorted(set.intersection(*(set(costs.batches) for costs in timings)))
    if not batches:
        return None

    def side(name: str) -> tuple[float, ...] | None:
        tables = [getattr(costs, name) for costs in timings]
        if any(times is None for times in tables):
            return None
        at = [dict(zip(costs.batches, times, strict=True)) for costs, times in zip(timings, tables, strict=True)]
        slowest = [[times[b] for times in at] for b in batches]
        return tuple(math.nan if any(map(math.isnan, ts)) else max(ts) for ts in slowest)  # NaN: one row, no mix

    sampled = side("sampled_s")
    return StepCosts(
        tuple(batches), side("dense_s"), side("greedy_s"), sampled, side("mixed_s") if sampled is not None else None
    )


def _fastest_s(runs: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    """Each run's fastest time of ``repeats``, the runs taking turns (``a b c a b c ...``) after one untimed call
    each, so that another process's work lands on every side alike."""
    for run in runs.values():
        run()  # first call at this shape: allocations, tables, the GEMM's kernel choice
    fastest = dict.fromkeys(runs, math.inf)
    for _ in range(repeats):
        for name, run in runs.items():
            start = clock()
            run()
            fastest[name] = min(fastest[name], clock() - start)
    return fastest


def _time_batches(
    runs_at: Callable[[int], dict[str, Callable[[], object]]],
    batches: Sequence[int],
    *,
    budget_s: float,
    repeats: int,
    passes: int,
    clock: Callable[[], float],
) -> dict[int, dict[str, float]]:
    """Each run's fastest time at each of ``batches`` rows (``runs_at(rows)`` gives the runs): a first pass in
    order until ``budget_s`` is spent (the first batch always), then ``passes - 1`` more over the batches it
    reached."""
    fastest: dict[int, dict[str, float]] = {}
    started = clock()
    for sweep in range(passes):
        for rows in batches if sweep == 0 else list(fastest):
            if sweep == 0 and fastest and clock() - started > budget_s:
                break
            times = _fastest_s(runs_at(rows), repeats, clock)
            best = fastest.setdefault(rows, times)
            for name, seconds in times.items():
                best[name] = min(best[name], seconds)
    return fastest


def _hidden(rows: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, hidden_size, generator=generator).to(dtype)


def measure_step_costs(
    flashhead_step: Callable[[torch.Tensor, np.ndarray], object],
    dense_step: Callable[[torch.Tensor], object],
    hidden_size: int,
    *,
    dtype: torch.dtype,
    sampled_rows: bool,
    batches: Sequence[int] = MEASURED_BATCHES,
    budget_s: float = MEASURE_BUDGET_S,
    repeats: int = 2,
    passes: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> StepCosts:
    """Time ``dense_step(hidden)`` and ``flashhead_step(hidden, sampled)`` (greedy rows, then, when
    ``sampled_rows``, sampled rows and mixed steps of every other row sampled) on random CPU hidden states at
    each of ``batches`` rows, ``repeats`` times after one untimed call, the sides taking turns, until
    ``budget_s`` is spent; then ``passes - 1`` more times over the batches the first pass reached.  Each
    side's time is its fastest run (another process's work only ever adds time; the first pass over fresh
    memory can run slow at some sizes).

    CPU only: the calls are timed by the host clock, which on an accelerator would time the launch.
    The hidden states are random: a row scores a fixed number of clusters and estimated tokens whatever
    its values, and random rows probe unrelated clusters and rank unrelated tokens best, which makes the
    times an upper bound: decode rows of real text share some (half of their ids at 8 rows on the trained
    fixture, ``python -m bench.union_rows --fixture``), and a batch reads each shared head row once.
    """
    hidden = _hidden(max(batches), hidden_size, dtype)

    def runs_at(rows: int) -> dict[str, Callable[[], object]]:
        part = hidden[:rows]
        runs: dict[str, Callable[[], object]] = {
            "dense": partial(dense_step, part),
            "greedy": partial(flashhead_step, part, np.zeros(rows, dtype=bool)),
        }
        if sampled_rows:
            runs["sampled"] = partial(flashhead_step, part, np.ones(rows, dtype=bool))
            if rows >= 2:
                runs["mixed"] = partial(flashhead_step, part, _mixed(rows))
        return runs

    fastest = _time_batches(runs_at, batches, budget_s=budget_s, repeats=repeats, passes=passes, clock=clock)
    measured = tuple(fastest)
    return StepCosts(
        measured,
        tuple(fastest[rows]["dense"] for rows in measured),
        tuple(fastest[rows]["greedy"] for rows in measured),
        tuple(fastest[rows]["sampled"] for rows in measured) if sampled_rows else None,
        tuple(fastest[rows].get("mixed", math.nan) for rows in measured) if sampled_rows else None,
    )


def _mixed(rows: int) -> np.ndarray:
    """Every other row sampled."""
    return np.arange(rows) % 2 == 1


def retime_greedy(
    costs: StepCosts,
    flashhead_step: Callable[[torch.Tensor, np.ndarray], object],
    hidden_size: int,
    *,
    dtype: torch.dtype,
    repeats: int = 2,
    passes: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> StepCosts:
    """``costs`` with its greedy rows, and the mixed steps that hold some, timed again at its batches, as
    :func:`measure_step_costs` times them but in one pass (the head's memory is no longer fresh, and the engine
    waits for it): a greedy row's cost follows the head's probe count, the dense head's and a sampled row's do
    not (about a quarter of the first timing's time)."""
    hidden = _hidden(costs.batches[-1], hidden_size, dtype)
    mixed = costs.mixed_s is not None

    def runs_at(rows: int) -> dict[str, Callable[[], object]]:
        runs = {"greedy": partial(flashhead_step, hidden[:rows], np.zeros(rows, dtype=bool))}
        if mixed and rows >= 2:
            runs["mixed"] = partial(flashhead_step, hidden[:rows], _mixed(rows))
        return runs

    fastest = _time_batches(runs_at, costs.batches, budget_s=math.inf, repeats=repeats, passes=passes, clock=clock)
    return replace(
        costs,
        greedy_s=tuple(fastest[rows]["greedy"] for rows in costs.batches),
        mixed_s=tuple(fastest[rows].get("mixed", math.nan) for rows in costs.batches) if mixed else None,
    )
