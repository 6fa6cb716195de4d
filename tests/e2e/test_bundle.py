"""The plugin bundle against real vLLM servers over HTTP (issue: engine + endpoint halves)."""

from __future__ import annotations

import os

import pytest
import torch
from e2e_support import API_KEY, auth, client

import my_pkg

pytestmark = pytest.mark.e2e

ROUTES = [
    "/plugins/my_pkg/health",
    "/plugins/my_pkg/workers",
    "/plugins/my_pkg/config/model",
    "/plugins/my_pkg/flashhead",
    "/plugins/my_pkg/metrics",
]


def _complete(http, model: str, headers: dict[str, str] | None = None) -> dict:
    response = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "the world and the sun", "max_tokens": 4, "temperature": 0},
        headers=headers or {},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_every_route_answers_with_real_worker_data(flashhead_server):
    with client(flashhead_server) as http:
        health = http.get("/plugins/my_pkg/health", headers=auth())
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["version"] == my_pkg.__version__
        assert [w["version"] for w in body["workers"]] == [my_pkg.__version__]

        workers = http.get("/plugins/my_pkg/workers", headers=auth()).json()
        assert workers["num_workers"] == 1
        worker = workers["workers"][0]
        assert worker["rank"] == 0 and worker["world_size"] == 1
        # The worker is its own process, not the API server (nor this test).
        assert worker["pid"] not in (os.getpid(), flashhead_server.process.pid)
        assert worker["device"] == "cpu"
        assert worker["torch_version"] == torch.__version__
        assert worker["vllm_version"].startswith("0.")
        assert worker["model"]["max_model_len"] == 512
        assert worker["model"]["dtype"] == "float32"
        assert worker["kv_cache"]["block_size"] > 0 and worker["kv_cache"]["num_blocks"] > 0
        assert worker["memory"]["process_rss_bytes"] > 0
        assert worker["memory"]["kv_cache_bytes"] > 0

        sections = {}
        for section in ("scheduler", "model", "cache", "parallel"):
            response = http.get(f"/plugins/my_pkg/config/{section}", headers=auth())
            assert response.status_code == 200, response.text
            sections[section] = response.json()["workers"][0]["config"]
        assert sections["model"]["max_model_len"] == 512
        assert sections["parallel"]["tensor_parallel_size"] == 1
        assert sections["cache"]["block_size"] == worker["kv_cache"]["block_size"]
        assert sections["scheduler"]["max_num_seqs"] >= 1

        unknown = http.get("/plugins/my_pkg/config/lora", headers=auth())
        assert unknown.status_code == 404
        assert "scheduler" in unknown.text and "parallel" in unknown.text

        completion = _complete(http, str(flashhead_server.model), auth())
        assert completion["usage"]["completion_tokens"] == 4


def test_api_key_protects_plugin_routes(flashhead_server):
    with client(flashhead_server) as http:
        for route in ROUTES:
            assert http.get(route).status_code == 401, route
            assert http.get(route, headers=auth("wrong-key")).status_code == 401, route
            assert http.get(route, headers=auth(API_KEY)).status_code == 200, route
        # A mutating route without the admin token changes nothing; the API key only reads.
        assert http.put("/plugins/my_pkg/flashhead", json={"enabled": False}).status_code == 401
        refused = http.put("/plugins/my_pkg/flashhead", json={"enabled": False}, headers=auth(API_KEY))
        assert refused.status_code == 403 and refused.json()["error"]["required_role"] == "admin"
        assert http.get("/plugins/my_pkg/flashhead", headers=auth()).json()["workers"][0]["enabled"] is True
        # Path variants never reach a handler without the token.
        for variant in (
            "/plugins/my_pkg/workers/",
            "/PLUGINS/my_pkg/workers",
            "/plugins/my_pkg/%77orkers",
            "/plugins/my_pkg//workers",
        ):
            response = http.get(variant)
            assert response.status_code in (401, 404, 307), (variant, response.status_code)
            assert "hostname" not in response.text
        assert http.head("/plugins/my_pkg/workers").status_code in (401, 404, 405)


def test_plugin_routes_do_not_shadow_core_routes(flashhead_server, plain_vllm_server):
    with client(flashhead_server) as ours, client(plain_vllm_server) as plain:
        with_plugin = ours.get("/openapi.json").json()["paths"]
        without = plain.get("/openapi.json").json()["paths"]
    for path, operations in without.items():
        assert path in with_plugin, path
        assert set(operations) <= set(with_plugin[path]), path
    added = set(with_plugin) - set(without)
    assert added and all(path.startswith("/plugins/my_pkg/") for path in added)
    workers_op = with_plugin["/plugins/my_pkg/workers"]["get"]
    assert "$ref" in str(workers_op["responses"]["200"])


def test_endpoint_half_without_engine_half_reports_the_fix(endpoint_only_server):
    with client(endpoint_only_server) as http:
        response = http.get("/plugins/my_pkg/health")
        assert response.status_code == 503
        error = response.json()["error"]
        assert "my_pkg_engine" in (error["message"] + (error.get("hint") or ""))
        assert "VLLM_PLUGINS" in (error["message"] + (error.get("hint") or ""))
        assert http.get("/plugins/my_pkg/workers").status_code == 403  # deny by default: no token configured
        _complete(http, str(endpoint_only_server.model))


def test_nothing_allowlisted_means_no_plugin_routes(plain_vllm_server):
    with client(plain_vllm_server) as http:
        for route in ROUTES:
            assert http.get(route).status_code == 404, route
        _complete(http, str(plain_vllm_server.model))


def test_tensor_parallel_two_reports_two_workers(tp2_server):
    with client(tp2_server) as http:
        assert http.get("/plugins/my_pkg/workers").status_code == 401
        workers = http.get("/plugins/my_pkg/workers", headers=auth("tp2-token")).json()
        assert workers["num_workers"] == 2
        ranks = sorted(w["rank"] for w in workers["workers"])
        pids = {w["pid"] for w in workers["workers"]}
        assert ranks == [0, 1] and len(pids) == 2
        assert all(w["world_size"] == 2 for w in workers["workers"])
        parallel = http.get("/plugins/my_pkg/config/parallel", headers=auth("tp2-token")).json()
        assert [w["config"]["tensor_parallel_size"] for w in parallel["workers"]] == [2, 2]
        # FlashHead runs on each rank's vocabulary shard (tests/e2e/test_tensor_parallel.py).
        status = http.get("/plugins/my_pkg/flashhead", headers=auth("tp2-token")).json()
        assert [w["active"] for w in status["workers"]] == [True, True]
        _complete(http, str(tp2_server.model))
