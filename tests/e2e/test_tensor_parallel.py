"""FlashHead over vLLM's vocab-parallel head: tensor parallel 2 on CPU (two worker processes), with the default
settings (each rank times its own part at start-up and serves each step the way it finds cheaper)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_support import DEFAULT_PROBES, NUM_CLUSTERS, auth, client

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


def test_each_rank_times_itself_and_both_exchange_on_every_step_alike(tp2_server):
    """Each rank times its own part at start-up and takes its own way per step (the ways differ in cost only): the
    ranks need no agreement on timings, exchange their best clusters on every armed step (counted the same on both),
    and the tokens at full probes stay the dense ones."""
    model = str(tp2_server.model)
    with client(tp2_server) as http:
        for status in _statuses(http):
            report = status["step_costs"]
            assert status["active"] is True and report is not None, status
            assert report["batches"][0] == 1 and report["masked_greedy_ms"] is not None
        try:
            _put(http, {"enabled": False})
            dense = _greedy_tokens(http, model)
            _put(http, {"enabled": True, "n_probes": NUM_CLUSTERS})
            before = [status["counters"]["stage1_exchanges"] for status in _statuses(http)]
            flash = _greedy_tokens(http, model)
            after = _statuses(http)
        finally:
            _put(http, {"enabled": True, "n_probes": DEFAULT_PROBES})
    assert flash == dense
    exchanges = [status["counters"]["stage1_exchanges"] - seen for status, seen in zip(after, before)]
    assert exchanges[0] == exchanges[1] >= 15, after  # every decode step of the 16-token answers
    for status in after:
        assert status["counters"]["fallbacks"] == 0, status
        assert "slower_than_dense" not in status["counters"]["rows_dense"], status
