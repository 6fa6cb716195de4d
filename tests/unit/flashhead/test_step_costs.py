"""`StepCosts`: predicting a step's cost from measured points, and `measure_step_costs` timing what it is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from my_pkg.flashhead.step_costs import (
    MEASURED_BATCHES,
    PACKED_COSTS,
    StepCosts,
    measure_step_costs,
    pack_costs,
    retime_greedy,
    slowest_costs,
    unpack_costs,
)

# A dense head flat to 8 rows then linear; FlashHead greedy 4x cheaper per row at one row, sampled rows dearer.
COSTS = StepCosts(
    batches=(1, 2, 4, 8, 16),
    dense_s=(8.0, 8.0, 8.0, 8.0, 16.0),
    greedy_s=(1.0, 2.0, 4.0, 8.0, 16.0),
    sampled_s=(2.0, 4.0, 8.0, 16.0, 32.0),
    margin=1.0,  # the arithmetic below without the default 10 %
)


def test_greedy_and_sampled_steps_go_dense_where_they_stop_paying():
    assert COSTS.plan(1, 0) == COSTS.plan(4, 0) == "flashhead"
    assert COSTS.plan(8, 0) == "dense"  # a tie goes dense: its logits are exact
    assert COSTS.plan(0, 2) == "flashhead"
    assert COSTS.plan(0, 4) == "dense"
    assert COSTS.dense_from(sampled=False) == 8
    assert COSTS.dense_from(sampled=True) == 4


def test_every_kind_of_step_goes_dense_from_the_batch_where_the_dearest_kind_to_go_dense_does():
    # Sampled rows go dense from 4 rows, greedy ones from 8; a mixed step of 4 rows (2 + 2: 2 + 4 = 6 < 8) still
    # pays: from 8 rows every kind is dense.
    assert COSTS.plan(2, 2) == "flashhead"
    assert COSTS.dense_from_every_kind() == 8
    assert COSTS.dense_from_every_kind(check_every=1) == 1  # a dense row per FlashHead row: dense from one row
    greedy_only = StepCosts(COSTS.batches, COSTS.dense_s, COSTS.greedy_s, None, margin=1.0)
    assert greedy_only.dense_from_every_kind() == 8
    # A kind that pays again at a larger batch: dense only from the batch after it; paying at the last: none.
    again = StepCosts((1, 4, 8, 16), (8.0, 8.0, 20.0, 20.0), (4.0, 9.0, 9.0, 30.0), None, margin=1.0)
    assert again.plan(4, 0) == "dense" and again.plan(8, 0) == "flashhead"
    assert again.dense_from_every_kind() == 16
    assert StepCosts((1, 8), (8.0, 8.0), (1.0, 2.0), None, margin=1.0).dense_from_every_kind() is None
    # A mixed step that pays where each kind alone goes dense keeps the batch on FlashHead.
    nan = float("nan")
    shared = StepCosts((1, 8), (8.0, 8.0), (1.0, 9.0), (1.0, 9.0), (nan, 4.0), margin=1.0)
    assert shared.plan(8, 0) == shared.plan(0, 8) == "dense" and shared.plan(4, 4) == "flashhead"
    assert shared.dense_from_every_kind() is None


def test_a_mixed_step_costs_a_step_of_each_kind_and_counts_its_dense_rows():
    # 3 greedy + 1 sampled: greedy(3) + sampled(1) = 3 + 2 = 5 < dense(4) = 8: as asked.
    assert COSTS.flashhead_s(3, 1) == pytest.approx(5.0)
    assert COSTS.plan(3, 1) == "flashhead"
    # Each kind's fixed cost is paid once per kind: with times that grow slowly, 4 greedy + 4 sampled cost
    # greedy(4) + sampled(4) = 20 / 7 + 30 / 7 = 7.14, above a flat dense 7: dense.  The rows-weighted mean at
    # 8 rows ((4 * 4 + 4 * 6) / 8 = 5) would have served it with FlashHead.
    flat = StepCosts((1, 8), dense_s=(7.0, 7.0), greedy_s=(2.0, 4.0), sampled_s=(3.0, 6.0), margin=1.0)
    assert flat.flashhead_s(4, 4) == pytest.approx(50 / 7)
    assert flat.plan(4, 4) == "dense" and flat.plan(8, 0) == flat.plan(0, 8) == "flashhead"
    # Without sampled times the sampled rows are greedy ones: one greedy step of all the rows.
    greedy_only = StepCosts(COSTS.batches, COSTS.dense_s, COSTS.greedy_s, None, margin=1.0)
    assert greedy_only.flashhead_s(4, 4) == pytest.approx(8.0)
    # The same with 4 rows that need the dense head: 5 + dense(4) = 13 against dense(8) = 8.
    assert COSTS.plan(3, 1, 4) == "dense"
    assert COSTS.plan(0, 0, 5) == "flashhead"  # no FlashHead row: nothing to decide
    # 8 greedy + 8 sampled at 16 rows: as asked 24, all dense 16, sampled rows dense 8 + 8 = 16: tie, dense.
    assert COSTS.plan(8, 8) == "dense"


def test_a_timed_mixed_step_corrects_the_sum_of_its_kinds():
    nan = float("nan")
    base = dict(batches=(1, 8, 16), dense_s=(7.0, 7.0, 9.0), greedy_s=(2.0, 4.0, 6.0), sampled_s=(3.0, 6.0, 9.0))
    # The kinds shared one pass: 4 + 4 rows timed at 5.5, where greedy(4) + sampled(4) = 50 / 7.
    shared = StepCosts(**base, mixed_s=(nan, 5.5, 8.0), margin=1.0)
    assert shared.mixed_saving_s(8) == pytest.approx(50 / 7 - 5.5)
    assert shared.flashhead_s(4, 4) == pytest.approx(5.5)  # the timed step itself
    assert shared.plan(4, 4) == "flashhead"
    # 7 + 1 rows: greedy(7) + sampled(1) less the same saving, and never below either kind alone.
    assert shared.flashhead_s(7, 1) == pytest.approx(max(2 + 12 / 7, 2 + 12 / 7 + 3 - (50 / 7 - 5.5)))
    # Between the timed batches the saving is interpolated, beyond the last it is held.
    at_16 = 4 + 6 - 8.0
    assert shared.mixed_saving_s(12) == pytest.approx(((50 / 7 - 5.5) + at_16) / 2)
    assert shared.mixed_saving_s(64) == pytest.approx(at_16)
    # Mixed steps that cost more than the two kinds alone (a path without the shared pass): dense.
    dearer = StepCosts(**base, mixed_s=(nan, 9.0, 14.0), margin=1.0)
    assert dearer.flashhead_s(4, 4) == pytest.approx(9.0)
    assert dearer.plan(4, 4) == "dense"
    # Timed at one row only (nothing to mix): the sum.
    one = StepCosts((1,), (7.0,), (2.0,), (3.0,), (nan,), margin=1.0)
    assert one.mixed_saving_s(2) == 0.0 and one.flashhead_s(1, 1) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        StepCosts((1, 2), (1.0, 1.0), (1.0, 1.0), None, (nan, 1.0))  # mixed steps without sampled rows


def test_sampled_rows_alone_go_dense_where_greedy_rows_still_pay():
    costs = StepCosts((1, 8), dense_s=(4.0, 8.0), greedy_s=(1.0, 4.0), sampled_s=(3.0, 20.0), margin=1.0)
    # 6 greedy + 2 sampled: as asked greedy(6) + sampled(2) = 22 / 7 + 38 / 7 = 8.57, all dense 8, the sampled
    # rows dense: greedy(6) = 1 + 5 * 3 / 7 and dense(2) = 4 + 4 / 7, 7.71 together.
    assert costs.flashhead_s(6, 0) + costs.dense_s_at(2) == pytest.approx(54 / 7)
    assert costs.plan(6, 2) == "sampled_dense"
    # 4 greedy + 4 sampled: as asked 88 / 7, all dense 8, sampled rows dense 16 / 7 + 40 / 7 = 8: the tie goes dense.
    assert costs.plan(4, 4) == "dense"
    assert costs.plan(8, 0) == "flashhead" and costs.plan(0, 8) == "dense"


def test_flashhead_must_be_predicted_ten_percent_faster_by_default():
    near = StepCosts((1, 8), dense_s=(10.0, 10.0), greedy_s=(9.5, 9.5), sampled_s=(9.0, 9.0))
    assert near.margin == pytest.approx(1.1)
    assert near.plan(1, 0) == "dense"  # 9.5 * 1.1 > 10
    assert near.plan(0, 1) == "flashhead"  # 9.0 * 1.1 < 10
    assert StepCosts((1, 8), (10.0, 10.0), (9.5, 9.5), None, margin=1.0).plan(1, 0) == "flashhead"


def test_a_step_split_between_the_heads_counts_the_margin_on_its_dense_rows_too():
    # 4 greedy rows on FlashHead (2) and 4 rows on the dense head (7.5) against all 8 rows dense (10): 9.5 wins
    # without a margin; with it, 1.1 * 9.5 = 10.45 does not (the margin on FlashHead's part alone: 9.7 would).
    costs = StepCosts((1, 4, 8), (5.0, 7.5, 10.0), (1.0, 2.0, 20.0), (20.0, 20.0, 20.0))
    exact = StepCosts(costs.batches, costs.dense_s, costs.greedy_s, costs.sampled_s, margin=1.0)
    assert exact.plan(4, 4) == "sampled_dense" and costs.plan(4, 4) == "dense"
    assert exact.plan(4, 0, 4) == "flashhead" and costs.plan(4, 0, 4) == "dense"  # 4 rows that need the dense head


def test_the_live_fidelity_check_counts_a_dense_row_for_every_checked_row():
    # 4 greedy rows: 4 against dense 8; checking every row adds 4 dense rows of 8 each: dense wins.
    assert COSTS.plan(4, 0, check_every=100) == "flashhead"
    assert COSTS.plan(4, 0, check_every=1) == "dense"
    assert COSTS.dense_from(sampled=False, check_every=1) == 1
    assert COSTS.dense_from(sampled=False, check_every=0) == 8  # 0: no check


def test_between_and_beyond_the_measured_batches():
    assert COSTS.dense_s_at(12) == pytest.approx(12.0)  # interpolated between 8 and 16
    assert COSTS.flashhead_s(3, 0) == pytest.approx(3.0)
    assert COSTS.dense_s_at(0) == COSTS.flashhead_s(0, 0) == 0.0
    # Beyond 16 rows each side grows at the rate it grew from 8 to 16 rows (1 per row on both sides).
    assert COSTS.dense_s_at(64) == pytest.approx(64.0)
    assert COSTS.flashhead_s(64, 0) == pytest.approx(64.0)
    assert COSTS.plan(64, 0) == "dense" and COSTS.plan(0, 1000) == "dense"
    sublinear = StepCosts((1, 8, 16), (20.0, 30.0, 38.0), (4.0, 18.0, 30.0), None)
    assert sublinear.dense_s_at(32) == pytest.approx(54.0)  # not 76: a GEMM is cheaper per row as rows grow
    assert sublinear.flashhead_s(32, 0) == pytest.approx(54.0)
    faster = StepCosts((1, 2), (4.0, 6.0), (1.0, 2.0), None)
    assert faster.plan(1000, 0) == faster.plan(0, 1000) == "flashhead"  # no sampled times: greedy's
    assert faster.dense_from(sampled=False) is None
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
    assert costs.dense_from(sampled=False) == 16 and costs.dense_from(sampled=True) == 4
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


def test_retiming_greedy_rows_keeps_the_other_sides_and_their_batches():
    clock = FakeClock()
    seen: list[tuple[int, bool]] = []

    def flashhead(hidden: torch.Tensor, sampled: np.ndarray) -> None:
        seen.append((hidden.shape[0], bool(sampled.any())))
        clock.now += 5.0 * hidden.shape[0]

    again = retime_greedy(COSTS, flashhead, 16, dtype=torch.float32, clock=clock)
    assert again.greedy_s == tuple(5.0 * rows for rows in COSTS.batches)
    assert (again.batches, again.dense_s, again.sampled_s, again.margin) == (
        COSTS.batches,
        COSTS.dense_s,
        COSTS.sampled_s,
        COSTS.margin,
    )
    assert {rows for rows, _ in seen} == set(COSTS.batches) and not any(sampled for _, sampled in seen)


def test_retiming_greedy_rows_times_the_mixed_steps_again_too():
    clock = FakeClock()
    seen: list[tuple[int, int]] = []

    def flashhead(hidden: torch.Tensor, sampled: np.ndarray) -> None:
        seen.append((hidden.shape[0], int(sampled.sum())))
        clock.now += 5.0 * hidden.shape[0] + sampled.sum()

    timed = StepCosts((1, 4), (8.0, 8.0), (1.0, 4.0), (2.0, 8.0), (float("nan"), 7.0))
    again = retime_greedy(timed, flashhead, 16, dtype=torch.float32, clock=clock)
    assert again.greedy_s == (5.0, 20.0) and again.sampled_s == timed.sampled_s
    assert np.isnan(again.mixed_s[0]) and again.mixed_s[1] == 22.0
    assert {count for _, count in seen} == {0, 2}  # greedy steps and mixed ones (2 of 4 rows sampled)


def _same(a: StepCosts | None, b: StepCosts | None) -> bool:
    """Equal timings, NaN equal to NaN."""
    if a is None or b is None:
        return a is b
    return all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y, equal_nan=True))
        for x, y in (
            (a.batches, b.batches),
            (a.dense_s, b.dense_s),
            (a.greedy_s, b.greedy_s),
            (a.sampled_s, b.sampled_s),
            (a.mixed_s, b.mixed_s),
        )
    )


def test_a_timing_packs_into_a_fixed_size_and_back():
    nan = float("nan")
    timed = StepCosts((1, 2, 4), (1.0, 1.5, 2.0), (0.25, 0.5, 1.0), (0.3, 0.6, 1.2), (nan, 0.55, 1.1))
    packed = pack_costs(timed)
    assert packed.dtype == torch.float64 and packed.shape == (PACKED_COSTS,)
    assert _same(unpack_costs(packed), timed)
    greedy_only = StepCosts((1, 2), (1.0, 1.0), (0.5, 0.7), None)
    assert _same(unpack_costs(pack_costs(greedy_only)), greedy_only)
    assert unpack_costs(pack_costs(None)) is None
    every = tuple(MEASURED_BATCHES)
    full = StepCosts(every, (1.0,) * len(every), (2.0,) * len(every), None)
    assert _same(unpack_costs(pack_costs(full)), full)
    too_many = StepCosts((*every, 512), (1.0,) * (len(every) + 1), (2.0,) * (len(every) + 1), None)
    assert unpack_costs(pack_costs(too_many)) is None  # not packable: as if not timed
    assert _same(unpack_costs(pack_costs(timed).view(torch.int64).view(torch.float64)), timed)  # as exchanged


def test_the_slowest_rank_s_time_at_each_batch_every_rank_timed():
    nan = float("nan")
    fast = StepCosts((1, 2, 4), (1.0, 1.0, 3.0), (0.5, 0.6, 4.0), (0.7, 0.9, 5.0), (nan, 0.8, 4.5))
    slow = StepCosts((1, 2), (1.2, 0.9), (0.4, 0.9), (0.6, 1.0), (nan, 1.1))
    merged = slowest_costs([fast, slow])
    assert _same(merged, StepCosts((1, 2), (1.2, 1.0), (0.5, 0.9), (0.7, 1.0), (nan, 1.1)))
    assert slowest_costs([fast, None]) is None and slowest_costs([]) is None
    assert slowest_costs([fast, StepCosts((8,), (1.0,), (1.0,), None)]) is None  # no batch in common
    without_sampled = slowest_costs([fast, StepCosts((1,), (1.0,), (0.5,), None)])
    assert without_sampled.sampled_s is None and without_sampled.mixed_s is None
    # A rank whose FlashHead pays at 2 greedy rows and one whose dense head is slow there: the slowest of each side
    # (FlashHead 0.9, dense 1.3) still pays; with the first rank's dense time (1.0) it would not.
    other = StepCosts((1, 2), (1.0, 1.3), (0.5, 0.5), None, margin=1.0)
    first = StepCosts((1, 2), (1.0, 1.0), (0.5, 0.9), None, margin=1.0)
    merged = slowest_costs([first, other])
    assert (merged.dense_s, merged.greedy_s) == ((1.0, 1.3), (0.5, 0.9))
    assert first.plan(2, 0) == "flashhead" and merged.plan(2, 0) == "flashhead"
    assert StepCosts((1, 2), (1.0, 1.0), (0.5, 0.95), None).plan(2, 0) == "dense"  # with the default margin
