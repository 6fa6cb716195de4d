"""`step`: why a whole step goes dense, and which rows go dense for their request."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from my_pkg.engine.flashhead.rows import DenseReason, StepRows
from my_pkg.engine.flashhead.step import all_dense_reason, dense_rows
from my_pkg.engine.flashhead.telemetry import Counters


@dataclasses.dataclass
class _Settings:
    enabled: bool = True
    dense_batch_threshold: int | None = None


def _rows(num_rows: int = 4, **kwargs) -> StepRows:
    return StepRows(np.zeros(num_rows, np.uint8), np.zeros(num_rows, bool), **kwargs)


@pytest.mark.parametrize(
    ("rows", "num_rows", "settings", "built", "missing", "reason"),
    [
        (_rows(), 4, _Settings(), True, False, None),
        (_rows(all_dense="speculative"), 4, _Settings(enabled=False), False, True, "speculative"),  # first
        (_rows(), 3, _Settings(enabled=False), False, True, "unexpected_rows"),
        (_rows(), 4, _Settings(enabled=False), False, True, "disabled"),
        (_rows(), 4, _Settings(), False, True, "unavailable"),
        (_rows(), 4, _Settings(dense_batch_threshold=3), True, True, "batch_threshold"),
        (_rows(), 4, _Settings(dense_batch_threshold=4), True, True, "error"),  # the exchange did not happen
    ],
)
def test_a_whole_step_goes_dense_for_the_first_reason_that_holds(rows, num_rows, settings, built, missing, reason):
    assert all_dense_reason(rows, num_rows, settings, built, missing) == reason


def test_the_rows_dense_for_their_request_are_counted_by_reason():
    codes = np.array([0, DenseReason.LOGPROBS, 0, DenseReason.LOGPROBS], np.uint8)
    counters = Counters()
    rows = StepRows(codes, np.zeros(4, bool))
    assert dense_rows(rows, counters).tolist() == [1, 3]
    assert counters.rows_dense == {DenseReason.LOGPROBS.label: 2}
