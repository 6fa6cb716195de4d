"""Which way serves a step's FlashHead rows, from the start-up timing corrected by the served steps' own times.

Both ways give every row FlashHead's answer (FlashHead's kernels, or the dense product masked to it:
`my_pkg.flashhead.masked`), so this choice only costs time, never changes a token. `StepWays`:

1. keys each step by its bucket of rows (1, 2, 3-4, 5-8, ...) and kind (greedy, sampled or mixed rows);
2. predicts each way's seconds from the served steps of that key (a running mean), else from the start-up
   timing (`StepCosts`), else prefers FlashHead's kernels;
3. keeps the way it took last for the key unless the other is predicted `switch_margin` cheaper (hysteresis),
   and serves the second step of a key, then one step in `explore_every`, the other way, so that both ways have
   times from served steps soon (the start-up timing extrapolates past the batches it reached) and keep them fresh;
4. forgets FlashHead's kernels' times after an update that changes their cost (`n_probes`): the next steps of each key
   time it again while they serve, instead of a re-timing that would hold up the engine.

Host numbers only; CPU heads (the host clock times a CPU step, not an accelerator's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from my_pkg.contract import ServedWay
from my_pkg.flashhead.step_costs import StepCosts, StepPlan

__all__ = ["StepWays"]

Kind = Literal["greedy", "sampled", "mixed"]
_WAYS: tuple[StepPlan, StepPlan] = ("flashhead", "masked")


@dataclass
class _Served:
    """One key's served steps: the way it takes now, each way's running mean seconds, and its step count."""

    way: StepPlan = "flashhead"
    flashhead_s: float | None = None
    masked_s: float | None = None
    steps: int = 0


def _bucket(rows: int) -> int:
    """0 for 1 row, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return max(0, rows - 1).bit_length()


def _bucket_label(bucket: int) -> str:
    if bucket <= 1:
        return str(bucket + 1)
    return f"{2 ** (bucket - 1) + 1}-{2**bucket}"


class StepWays:
    """The way each step's FlashHead rows take (see the module docstring)."""

    def __init__(
        self,
        prior: StepCosts | None,
        *,
        weight: float = 0.25,
        switch_margin: float = 1.1,
        explore_every: int = 64,
    ) -> None:
        self.prior = prior
        self.weight = weight
        self.switch_margin = switch_margin
        self.explore_every = explore_every
        self._served: dict[tuple[int, Kind], _Served] = {}
        self._kernels_retimed = False  # FlashHead's start-up times are stale (an update changed its cost)

    @property
    def timed(self) -> bool:
        """Whether the masked way can serve any step (it was timed at start-up)."""
        return self.prior is not None and self.prior.masked_greedy_s is not None

    def choose(self, greedy: int, sampled: int, dense: int = 0, *, check_every: int = 0) -> StepPlan:
        """The way for a step of `greedy` and `sampled` FlashHead rows and `dense` rows that need the dense head."""
        if not self.timed or greedy + sampled == 0:
            return "flashhead"
        served = self._served.setdefault(self._key(greedy, sampled, dense), _Served())
        served.steps += 1
        predicted = {way: self._predicted(served, way, greedy, sampled, dense, check_every) for way in _WAYS}
        other: StepPlan = "masked" if served.way == "flashhead" else "flashhead"
        if served.steps == 1:
            served.way = min(_WAYS, key=lambda way: predicted[way] * (self.switch_margin if way == "masked" else 1))
        elif predicted[other] * self.switch_margin < predicted[served.way]:
            served.way = other
        elif math.isfinite(predicted[other]) and (
            served.steps % self.explore_every == 0 or (served.steps == 2 and getattr(served, f"{other}_s") is None)
        ):
            return other  # the second step of a bucket, then one in `explore_every`: both ways' times from served steps
        return served.way

    def observe(self, greedy: int, sampled: int, dense: int, way: StepPlan, seconds: float) -> None:
        """A served step's seconds, the way it was served."""
        if not self.timed or greedy + sampled == 0 or not math.isfinite(seconds) or seconds < 0:
            return
        served = self._served.setdefault(self._key(greedy, sampled, dense), _Served())
        name = f"{way}_s"
        mean = getattr(served, name)
        setattr(served, name, seconds if mean is None else mean + self.weight * (seconds - mean))

    def forget_kernels(self) -> None:
        """Drop FlashHead's served and start-up times (an update changed what its kernels cost): each key serves
        FlashHead's kernels again until a served step timed them."""
        for served in self._served.values():
            served.way, served.flashhead_s, served.steps = "flashhead", None, 0
        self._kernels_retimed = True

    def report(self) -> list[ServedWay]:
        return [
            ServedWay(
                rows=_bucket_label(bucket),
                kind=kind,
                way=served.way,
                flashhead_ms=None if served.flashhead_s is None else round(served.flashhead_s * 1e3, 4),
                masked_ms=None if served.masked_s is None else round(served.masked_s * 1e3, 4),
                steps=served.steps,
            )
            for (bucket, kind), served in sorted(self._served.items())
        ]

    def _key(self, greedy: int, sampled: int, dense: int) -> tuple[int, Kind]:
        kind: Kind = "greedy" if not sampled else "sampled" if not greedy else "mixed"
        return _bucket(greedy + sampled + dense), kind

    def _predicted(
        self, served: _Served, way: StepPlan, greedy: int, sampled: int, dense: int, check_every: int
    ) -> float:
        seen = getattr(served, f"{way}_s")
        if seen is not None:
            return seen
        prior = self.prior
        assert prior is not None
        if way == "masked":
            return prior.masked_s(greedy, sampled, dense)
        if self._kernels_retimed:
            return 0.0  # unknown since an update: served this way until a served step times it
        check_s = prior.dense_s_at(1) / check_every if check_every > 0 else 0.0
        return prior.flashhead_s(greedy, sampled) + (greedy + sampled) * check_s + prior.dense_s_at(dense)
