"""How a decode step's FlashHead rows are served fastest, measured on this machine.

Where FlashHead's kernels stop paying depends on the machine, the dtype, the head's shape and the kind of rows:
a dense head whose product is a packed GEMM costs little more for 8 rows than for one, while each
FlashHead row costs its own candidates (a sampled row its estimate too).  Instead of a table of
known machines, :func:`measure_step_costs` times the dense head, FlashHead's kernels and the masked way
(below) on this one, on the head as it will serve, at
batches of 1, 2, 4, ... rows (as many as a time budget allows), and :class:`StepCosts` predicts a
step's cost from the measured points:

* ``g`` greedy FlashHead rows cost the measured greedy step time at ``g`` rows, ``s`` sampled ones the
  sampled step time at ``s``; a step with both costs the two added, less what the measured mixed steps
  (every other row sampled) of ``g + s`` rows saved on such a sum; each FlashHead row adds the live
  fidelity check's share of a dense row; rows served dense cost the dense head's time at their count;
* the masked way costs one dense product of the step's rows, plus what masking cost over the dense product
  in the timed masked steps of each kind;
* between measured batches the times are interpolated linearly; beyond the largest measured batch each
  side's time grows at the rate it grew between the last two (a dense GEMM costs less per row at 32
  rows than at 8, so growing in proportion would overstate it).

:meth:`StepCosts.plan` picks the cheaper of two ways to serve a step's FlashHead rows, which give every row
the same answer: FlashHead's own kernels (``flashhead``), or vLLM's dense product for the whole step with
each FlashHead row masked to FlashHead's answer (``masked``, :mod:`~my_pkg.flashhead.masked`: stage 1 and,
for sampled rows, the estimate, then the dense head's values on the tokens FlashHead scores exactly).  Rows
that need exact logits are served by the dense product on either way, and never move their neighbours.
FlashHead's kernels keep a step unless the masked way is predicted at least 10 % cheaper: the choice only
costs time, and a prediction near a tie is as likely off either way.

Tensor-parallel ranks time and choose for their own parts: the ways differ in cost only.
Imports torch and numpy only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Literal

import numpy as np
import torch

__all__ = [
    "MEASURED_BATCHES",
    "MEASURE_BUDGET_S",
    "StepCosts",
    "StepPlan",
    "device_clock",
    "measure_step_costs",
]

#: Which kernel serves a step's FlashHead rows: FlashHead's own, or the dense product masked to FlashHead's answer.
StepPlan = Literal["flashhead", "masked"]

#: Batches :func:`measure_step_costs` times, in this order, until its budget is spent.
MEASURED_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Seconds :func:`measure_step_costs`'s first pass may spend before it starts another batch (batch 1 is always
#: timed); its second pass over the same batches takes about as long again.
MEASURE_BUDGET_S = 4.0
#: The timed sides of a :class:`StepCosts`.
_SIDES = ("dense_s", "greedy_s", "sampled_s", "mixed_s", "masked_greedy_s", "masked_sampled_s")


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step (the fastest of a few runs) at each of ``batches`` rows: the dense head, FlashHead
    with every row greedy, FlashHead with every row sampled (None when sampled rows are served as greedy
    ones), FlashHead with every other row sampled (``mixed_s``: NaN at one row, which cannot mix; None
    when not timed), and the masked way (the dense product, then :mod:`~my_pkg.flashhead.masked`) with every
    row greedy and every row sampled (None when not timed: FlashHead's kernels serve every step)."""

    batches: tuple[int, ...]
    dense_s: tuple[float, ...]
    greedy_s: tuple[float, ...]
    sampled_s: tuple[float, ...] | None
    mixed_s: tuple[float, ...] | None = None
    masked_greedy_s: tuple[float, ...] | None = None
    masked_sampled_s: tuple[float, ...] | None = None
    #: The masked way serves a step only when predicted this much cheaper than FlashHead's kernels.
    margin: float = 1.1

    def __post_init__(self) -> None:
        sizes = {len(self.batches)}
        for name in _SIDES:
            times = getattr(self, name)
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

    def masked_s(self, greedy: int, sampled: int, dense: int = 0) -> float:
        """Predicted seconds of the masked way for a step of ``greedy`` and ``sampled`` FlashHead rows and ``dense``
        rows that need the dense head: one dense product of every row, plus what masking cost over the dense
        product in the timed masked steps of each kind (sampled rows as greedy ones when they were not timed);
        ``inf`` when the masked way was not timed."""
        if self.masked_greedy_s is None:
            return math.inf
        masked_sampled = self.masked_sampled_s if self.masked_sampled_s is not None else self.masked_greedy_s
        extra = 0.0
        for rows, masked in ((greedy, self.masked_greedy_s), (sampled, masked_sampled)):
            if rows:
                extra += max(0.0, self._at(masked, rows) - self.dense_s_at(rows))
        return self.dense_s_at(greedy + sampled + dense) + extra

    def plan(self, greedy: int, sampled: int, dense: int = 0, *, check_every: int = 0) -> StepPlan:
        """The cheaper way to a step whose ``greedy`` and ``sampled`` rows get FlashHead's answer and whose
        ``dense`` rows need the dense head either way: FlashHead's kernels (and the dense head for the ``dense``
        rows), or the masked way (:meth:`masked_s`), which must be ``margin`` times cheaper.  ``check_every``
        > 0: one FlashHead row in that many also gets the dense head's logits on FlashHead's kernels (the live
        fidelity check), a dense row's time each."""
        if greedy + sampled == 0:
            return "flashhead"
        check_s = self.dense_s_at(1) / check_every if check_every > 0 else 0.0
        kernels = self.flashhead_s(greedy, sampled) + (greedy + sampled) * check_s + self.dense_s_at(dense)
        return "masked" if self.margin * self.masked_s(greedy, sampled, dense) < kernels else "flashhead"

    def slower_than_dense(self) -> str | None:
        """Why FlashHead's kernels do not pay here, or None: at the smallest timed batch (FlashHead's best case,
        one row of a decode), a greedy step, or a sampled one where sampled rows were timed, takes at least the
        dense head's time."""
        rows, dense_s = self.batches[0], self.dense_s[0]
        kinds = [("greedy", self.greedy_s[0])]
        if self.sampled_s is not None:
            kinds.append(("sampled", self.sampled_s[0]))
        slow = [f"a {kind} step {seconds * 1e3:.3f} ms" for kind, seconds in kinds if seconds >= dense_s]
        if not slow:
            return None
        return (
            f"FlashHead's kernels measured slower than the dense head at {rows} row(s): "
            f"{' and '.join(slow)} against the dense head's {dense_s * 1e3:.3f} ms"
        )

    def masked_from(self, *, sampled: bool, check_every: int = 0) -> int | None:
        """The smallest timed batch at which a step of only greedy (or only sampled) rows is served the masked
        way, None when FlashHead's kernels serve it at every timed batch."""
        for rows in self.batches:
            greedy_rows, sampled_rows = (0, rows) if sampled else (rows, 0)
            if self.plan(greedy_rows, sampled_rows, check_every=check_every) != "flashhead":
                return rows
        return None


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


def _hidden(rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, hidden_size, generator=generator).to(device=device, dtype=dtype)


def device_clock(device: torch.device) -> Callable[[], float]:
    """The host clock, read once ``device`` has finished the work queued on it: a call timed between two readings
    counts its whole run on an accelerator, not only its launches."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def measure_step_costs(
    flashhead_step: Callable[[torch.Tensor, np.ndarray], object],
    dense_step: Callable[[torch.Tensor], object],
    hidden_size: int,
    *,
    dtype: torch.dtype,
    sampled_rows: bool,
    masked_step: Callable[[torch.Tensor, np.ndarray], object] | None = None,
    batches: Sequence[int] = MEASURED_BATCHES,
    budget_s: float = MEASURE_BUDGET_S,
    repeats: int = 2,
    passes: int = 2,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] | None = None,
) -> StepCosts:
    """Time ``dense_step(hidden)`` and ``flashhead_step(hidden, sampled)`` (greedy rows, then, when
    ``sampled_rows``, sampled rows and mixed steps of every other row sampled), and with ``masked_step`` the
    masked way (greedy rows, and sampled rows when ``sampled_rows``) on random hidden states at
    each of ``batches`` rows, ``repeats`` times after one untimed call, the sides taking turns, until
    ``budget_s`` is spent; then ``passes - 1`` more times over the batches the first pass reached.  Each
    side's time is its fastest run (another process's work only ever adds time; the first pass over fresh
    memory can run slow at some sizes).

    The hidden states live on ``device``; the calls are timed by ``clock``, by default the host clock read once
    the device is idle (:func:`device_clock`: on an accelerator the whole run, launches and kernels, as if nothing
    overlapped them).  The hidden states are random: a row scores a fixed number of clusters and estimated tokens
    whatever its values, and random rows probe unrelated clusters and rank unrelated tokens best, which makes the
    times an upper bound: decode rows of real text share some (half of their ids at 8 rows on the trained
    fixture, ``python -m bench.experiments.union_rows --fixture``), and a batch reads each shared head row once.
    """
    device = torch.device(device)
    hidden = _hidden(max(batches), hidden_size, dtype, device)
    clock = clock if clock is not None else device_clock(device)

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
        if masked_step is not None:
            runs["masked_greedy"] = partial(masked_step, part, np.zeros(rows, dtype=bool))
            if sampled_rows:
                runs["masked_sampled"] = partial(masked_step, part, np.ones(rows, dtype=bool))
        return runs

    fastest = _time_batches(runs_at, batches, budget_s=budget_s, repeats=repeats, passes=passes, clock=clock)
    measured = tuple(fastest)
    return StepCosts(
        measured,
        tuple(fastest[rows]["dense"] for rows in measured),
        tuple(fastest[rows]["greedy"] for rows in measured),
        tuple(fastest[rows]["sampled"] for rows in measured) if sampled_rows else None,
        tuple(fastest[rows].get("mixed", math.nan) for rows in measured) if sampled_rows else None,
        tuple(fastest[rows]["masked_greedy"] for rows in measured) if masked_step is not None else None,
        tuple(fastest[rows]["masked_sampled"] for rows in measured) if masked_step and sampled_rows else None,
    )


def _mixed(rows: int) -> np.ndarray:
    """Every other row sampled."""
    return np.arange(rows) % 2 == 1
