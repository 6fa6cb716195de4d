"""`StepWays`: each step's way from the start-up timing, corrected by served steps, with hysteresis and exploration."""

from __future__ import annotations

from my_pkg.engine.flashhead.timing import StepWays
from my_pkg.flashhead.step_costs import StepCosts

#: FlashHead's kernels 1 at one row and 10 at 8 rows; the masked way 5 at every batch.
PRIOR = StepCosts((1, 8), (4.0, 4.0), (1.0, 10.0), None, masked_greedy_s=(5.0, 5.0))


def test_without_a_masked_timing_the_kernels_serve_every_step():
    for prior in (None, StepCosts((1, 8), (4.0, 4.0), (1.0, 10.0), None)):
        ways = StepWays(prior)
        assert not ways.timed
        assert {ways.choose(rows, 0) for rows in (1, 8, 100)} == {"flashhead"}
        ways.observe(8, 0, 0, "flashhead", 1.0)
        assert ways.report() == []


def test_the_first_step_of_a_bucket_follows_the_start_up_timing():
    ways = StepWays(PRIOR, explore_every=1000)
    assert ways.choose(1, 0) == "flashhead"
    assert ways.choose(8, 0) == "masked"
    assert ways.choose(0, 0, 5) == "flashhead"  # no FlashHead row: nothing to choose


def test_served_times_correct_the_timing_only_past_the_switch_margin():
    ways = StepWays(PRIOR, explore_every=1000)
    assert ways.choose(8, 0) == "masked"
    ways.observe(8, 0, 0, "masked", 5.0)
    ways.observe(8, 0, 0, "flashhead", 4.8)  # cheaper, but within 10 %: the way stays
    assert ways.choose(8, 0) == "masked"  # the second step: it already has both ways' times
    assert ways.choose(8, 0) == "masked"
    for _ in range(10):
        ways.observe(8, 0, 0, "flashhead", 3.0)  # the running mean falls well below 5 / 1.1
    assert ways.choose(8, 0) == "flashhead"
    assert ways.choose(7, 0) == "flashhead"  # the same bucket (5-8 rows)
    assert ways.choose(3, 0) == "flashhead" and ways.choose(8, 8) == "masked"  # other buckets and kinds: their own


def test_the_second_step_then_one_step_in_explore_every_takes_the_other_way():
    ways = StepWays(PRIOR, explore_every=4)
    taken = [ways.choose(8, 0) for _ in range(8)]
    assert taken == ["masked", "flashhead", "masked", "flashhead", "masked", "masked", "masked", "flashhead"]


def test_a_timing_that_extrapolated_wrong_is_corrected_by_the_second_step():
    """Past the timed batches the prior can be far off: one served step each way decides."""
    ways = StepWays(PRIOR, explore_every=1000)
    assert ways.choose(64, 0) == "masked"  # the prior says the kernels cost 10 at 8 rows and more beyond
    ways.observe(64, 0, 0, "masked", 9.0)
    assert ways.choose(64, 0) == "flashhead"  # the second step: the other way, once
    ways.observe(64, 0, 0, "flashhead", 3.0)
    assert ways.choose(64, 0) == "flashhead"


def test_an_update_forgets_the_kernels_times_and_serves_them_until_timed_again():
    ways = StepWays(PRIOR, explore_every=1000)
    assert ways.choose(8, 0) == "masked"
    ways.observe(8, 0, 0, "masked", 5.0)
    ways.forget_kernels()
    assert ways.choose(8, 0) == "flashhead" and ways.choose(1, 4) == "flashhead"
    ways.observe(8, 0, 0, "flashhead", 20.0)  # the new probe count is dear: back to the masked way
    assert ways.choose(8, 0) == "masked"
    (row,) = [served for served in ways.report() if served.rows == "5-8" and served.kind == "greedy"]
    assert (row.way, row.flashhead_ms, row.masked_ms) == ("masked", 20000.0, 5000.0)


def test_bad_times_are_ignored():
    ways = StepWays(PRIOR)
    ways.choose(8, 0)
    for seconds in (float("nan"), float("inf"), -1.0):
        ways.observe(8, 0, 0, "flashhead", seconds)
    assert all(served.flashhead_ms is None for served in ways.report())
