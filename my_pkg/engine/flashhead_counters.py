"""FlashHead's counters in one worker, and the timer of the head that feeds them."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FlashHeadCounters:
    steps: int = 0
    rows_flashhead: int = 0
    rows_dense: Counter = field(default_factory=Counter)
    fallbacks: int = 0
    head_seconds: float = 0.0
    fidelity_rows: int = 0
    fidelity_agreed: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "rows_flashhead": self.rows_flashhead,
            "rows_dense": dict(sorted(self.rows_dense.items())),
            "fallbacks": self.fallbacks,
            "head_seconds": round(self.head_seconds, 6),
            "fidelity_rows": self.fidelity_rows,
            "fidelity_agreed": self.fidelity_agreed,
        }


class HeadTimer:
    """Accumulates time spent in the head without a host sync on GPU.

    CPU steps are timed with perf_counter; CUDA steps record events whose
    elapsed time is collected once they have completed.
    """

    def __init__(self, counters: FlashHeadCounters) -> None:
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
