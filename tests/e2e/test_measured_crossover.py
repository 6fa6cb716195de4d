"""With no `MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD`, a real server times its head beside vLLM's dense head when
it loads the model, reports the times, and serves each step the way they predict is faster."""

from __future__ import annotations

import pytest
from e2e_support import ADMIN_TOKEN, auth, client

from my_pkg.flashhead.step_costs import StepCosts

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
MAX_TOKENS = 12


def _status(http) -> dict:
    response = http.get(FLASHHEAD, headers=auth(ADMIN_TOKEN))
    assert response.status_code == 200, response.text
    return response.json()["workers"][0]


def _costs(report: dict) -> StepCosts:
    def seconds(side: str) -> tuple[float, ...] | None:
        times = report[side]
        return tuple(float("nan") if ms is None else ms / 1e3 for ms in times) if times is not None else None

    return StepCosts(
        tuple(report["batches"]),
        seconds("dense_ms"),
        seconds("greedy_ms"),
        seconds("sampled_ms"),
        seconds("mixed_ms"),
    )


def test_the_server_reports_its_timing_and_serves_each_step_as_it_predicts(measured_server):
    with client(measured_server) as http:
        status = _status(http)
        assert status["active"] and status["dense_batch_threshold"] is None
        report = status["step_costs"]
        assert report is not None, status
        assert report["batches"][0] == 1 and report["batches"] == sorted(report["batches"])
        assert all(ms > 0 for side in ("dense_ms", "greedy_ms", "sampled_ms") for ms in report[side])
        mixed = report["mixed_ms"]  # every other row sampled: none at one row
        assert len(mixed) == len(report["batches"]) and mixed[0] is None and all(ms > 0 for ms in mixed[1:])
        costs, every = _costs(report), status["fidelity_every"]
        assert report["dense_from_greedy"] == costs.dense_from(sampled=False, check_every=every)
        assert report["dense_from_sampled"] == costs.dense_from(sampled=True, check_every=every)

        for temperature, plan in (
            (0.0, costs.plan(1, 0, check_every=every)),
            (0.8, costs.plan(0, 1, check_every=every)),
        ):
            before = _status(http)["counters"]
            body = {
                "model": measured_server.model,
                "prompt": "the world and the sun",
                "max_tokens": MAX_TOKENS,
                "temperature": temperature,
                "ignore_eos": True,
            }
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            after = _status(http)["counters"]
            slower = after["rows_dense"].get("slower_than_dense", 0) - before["rows_dense"].get("slower_than_dense", 0)
            served = after["rows_flashhead"] - before["rows_flashhead"]
            # One request alone: every decode step has one row, served as the reported times predict.
            if plan == "flashhead":
                assert served >= MAX_TOKENS - 1 and slower == 0, (temperature, report)
            else:
                assert slower >= MAX_TOKENS - 1 and served == 0, (temperature, report)
