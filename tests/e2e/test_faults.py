"""Fault injection against real vLLM servers: nothing the plugin does may take an engine down.

Each case ends by checking that completions still succeed and that the admin
routes answer. Workers are stalled with SIGSTOP (a long prefill, a GC pause, a
loaded host look the same from outside) and killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from e2e_support import ADMIN_TOKEN, LORA_NAME, RPC_TIMEOUT, auth, client

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
WAIT = float(RPC_TIMEOUT)
STALL_S = WAIT + 4.0  # a stall that outlives the admin API's wait
PROMPT = "the world and the sun"


def _complete(http: httpx.Client, model: str, headers: dict, **params) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **params}
    response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def _worker_pids(http: httpx.Client, headers: dict) -> dict[int, int]:
    response = http.get("/plugins/my_pkg/workers", headers=headers)
    assert response.status_code == 200, response.text
    return {w["rank"]: w["pid"] for w in response.json()["workers"]}


@contextmanager
def _stalled(pid: int):
    """The worker process `pid` paused for the duration of the block, resumed after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _eventually(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def _assert_healthy(http: httpx.Client, model: str, headers: dict, admin: dict, num_workers: int = 1) -> None:
    """Every admin read route answers with its own kind of reply, and completions work."""
    health = _eventually(lambda: http.get("/plugins/my_pkg/health", headers=admin).status_code == 200)
    assert health, http.get("/plugins/my_pkg/health", headers=admin).text
    workers = http.get("/plugins/my_pkg/workers", headers=admin)
    assert workers.status_code == 200, workers.text
    assert [w["rank"] for w in workers.json()["workers"]] == list(range(num_workers))
    assert all("hostname" in w for w in workers.json()["workers"])
    status = http.get(FLASHHEAD, headers=admin)
    assert status.status_code == 200, status.text
    assert all("counters" in w for w in status.json()["workers"])
    for _ in range(2):  # a stale reply would surface on the first model step or the next RPC
        assert _complete(http, model, headers)["choices"][0]["text"]


def _timed(call):
    start = time.monotonic()
    response = call()
    return response, time.monotonic() - start


# ----------------------------------------------------------------- stalled worker, TP=1


def test_worker_stalled_during_reads_then_resumed(flashhead_server):
    """The case that used to kill the engine: an RPC outlives the admin API's wait.

    Two reads of different methods time out while the worker is paused; their
    late replies must not be taken for the answers to later calls or model steps.
    """
    with client(flashhead_server) as http:
        pid = _worker_pids(http, auth())[0]
        with _stalled(pid):
            with ThreadPoolExecutor(3) as pool:  # identical reads share one engine-side call
                replies = list(
                    pool.map(lambda _: _timed(lambda: http.get("/plugins/my_pkg/workers", headers=auth())), range(3))
                )
            replies.append(_timed(lambda: http.get(FLASHHEAD, headers=auth())))
            time.sleep(2.0)
        for response, elapsed in replies:
            assert response.status_code == 504, response.text
            assert response.json()["error"]["type"] == "timeout_error"
            assert WAIT - 0.5 <= elapsed <= WAIT + 3.0
        _assert_healthy(http, flashhead_server.model, auth(), auth())


def test_worker_stalled_during_an_update_applies_it_after_resuming(flashhead_server):
    admin = auth(ADMIN_TOKEN)
    with client(flashhead_server) as http:
        before = http.get(FLASHHEAD, headers=auth()).json()["workers"][0]
        target = before["n_probes"] + 3
        pid = _worker_pids(http, auth())[0]
        try:
            with _stalled(pid):
                response, elapsed = _timed(lambda: http.put(FLASHHEAD, json={"n_probes": target}, headers=admin))
                assert response.status_code == 504, response.text
                assert "not known" in response.json()["error"]["note"]  # it completes by itself once the worker answers
                busy = http.put(FLASHHEAD, json={"n_probes": target + 1}, headers=admin)
                assert busy.status_code == 409 and busy.json()["error"]["type"] == "update_in_progress"
                time.sleep(STALL_S - elapsed)
            applied = _eventually(
                lambda: http.get(FLASHHEAD, headers=auth()).json()["workers"][0]["n_probes"] == target
            )
            assert applied, "the update that timed out was not applied after the worker resumed"
            _assert_healthy(http, flashhead_server.model, auth(), auth())
        finally:
            restore = _eventually(
                lambda: http.put(FLASHHEAD, json={"n_probes": before["n_probes"]}, headers=admin).status_code == 200
            )
            assert restore


# ----------------------------------------------------------------- stalled worker, TP=2


def test_one_rank_stalled_at_tp2_then_resumed_ranks_agree(tp2_server):
    admin = auth("tp2-token")
    with client(tp2_server) as http:
        pids = _worker_pids(http, admin)
        assert len(pids) == 2
        with _stalled(pids[1]):
            read, _ = _timed(lambda: http.get(FLASHHEAD, headers=admin))
            update, elapsed = _timed(lambda: http.put(FLASHHEAD, json={"enabled": False}, headers=admin))
            time.sleep(max(0.0, STALL_S - 2 * WAIT))
        assert read.status_code == 504, read.text
        assert update.status_code == 504, update.text
        _assert_healthy(http, tp2_server.model, admin, admin, num_workers=2)
        # The pending update ends (applied by both ranks) before another is accepted.
        settled = _eventually(
            lambda: (
                http.put(FLASHHEAD, json={"enabled": True}, headers=admin).json().get("error", {}).get("type")
                != "update_in_progress"
            )
        )
        assert settled
        statuses = http.get(FLASHHEAD, headers=admin).json()["workers"]
        settings = [{k: s[k] for k in ("available", "enabled", "n_probes", "dense_batch_threshold")} for s in statuses]
        assert settings[0] == settings[1] and settings[0]["enabled"] is True, settings


# ----------------------------------------------------------------- LoRA


@pytest.mark.parametrize("server_name", ["lora_plain_server", "lora_flashhead_server"])
def test_lora_serves_base_and_adapter_requests(server_name, request):
    server = request.getfixturevalue(server_name)
    admin = auth(ADMIN_TOKEN)
    with client(server) as http:
        base = _complete(http, server.model, {}, max_tokens=16, return_token_ids=True)
        adapted = _complete(http, LORA_NAME, {}, max_tokens=16, return_token_ids=True)
        assert base["choices"][0]["token_ids"] != adapted["choices"][0]["token_ids"]  # the adapter is applied
        status = http.get(FLASHHEAD, headers=admin).json()["workers"][0]
        assert status["active"] is False
        expected = "lora" if server_name == "lora_flashhead_server" else "no_assets"
        assert status["reason_code"] == expected, status
        assert status["counters"]["fallbacks"] == 0
        _assert_healthy(http, server.model, {}, admin)


def test_lora_on_a_flashhead_model_gives_the_plain_lora_servers_tokens(lora_plain_server, lora_flashhead_server):
    answers = []
    for server in (lora_plain_server, lora_flashhead_server):
        with client(server) as http:
            answers.append(
                [
                    _complete(http, model, {}, max_tokens=24, return_token_ids=True)["choices"][0]["token_ids"]
                    for model in (server.model, LORA_NAME)
                ]
            )
    assert answers[0] == answers[1]


# ----------------------------------------------------------------- other vLLM features, FlashHead on


def test_prefix_caching_chunked_prefill_n_and_streaming_with_flashhead(features_server):
    admin = auth(ADMIN_TOKEN)
    model = features_server.model
    with client(features_server) as http:
        cache = http.get("/plugins/my_pkg/config/cache", headers=admin).json()["workers"][0]["config"]
        assert cache["enable_prefix_caching"] is True
        before = http.get(FLASHHEAD, headers=admin).json()["workers"][0]
        assert before["available"] is True, before
        long_prompt = " ".join(["water food and fire"] * 30)  # 120 tokens: 4 prefill chunks of 32
        first = _complete(http, model, {}, prompt=long_prompt, max_tokens=12)
        again = _complete(http, model, {}, prompt=long_prompt, max_tokens=12)  # prefix-cache hit
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        several = _complete(http, model, {}, n=3, temperature=0.9, seed=5, max_tokens=12)
        assert len(several["choices"]) == 3
        mixed = _complete(http, model, {}, n=2, temperature=0.8, logprobs=2, max_tokens=6)
        assert all(c["logprobs"]["top_logprobs"] for c in mixed["choices"])
        with http.stream(
            "POST",
            "/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 10,
                "temperature": 0,
                "stream": True,
            },
        ) as stream:
            assert stream.status_code == 200
            chunks = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]"
        streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1])
        assert streamed == _complete(http, model, {}, max_tokens=10)["choices"][0]["text"]
        status = http.get(FLASHHEAD, headers=admin).json()["workers"][0]
        assert status["active"] is True, status
        after = status["counters"]
        assert after["rows_flashhead"] > before["counters"]["rows_flashhead"]
        assert after["rows_dense"].get("logprobs", 0) > 0
        assert after["fallbacks"] == 0
        _assert_healthy(http, model, {}, admin)


def test_killed_worker_admin_routes_answer_503_quickly(features_server):
    """Runs last on its server: the engine does not come back."""
    admin = auth(ADMIN_TOKEN)
    with client(features_server) as http:
        pid = _worker_pids(http, admin)[0]
        os.kill(pid, signal.SIGKILL)
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for path in ("/plugins/my_pkg/health", "/plugins/my_pkg/workers", FLASHHEAD):
                try:
                    response, elapsed = _timed(lambda path=path: http.get(path, headers=admin, timeout=WAIT + 5))
                except httpx.TransportError:
                    seen.append(0)  # the API server itself went away: nothing left to hang
                    continue
                assert elapsed <= WAIT + 3.0, (path, elapsed)
                assert response.status_code in (503, 504), response.text
                seen.append(response.status_code)
            if seen[-3:] == [503, 503, 503] or seen[-3:] == [0, 0, 0]:
                break
            time.sleep(0.5)
        assert seen and seen[-1] in (0, 503), seen
        if seen[-1] == 503:
            response, elapsed = _timed(lambda: http.get(FLASHHEAD, headers=admin))
            assert response.json()["error"]["type"] == "engine_dead" and elapsed < 1.0


# ----------------------------------------------------------------- pooling model, another plugin


def test_embedding_model_with_the_plugin_loaded(pooling_server):
    admin = auth(ADMIN_TOKEN)
    with client(pooling_server) as http:
        response = http.post("/v1/embeddings", json={"model": pooling_server.model, "input": [PROMPT, "hello world"]})
        assert response.status_code == 200, response.text
        vectors = [item["embedding"] for item in response.json()["data"]]
        assert len(vectors) == 2 and len(vectors[0]) > 0
        assert http.get("/plugins/my_pkg/health", headers=admin).status_code == 200
        status = http.get(FLASHHEAD, headers=admin).json()["workers"][0]
        assert status["reason_code"] == "no_assets"


def test_another_plugin_owning_the_logits_processor_keeps_serving(other_plugin_server, plain_vllm_server):
    admin = auth(ADMIN_TOKEN)
    with client(other_plugin_server) as http:
        status = http.get(FLASHHEAD, headers=admin).json()["workers"][0]
        assert status["reason_code"] == "logits_processor_taken"
        assert "OtherPluginLogitsProcessor" in status["reason"]
        ours = _complete(http, other_plugin_server.model, {}, max_tokens=16, return_token_ids=True)
        refused = http.put(FLASHHEAD, json={"n_probes": 2}, headers=admin)
        assert refused.status_code == 409, refused.text
        _assert_healthy(http, other_plugin_server.model, {}, admin)
    with client(plain_vllm_server) as plain:
        reference = _complete(plain, plain_vllm_server.model, {}, max_tokens=16, return_token_ids=True)
    assert ours["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
