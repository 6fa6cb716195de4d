"""`StepCosts`: predicting a step's cost from measured points, and `measure_step_costs` timing what it is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from my_pkg.flashhead.step_costs import StepCosts, measure_step_costs

# A dense head flat to 8 rows then linear; FlashHead greedy 4x cheaper per row at one row, sampled rows dearer; the
# masked way 1 over the dense product for greedy rows, 2 for sampled ones.
COSTS = StepCosts(
    batches=(1, 2, 4, 8, 16),
    dense_s=(8.0, 8.0, 8.0, 8.0, 16.0),
    greedy_s=(1.0, 2.0, 4.0, 8.0, 16.0),
    sampled_s=(2.0, 4.0, 8.0, 16.0, 32.0),
    masked_greedy_s=(9.0, 9.0, 9.0, 9.0, 17.0),
    masked_sampled_s=(10.0, 10.0, 10.0, 10.0, 18.0),
    margin=1.0,  # the arithmetic below without the default 10 %
)


def test_greedy_and_sampled_steps_take_the_masked_way_where_the_kernels_stop_paying():
    assert COSTS.plan(1, 0) == COSTS.plan(8, 0) == "flashhead"  # 8 against 9
    assert COSTS.plan(16, 0) == "flashhead"  # a tie keeps the kernels: 16 against 16 + 1
    assert COSTS.plan(0, 4) == "flashhead" and COSTS.plan(0, 8) == "masked"  # 16 against 8 + 2
    assert COSTS.masked_from(sampled=False) is None
    assert COSTS.masked_from(sampled=True) == 8


def test_the_masked_way_costs_one_dense_product_and_each_kinds_masking():
    assert COSTS.masked_s(4, 0) == pytest.approx(9.0)
    assert COSTS.masked_s(4, 4) == pytest.approx(8.0 + 1.0 + 2.0)
    assert COSTS.masked_s(4, 4, 8) == pytest.approx(16.0 + 1.0 + 2.0)  # the exact rows share the dense product
    greedy_only = StepCosts(COSTS.batches, COSTS.dense_s, COSTS.greedy_s, None, masked_greedy_s=COSTS.masked_greedy_s)
    assert greedy_only.masked_s(0, 4) == pytest.approx(9.0)  # sampled rows masked as greedy ones
    untimed = StepCosts(COSTS.batches, COSTS.dense_s, COSTS.greedy_s, COSTS.sampled_s)
    assert untimed.masked_s(4, 0) == float("inf") and untimed.plan(1000, 1000) == "flashhead"


def test_rows_that_need_the_dense_head_are_paid_on_either_way():
    # 3 greedy + 1 sampled + 4 exact: kernels 3 + 2 + dense(4) 8 = 13; masked dense(8) 8 + 1 + 2 = 11.
    assert COSTS.plan(3, 1, 4) == "masked"
    assert COSTS.plan(0, 0, 5) == "flashhead"  # no FlashHead row: nothing to decide
    # Without a masked timing, exact rows never move their neighbours: the kernels serve them.
    untimed = StepCosts(COSTS.batches, COSTS.dense_s, COSTS.greedy_s, COSTS.sampled_s, margin=1.0)
    assert untimed.plan(3, 1, 4) == "flashhead"


def test_a_timed_mixed_step_corrects_the_sum_of_its_kinds():
    nan = float("nan")
    base = dict(batches=(1, 8, 16), dense_s=(7.0, 7.0, 9.0), greedy_s=(2.0, 4.0, 6.0), sampled_s=(3.0, 6.0, 9.0))
    # The kinds shared one pass: 4 + 4 rows timed at 5.5, where greedy(4) + sampled(4) = 50 / 7.
    shared = StepCosts(**base, mixed_s=(nan, 5.5, 8.0), margin=1.0)
    assert shared.mixed_saving_s(8) == pytest.approx(50 / 7 - 5.5)
    assert shared.flashhead_s(4, 4) == pytest.approx(5.5)  # the timed step itself
    # 7 + 1 rows: greedy(7) + sampled(1) less the same saving, and never below either kind alone.
    assert shared.flashhead_s(7, 1) == pytest.approx(max(2 + 12 / 7, 2 + 12 / 7 + 3 - (50 / 7 - 5.5)))
    # Between the timed batches the saving is interpolated, beyond the last it is held.
    at_16 = 4 + 6 - 8.0
    assert shared.mixed_saving_s(12) == pytest.approx(((50 / 7 - 5.5) + at_16) / 2)
    assert shared.mixed_saving_s(64) == pytest.approx(at_16)
    # Mixed steps that cost more than the two kinds alone (a path without the shared pass): their timed cost.
    dearer = StepCosts(**base, mixed_s=(nan, 9.0, 14.0), margin=1.0)
    assert dearer.flashhead_s(4, 4) == pytest.approx(9.0)
    # Timed at one row only (nothing to mix): the sum.
    one = StepCosts((1,), (7.0,), (2.0,), (3.0,), (nan,), margin=1.0)
    assert one.mixed_saving_s(2) == 0.0 and one.flashhead_s(1, 1) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        StepCosts((1, 2), (1.0, 1.0), (1.0, 1.0), None, (nan, 1.0))  # mixed steps without sampled rows


def test_the_masked_way_must_be_predicted_ten_percent_cheaper_by_default():
    near = StepCosts((1, 8), (10.0, 10.0), (10.5, 10.5), None, masked_greedy_s=(10.0, 10.0))
    assert near.margin == pytest.approx(1.1)
    assert near.plan(1, 0) == "flashhead"  # 10 * 1.1 > 10.5
    assert StepCosts((1, 8), (10.0, 10.0), (11.5, 11.5), None, masked_greedy_s=(10.0, 10.0)).plan(1, 0) == "masked"


def test_the_live_fidelity_check_counts_a_dense_row_for_every_checked_row():
    # 4 greedy rows: kernels 4 against masked 9; checking every row adds 4 dense rows of 8 each: 36.
    assert COSTS.plan(4, 0, check_every=100) == "flashhead"
    assert COSTS.plan(4, 0, check_every=1) == "masked"
    assert COSTS.masked_from(sampled=False, check_every=1) == 2  # at one row 1 + 8 ties with 9: the kernels keep it


def test_between_and_beyond_the_measured_batches():
    assert COSTS.dense_s_at(12) == pytest.approx(12.0)  # interpolated between 8 and 16
    assert COSTS.flashhead_s(3, 0) == pytest.approx(3.0)
    assert COSTS.dense_s_at(0) == COSTS.flashhead_s(0, 0) == 0.0
    # Beyond 16 rows each side grows at the rate it grew from 8 to 16 rows (1 per row on both sides).
    assert COSTS.dense_s_at(64) == pytest.approx(64.0)
    assert COSTS.flashhead_s(64, 0) == pytest.approx(64.0)
    assert COSTS.plan(0, 1000) == "masked"
    sublinear = StepCosts((1, 8, 16), (20.0, 30.0, 38.0), (4.0, 18.0, 30.0), None)
    assert sublinear.dense_s_at(32) == pytest.approx(54.0)  # not 76: a GEMM is cheaper per row as rows grow
    assert sublinear.flashhead_s(32, 0) == pytest.approx(54.0)
    flat = StepCosts((1, 2), (4.0, 3.0), (1.0, 2.0), None)
    assert flat.dense_s_at(100) == pytest.approx(3.0)  # a time that fell is held, not extrapolated down
    single = StepCosts((4,), (8.0,), (2.0,), None)
    assert single.dense_s_at(8) == pytest.approx(16.0)  # one point: in proportion to the rows


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batches": (1, 2), "dense_s": (1.0,), "greedy_s": (1.0, 2.0), "sampled_s": None},
        {"batches": (2, 1), "dense_s": (1.0, 1.0), "greedy_s": (1.0, 2.0), "sampled_s": None},
        {"batches": (), "dense_s": (), "greedy_s": (), "sampled_s": None},
        {"batches": (0, 1), "dense_s": (1.0, 1.0), "greedy_s": (1.0, 1.0), "sampled_s": None},
    ],
)
def test_inconsistent_tables_are_refused(kwargs):
    with pytest.raises(ValueError):
        StepCosts(**kwargs)


class FakeClock:
    """A clock that each timed call advances by the cost it declares: the measurement sees known times."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_measurement_times_each_side_at_each_batch_with_the_rows_it_is_given():
    clock = FakeClock()
    seen: list[tuple[str, int, bool | None]] = []

    def dense(hidden: torch.Tensor) -> None:
        seen.append(("dense", hidden.shape[0], None))
        clock.now += 10.0

    def flashhead(hidden: torch.Tensor, sampled: np.ndarray) -> None:
        assert sampled.shape == (hidden.shape[0],) and sampled.dtype == bool
        kind = "sampled" if sampled.all() else "greedy" if not sampled.any() else "mixed"
        if kind == "mixed":
            assert sampled.tolist() == [False, True] * (hidden.shape[0] // 2)  # every other row
        seen.append(("flash", hidden.shape[0], kind))
        clock.now += hidden.shape[0] * {"greedy": 1.0, "sampled": 3.0, "mixed": 2.5}[kind]

    costs = measure_step_costs(
        flashhead, dense, 16, dtype=torch.float32, sampled_rows=True, batches=(1, 4, 16), budget_s=1e9, clock=clock
    )
    assert costs.batches == (1, 4, 16)
    assert costs.dense_s == (10.0, 10.0, 10.0)
    assert costs.greedy_s == (1.0, 4.0, 16.0)
    assert costs.sampled_s == (3.0, 12.0, 48.0)
    assert costs.mixed_s is not None and np.isnan(costs.mixed_s[0]) and costs.mixed_s[1:] == (10.0, 40.0)
    assert costs.masked_greedy_s is None and costs.masked_from(sampled=False) is None
    # Two passes; in each, one untimed call then two timed ones per side and batch, the sides taking turns (no
    # mixed step of one row).
    assert len(seen) == 2 * 3 * (3 + 4 + 4)
    assert [kind for _, rows, kind in seen if rows == 4][4:8] == [None, "greedy", "sampled", "mixed"]
    assert {rows for _, rows, _ in seen} == {1, 4, 16}
    assert {rows for _, rows, kind in seen if kind == "mixed"} == {4, 16}


def test_measurement_stops_at_its_budget_and_without_sampled_rows_times_greedy_only():
    clock = FakeClock()

    def step(hidden: torch.Tensor, sampled: np.ndarray | None = None) -> None:
        assert sampled is None or not sampled.any()
        clock.now += 1.0

    costs = measure_step_costs(
        step, step, 8, dtype=torch.bfloat16, sampled_rows=False, batches=(1, 2, 4, 8), budget_s=10.0, clock=clock
    )
    # Each batch costs 6 clock units (2 sides x 3 calls): batches 1 and 2 start within 10, the third past it;
    # the second pass times batches 1 and 2 again.
    assert costs.batches == (1, 2)
    assert costs.sampled_s is None


def test_measurement_on_a_real_head_times_the_calls_serving_makes():
    from tests.support.heads import random_head

    head, _ = random_head(2048, 32, n_probes=4)
    calls: list[tuple[int, bool]] = []

    def flashhead(hidden: torch.Tensor, sampled: np.ndarray) -> torch.Tensor:
        calls.append((hidden.shape[0], bool(sampled.any())))
        return head.step_logits(hidden, sampled=sampled)

    costs = measure_step_costs(
        flashhead,
        lambda hidden: torch.nn.functional.linear(hidden, head.weight),
        32,
        dtype=head.weight.dtype,
        sampled_rows=True,
        batches=(1, 8),
    )
    assert costs.batches == (1, 8)
    assert all(t > 0 for t in (*costs.dense_s, *costs.greedy_s, *costs.sampled_s))
    assert (8, True) in calls and (8, False) in calls


def test_measurement_times_the_masked_way_of_each_kind_when_given_it():
    clock = FakeClock()
    seen: list[tuple[int, bool]] = []

    def masked(hidden: torch.Tensor, sampled: np.ndarray) -> None:
        seen.append((hidden.shape[0], bool(sampled.all())))
        clock.now += 10.0 + (2.0 if sampled.all() else 1.0)

    def step(hidden: torch.Tensor, sampled: np.ndarray | None = None) -> None:
        clock.now += 1.0

    costs = measure_step_costs(
        step,
        step,
        8,
        dtype=torch.float32,
        sampled_rows=True,
        masked_step=masked,
        batches=(1, 4),
        budget_s=1e9,
        clock=clock,
    )
    assert costs.masked_greedy_s == (11.0, 11.0) and costs.masked_sampled_s == (12.0, 12.0)
    assert {rows for rows, _ in seen} == {1, 4} and {kind for _, kind in seen} == {False, True}


@pytest.mark.parametrize(
    ("greedy_ms", "sampled_ms", "slow"),
    [
        (0.05, 0.09, None),  # both kinds under the dense head's 0.10 ms at one row
        (0.10, 0.05, ["a greedy step 0.100 ms"]),  # a tie does not pay
        (0.05, 0.30, ["a sampled step 0.300 ms"]),
        (0.20, 0.30, ["a greedy step 0.200 ms", "a sampled step 0.300 ms"]),
        (0.20, None, ["a greedy step 0.200 ms"]),  # sampled rows served as greedy ones: not timed
    ],
)
def test_flashhead_is_slower_than_dense_when_either_kind_of_one_row_takes_the_dense_heads_time(
    greedy_ms, sampled_ms, slow
):
    # Larger batches never save FlashHead: one row is its best case, so they do not enter the verdict.
    costs = StepCosts(
        batches=(1, 64),
        dense_s=(1e-4, 1e-4),
        greedy_s=(greedy_ms * 1e-3, 1.0),
        sampled_s=None if sampled_ms is None else (sampled_ms * 1e-3, 1.0),
    )
    reason = costs.slower_than_dense()
    if slow is None:
        assert reason is None
    else:
        assert reason is not None and "against the dense head's 0.100 ms" in reason
        assert all(part in reason for part in slow) and reason.count(" step ") == len(slow)


def test_measurement_reads_the_clock_once_the_device_is_idle(monkeypatch):
    """On an accelerator a call returns once its kernels are queued: the default clock waits for the device, so that
    the time counts their run."""
    from my_pkg.flashhead import step_costs

    waits: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    clock = step_costs.device_clock(torch.device("cuda", 1))
    clock()
    assert waits == [torch.device("cuda", 1)]
    assert step_costs.device_clock(torch.device("cpu")) is step_costs.time.perf_counter
    rows: list[torch.device] = []
    measure_step_costs(
        lambda hidden, sampled: rows.append(hidden.device),
        lambda hidden: rows.append(hidden.device),
        8,
        dtype=torch.float32,
        sampled_rows=False,
        batches=(1,),
        device="meta",  # the hidden states are made on the head's device
    )
    assert rows and {row.type for row in rows} == {"meta"}
