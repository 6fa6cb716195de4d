"""FlashHead over vLLM's vocab-parallel head: tensor parallel 2 on CPU (two worker processes), with a fixed
threshold (`never`) and with the start-up timing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_support import DEFAULT_PROBES, NUM_CLUSTERS, auth, client

from my_pkg.flashhead.step_costs import StepCosts, slowest_costs

pytestmark = pytest.mark.e2e

TOKEN = "tp2-token"
FLASHHEAD = "/plugins/my_pkg/flashhead"
PROMPTS = ["the world and the sun", "hello world", "what is the name of the city", "water food and fire"]


def _statuses(http) -> list[dict]:
    response = http.get(FLASHHEAD, headers=auth(TOKEN))
    assert response.status_code == 200, response.text
    return response.json()["workers"]


def _put(http, body: dict) -> None:
    response = http.put(FLASHHEAD, json=body, headers=auth(TOKEN))
    assert response.status_code == 200, response.text


def _greedy_tokens(http, model: str) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched: several rows per step
        return list(pool.map(one, PROMPTS))


def test_flashhead_is_active_on_both_ranks_right_after_start_up(tp2_server):
    with client(tp2_server) as http:
        statuses = _statuses(http)
        assert [s["rank"] for s in statuses] == [0, 1]
        for status in statuses:
            assert status["active"] is True, status
            assert status["reason_code"] is None
            assert status["n_probes"] == DEFAULT_PROBES
            assert status["backend"] == "torch"
            assert status["extra_memory_bytes"] > 0  # built with its tables right after the weights loaded


def test_full_probes_at_tp2_give_the_dense_tp2_tokens_and_count_rows_on_both_ranks(tp2_server):
    model = str(tp2_server.model)
    with client(tp2_server) as http:
        try:
            _put(http, {"enabled": False})
            dense = _greedy_tokens(http, model)
            before = [s["counters"]["rows_flashhead"] for s in _statuses(http)]
            _put(http, {"enabled": True, "n_probes": NUM_CLUSTERS})
            flash = _greedy_tokens(http, model)
            after = _statuses(http)
        finally:
            _put(http, {"enabled": True, "n_probes": DEFAULT_PROBES})
    assert flash == dense
    for rank, status in enumerate(after):
        assert status["active"] is True, status
        assert status["counters"]["rows_flashhead"] >= before[rank] + 16 * len(PROMPTS) - len(PROMPTS), status
        assert status["counters"]["fallbacks"] == 0, status


def test_few_probes_at_tp2_still_serve_sampled_and_greedy_requests(tp2_server):
    model = str(tp2_server.model)
    with client(tp2_server) as http:
        try:
            _put(http, {"n_probes": 1})
            for params in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}):
                body = {"model": model, "prompt": "hello world", "max_tokens": 12, **params}
                first = http.post("/v1/completions", json=body)
                second = http.post("/v1/completions", json=body)
                assert first.status_code == 200 and second.status_code == 200, first.text
                assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
            assert all(s["counters"]["fallbacks"] == 0 for s in _statuses(http))
        finally:
            _put(http, {"n_probes": DEFAULT_PROBES})


def _costs(report: dict) -> StepCosts:
    def seconds(side: str) -> tuple[float, ...] | None:
        times = report[side]
        return tuple(float("nan") if ms is None else ms / 1e3 for ms in times) if times is not None else None

    return StepCosts(
        tuple(report["batches"]), *(seconds(side) for side in ("dense_ms", "greedy_ms", "sampled_ms", "mixed_ms"))
    )


def test_timed_ranks_plan_alike_and_exchange_alike(tp2_measured_server):
    """Each rank times its own part at start-up; the first decode step's exchange gives both ranks the slowest of
    their times, from which they plan every step alike and skip the exchange where every step goes dense (counted
    the same on both); the tokens stay the dense ones at full probes."""
    model = str(tp2_measured_server.model)
    with client(tp2_measured_server) as http:
        for status in _statuses(http):
            report = status["step_costs"]
            assert status["active"] is True and report is not None, status
            assert report["batches"][0] == 1 and report["dense_from_agreed"] is None  # no step yet
        try:
            _put(http, {"enabled": False})
            dense = _greedy_tokens(http, model)
            _put(http, {"enabled": True, "n_probes": NUM_CLUSTERS})  # re-times the greedy rows on both ranks
            timed = _statuses(http)
            flash = _greedy_tokens(http, model)
            after = _statuses(http)
        finally:
            _put(http, {"enabled": True, "n_probes": DEFAULT_PROBES})
    assert flash == dense
    agreed = slowest_costs([_costs(status["step_costs"]) for status in timed])
    expected = agreed.dense_from_every_kind() if agreed is not None else None  # no fidelity check under TP
    assert [status["step_costs"]["dense_from_agreed"] for status in after] == [expected, expected]
    exchanges = [status["counters"]["stage1_exchanges"] for status in after]
    assert exchanges[0] == exchanges[1] >= 1, after
    if expected == 1:  # every step dense on both ranks: only the first step after the update exchanged
        assert exchanges[0] == 1, after
        assert after[0]["counters"]["rows_dense"] == after[1]["counters"]["rows_dense"]
    for status in after:
        assert status["counters"]["fallbacks"] == 0, status
