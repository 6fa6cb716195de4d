"""What one worker's FlashHead reports: its counters, failed steps, the head's timer and the live fidelity check.

None of it makes the host wait for the device: the timer records CUDA events and the fidelity
check keeps its sum on the device, both collected by `status()` once the device got there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from my_pkg.contract import CompactCounters, FlashHeadCounters, RecentRows
from my_pkg.flashhead.staging import index_tensor

__all__ = ["Counters", "Fallbacks", "FidelityCheck", "HeadTimer", "RecentSteps"]

logger = logging.getLogger(f"vllm.{__name__}")


class Fallbacks:
    """Steps that failed inside FlashHead and went dense: counted, and each kind of failure logged once."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._warned: set[str] = set()

    def record(self, exc: BaseException, num_rows: int) -> None:
        self._counters.fallbacks += 1
        self._counters.rows_dense["error"] += num_rows
        kind = type(exc).__name__
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(
                "my_pkg: FlashHead step failed, served dense instead (%s: %s); further %s failures are only counted",
                kind,
                exc,
                kind,
                exc_info=exc,
            )


class RecentSteps:
    """The rows of the last `window` decode steps: how many got FlashHead's answer (greedy, sampled; of those, how
    many the masked way made) and how many the dense head's, for the status's `recent` (a share over a window,
    where the counters only grow)."""

    def __init__(self, window: int = 256) -> None:
        self._steps: deque[tuple[int, int, int, int]] = deque(maxlen=window)

    def add(self, greedy: int, sampled: int, dense: int, masked: int = 0) -> None:
        self._steps.append((greedy, sampled, dense, masked))

    def report(self) -> RecentRows:
        greedy, sampled, dense, masked = (sum(column) for column in zip(*self._steps)) if self._steps else (0,) * 4
        rows = greedy + sampled + dense
        return RecentRows(
            steps=len(self._steps),
            rows_flashhead_greedy=greedy,
            rows_flashhead_sampled=sampled,
            rows_flashhead_masked=masked,
            rows_dense=dense,
            flashhead_share=round((greedy + sampled) / rows, 4) if rows else None,
        )


@dataclass
class Counters:
    """Counters since the worker started; `snapshot()` is the contract's `FlashHeadCounters`."""

    steps: int = 0
    rows_flashhead: int = 0
    rows_dense: Counter = field(default_factory=Counter)  # `contract.DenseRowReason` -> rows
    fallbacks: int = 0
    head_seconds: float = 0.0
    fidelity_rows: int = 0
    fidelity_agreed: int = 0
    fidelity_sampled_rows: int = 0  # of fidelity_rows: sampled rows, whose law's distance is in fidelity_tv_sum
    fidelity_tv_sum: float = 0.0
    rows_flashhead_verify: int = 0  # of rows_flashhead: speculative decoding's verify rows
    rows_flashhead_masked: int = 0  # of rows_flashhead: FlashHead's answer made from the dense product
    stage1_exchanges: int = 0  # under tensor parallelism: armed steps whose best clusters this rank exchanged
    compact: Counter = field(default_factory=Counter)  # `contract.CompactCounters`' fields -> values

    def snapshot(self, draft: Counters | None = None) -> FlashHeadCounters:
        """The contract's counters; `draft`: the drafter's FlashHead head's own counters under speculative
        decoding, reported as the draft rows (its fallbacks count with the target's)."""
        return FlashHeadCounters(
            steps=self.steps,
            rows_flashhead=self.rows_flashhead,
            rows_dense=dict(sorted(self.rows_dense.items())),
            fallbacks=self.fallbacks + (draft.fallbacks if draft is not None else 0),
            head_seconds=round(self.head_seconds, 6),
            fidelity_rows=self.fidelity_rows,
            fidelity_agreed=self.fidelity_agreed,
            fidelity_sampled_rows=self.fidelity_sampled_rows,
            fidelity_tv_sum=round(self.fidelity_tv_sum, 6),
            rows_flashhead_verify=self.rows_flashhead_verify,
            rows_flashhead_masked=self.rows_flashhead_masked,
            stage1_exchanges=self.stage1_exchanges,
            rows_flashhead_draft=draft.rows_flashhead if draft is not None else 0,
            rows_dense_draft=sum(draft.rows_dense.values()) if draft is not None else 0,
            compact=CompactCounters.model_validate(
                {name: round(value, 6) if isinstance(value, float) else value for name, value in self.compact.items()}
            ),
        )


class HeadTimer:
    """Accumulates time spent in the head without a host sync on GPU.

    CPU steps are timed with perf_counter; CUDA steps record events whose
    elapsed time is collected once they have completed.
    """

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._pending: list[tuple[Any, Any]] = []

    def start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token: Any) -> None:
        if isinstance(token, float):
            self._counters.head_seconds += time.perf_counter() - token
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((token, end))
        self.collect(block=False)

    def collect(self, block: bool) -> None:
        while self._pending:
            start, end = self._pending[0]
            if not block and not end.query():
                return
            end.synchronize()
            self._counters.head_seconds += start.elapsed_time(end) / 1000.0
            self._pending.pop(0)


class FidelityCheck:
    """Live fidelity telemetry: one FlashHead row in `every` also gets the dense logits, and counts as
    agreed when FlashHead's best token is a dense argmax (ties agree). A checked row that samples also adds the
    total variation distance between its law and the dense one, both at temperature 1 over the whole vocabulary
    (what the row's temperature, top-k and top-p then shape alike)."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._credit = 0
        self._agreed: torch.Tensor | None = None  # on the device: no host sync per check
        self._tv: torch.Tensor | None = None  # the sampled rows' total variation, summed on the device
        self._rows_pending = 0  # rows checked into `_agreed`, not yet in the counters
        self._sampled_pending = 0  # of those, sampled rows (their distances in `_tv`)
        self._ready: Any = None  # CUDA event recorded after the last check

    def check(
        self,
        every: int,
        flash_hidden: torch.Tensor,
        logits: torch.Tensor,
        flash_index: torch.Tensor | None,
        dense: Callable[[torch.Tensor], torch.Tensor],
        sampled: np.ndarray | None = None,
    ) -> None:
        """Check the step's first rows that `every` allows (`every <= 0`: off); `sampled`: which of the FlashHead
        rows sample (host booleans, one per row of `flash_hidden`)."""
        if every <= 0:
            return
        self._credit += int(flash_hidden.shape[0])
        checks = min(int(flash_hidden.shape[0]), self._credit // every)
        if checks <= 0:
            return
        self._credit -= checks * every
        reference = dense(flash_hidden[:checks]).float()
        served = logits[:checks] if flash_index is None else logits.index_select(0, flash_index[:checks])
        picked = reference.gather(1, served.argmax(dim=1, keepdim=True)).squeeze(1)
        agreed = (picked >= reference.max(dim=1).values).sum()
        self._agreed = agreed if self._agreed is None else self._agreed + agreed
        self._rows_pending += checks
        sampling = np.flatnonzero(sampled[:checks]) if sampled is not None else np.empty(0, dtype=np.int64)
        if sampling.size:
            rows = index_tensor(sampling, reference.device)
            tv = total_variation(served.index_select(0, rows).float(), reference.index_select(0, rows)).sum()
            self._tv = tv if self._tv is None else self._tv + tv
            self._sampled_pending += int(sampling.size)
        if agreed.is_cuda:  # `collect` reads the sum once this event says the device got there
            self._ready = torch.cuda.Event()
            self._ready.record()

    def collect(self) -> None:
        """Move the checks the device has finished into the counters, without waiting for it."""
        if self._agreed is None or (self._ready is not None and not self._ready.query()):
            return
        self._counters.fidelity_agreed += int(self._agreed)
        self._counters.fidelity_rows += self._rows_pending
        if self._tv is not None:
            self._counters.fidelity_tv_sum += float(self._tv)
            self._counters.fidelity_sampled_rows += self._sampled_pending
        self._agreed, self._ready, self._rows_pending = None, None, 0
        self._tv, self._sampled_pending = None, 0


def total_variation(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`[B]` total variation distance between the laws of two `[B, V]` logits rows at temperature 1 (-inf: mass 0)."""
    return 0.5 * (torch.softmax(logits, dim=-1) - torch.softmax(reference, dim=-1)).abs().sum(dim=-1)
