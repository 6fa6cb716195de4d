"""Read routes: response shapes, worker RPC failure mapping, no-engine 503s
and /health diagnostics."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from my_pkg import __version__, contract
from my_pkg.endpoints import metrics as metrics_mod
from my_pkg.endpoints.config import DEFAULT_RPC_TIMEOUT, rpc_timeout_from_env
from my_pkg.endpoints.routes import router
from my_pkg.engine import rpc

pytestmark = pytest.mark.anyio

#: Every route of the router with a request that reaches the workers (derived, never listed by hand).
ROUTES = [
    (method, route.path.replace("{section}", "scheduler"), {"n_probes": 2} if method == "PUT" else None)
    for route in router.routes
    for method in sorted(route.methods - {"HEAD"})
    if not route.path.endswith("/audit")
]
TOKEN = "s3cret-admin-token-of-32-characters"  # the token of the conftest's app_client
#: Every worker method a route reads through first (all but the commit of an update).
READ_METHODS = (
    contract.PING,
    contract.WORKER_INFO,
    contract.CONFIG,
    contract.STATUS,
    contract.FLASHHEAD_STATUS,
    contract.FLASHHEAD_VALIDATE,
    contract.FLASHHEAD_PREPARE,
)


def test_the_route_list_covers_the_router():
    assert {path for _, path, _ in ROUTES} >= {"/plugins/my_pkg/health", "/plugins/my_pkg/flashhead"}
    assert ("PUT", "/plugins/my_pkg/flashhead", {"n_probes": 2}) in ROUTES


# ------------------------------------------------------------------ shapes
async def test_health_ok(app_client, engine):
    r = await app_client.get("/plugins/my_pkg/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["plugin"] == "my_pkg"
    assert body["version"] == __version__ and body["num_workers"] == 2
    assert [w["rank"] for w in body["workers"]] == [0, 1]
    assert 0 <= body["snapshot_age_s"] < 1
    # liveness from the status snapshot, identity and version from the ping (kept: it cannot change)
    assert engine.methods == ["my_pkg_status", "my_pkg_ping"]


async def test_workers_shape(app_client, engine):
    r = await app_client.get("/plugins/my_pkg/workers")
    assert r.status_code == 200
    body = r.json()
    assert body["num_workers"] == 2
    w1 = body["workers"][1]
    assert w1["rank"] == 1 and w1["device"] == "cuda:1" and w1["hostname"] == "node-a"
    assert w1["memory"] == {
        "device_allocated_bytes": 1 << 30,
        "device_reserved_bytes": 2 << 30,
        "process_rss_bytes": 3 << 30,
        "kv_cache_bytes": None,
    }
    assert w1["model"] == {"name": "tiny-model", "path": "/models/tiny", "dtype": "bfloat16", "max_model_len": 4096}
    assert w1["kv_cache"] == {"block_size": 16, "num_blocks": 1001}
    assert 0 <= body["snapshot_age_s"] < 1
    # vLLM is never given a timeout: its expiry would leave a late reply behind.
    assert engine.calls == [
        {"method": method, "timeout": None, "args": (), "kwargs": None}
        for method in ("my_pkg_status", "my_pkg_worker_info")
    ]


async def test_workers_sorted_by_rank_and_extra_fields_kept(app_client, engine):
    info = [engine._as_process(r, contract.WORKER_INFO, rpc.my_pkg_worker_info(engine.workers[r])) for r in (1, 0)]
    info[0]["future_field"] = "x"
    engine.overrides["my_pkg_worker_info"] = info
    body = (await app_client.get("/plugins/my_pkg/workers")).json()
    assert [w["rank"] for w in body["workers"]] == [0, 1]
    assert body["workers"][1]["future_field"] == "x"


@pytest.mark.parametrize("section", ["scheduler", "model", "cache", "parallel"])
async def test_config_sections(section, app_client, engine):
    r = await app_client.get(f"/plugins/my_pkg/config/{section}")
    assert r.status_code == 200
    body = r.json()
    assert body["section"] == section and body["num_workers"] == 2
    expected = vars(getattr(engine.workers[0], f"{section}_config"))  # numbers and allowlisted text pass
    assert body["workers"][0] == {"rank": 0, "dp_rank": 0, "section": section, "config": expected}
    assert engine.calls[-1]["args"] == (section,)


@pytest.mark.parametrize("section", ["lora", "Model", "%2e%2e", "model%20", "__class__"])
async def test_config_unknown_section_404(section, app_client, engine, assert_error):
    err = assert_error(await app_client.get(f"/plugins/my_pkg/config/{section}"), 404, "not_found_error")
    assert err["valid_sections"] == ["scheduler", "model", "cache", "parallel"]
    assert engine.calls == []


async def test_flashhead_status_shape(app_client):
    r = await app_client.get("/plugins/my_pkg/flashhead")
    assert r.status_code == 200
    body = r.json()
    assert body["num_workers"] == 2
    st = body["workers"][0]
    assert set(st) == set(contract.FlashHeadStatus.model_fields)
    assert st["counters"]["rows_dense"] == {"logprobs": 3, "batch_threshold": 7}
    assert st["active"] is True and st["n_probes"] == 4 and st["probe_sampling"] is True
    assert st["pid"] == 1000 and 0 <= body["snapshot_age_s"] < 1


# ------------------------------------------------------------- no engine
@pytest.mark.parametrize("with_token", [True, False])
async def test_no_engine_every_route_503(with_token, monkeypatch, make_app, client_for, assert_error, plugin_log):
    if with_token:
        monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    app = await make_app(None)
    assert any("no engine" in m for m in plugin_log.messages())
    async with client_for(app, token=TOKEN if with_token else None) as c:
        for method, path, body in ROUTES:
            r = await c.request(method, path, json=body)
            if not with_token and not path.endswith("/health"):
                assert_error(r, 403)  # deny by default comes before anything else
                continue
            err = assert_error(r, 503, "engine_unavailable")
            assert "no engine" in err["message"]


# ---------------------------------------------------------- RPC failures
@pytest.mark.parametrize(
    "exc",
    [
        Exception(
            "Call to collective_rpc method failed: Worker failed with error "
            "'boom on rank 1', please check the stack trace above"
        ),
        RuntimeError("boom on rank 1"),
        ValueError("boom on rank 1"),
    ],
)
@pytest.mark.parametrize("method,path,body", ROUTES)
async def test_worker_raising_is_503_with_cause(exc, method, path, body, app_client, engine, assert_error):
    for name in READ_METHODS:
        engine.errors[name] = exc
    err = assert_error(await app_client.request(method, path, json=body), 503, "worker_error")
    assert "boom on rank 1" in err["message"]  # the admin role sees the worker's text
    assert "my_pkg_flashhead_commit" not in engine.methods
    # the server keeps serving once the workers recover
    engine.errors.clear()
    assert (await app_client.get("/plugins/my_pkg/health")).status_code == 200


@pytest.mark.parametrize("wrapped", [True, False])
@pytest.mark.parametrize("method,path,body", ROUTES)
async def test_engine_half_missing_is_503_naming_the_fix(
    wrapped, method, path, body, app_client, engine, assert_error, unknown_method_text
):
    for name in READ_METHODS:
        if wrapped:
            engine.missing.add(name)  # vLLM's wrapped text, plain Exception
        else:
            engine.errors[name] = NotImplementedError(f"Method {name!r} is not implemented.")
    err = assert_error(await app_client.request(method, path, json=body), 503, "engine_plugin_missing")
    assert "my_pkg_engine" in err["hint"]
    assert err["cause"] == "not_loaded"


async def test_not_implemented_in_exception_chain(app_client, engine, assert_error):
    try:
        try:
            raise NotImplementedError("nope")
        except NotImplementedError as inner:
            raise RuntimeError("wrapper") from inner
    except RuntimeError as outer:
        engine.errors["my_pkg_worker_info"] = outer
    assert_error(await app_client.get("/plugins/my_pkg/workers"), 503, "engine_plugin_missing")


async def test_engine_dead_is_503(app_client, engine, assert_error):
    class EngineDeadError(Exception):
        pass

    engine.errors["my_pkg_worker_info"] = EngineDeadError("EngineCore encountered an issue.")
    assert_error(await app_client.get("/plugins/my_pkg/workers"), 503, "engine_dead")


@pytest.mark.parametrize("method,path,body", ROUTES)
async def test_timeout_is_504(method, path, body, monkeypatch, engine, make_app, client_for, assert_error):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "0.05")
    app = await make_app(engine)
    engine.delay = 5.0
    start = time.monotonic()
    async with client_for(app, token=TOKEN) as c:
        err = assert_error(await c.request(method, path, json=body), 504, "timeout_error")
    assert time.monotonic() - start < 2.0
    assert "MY_PKG_RPC_TIMEOUT" in err["hint"]
    # Only the API server bounds its wait; the engine-side call has no timeout.
    assert engine.calls[0]["timeout"] is None
    assert "my_pkg_flashhead_commit" not in engine.methods


async def test_engine_side_timeout_text_is_504(app_client, engine, assert_error):
    engine.errors["my_pkg_status"] = Exception(
        "Call to collective_rpc method failed: RPC call to my_pkg_status timed out."
    )
    assert_error(await app_client.get("/plugins/my_pkg/flashhead"), 504, "timeout_error")


@pytest.mark.parametrize("raw", ["abc", "-1", "0", "nan", "inf", ""])
def test_invalid_rpc_timeout_falls_back_to_default(raw, monkeypatch, plugin_log):
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", raw)
    assert rpc_timeout_from_env() == DEFAULT_RPC_TIMEOUT
    warned = any("MY_PKG_RPC_TIMEOUT" in m for m in plugin_log.messages(logging.WARNING))
    assert warned is (raw != "")


def test_valid_rpc_timeout(monkeypatch):
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", " 2.5 ")
    assert rpc_timeout_from_env() == 2.5


@pytest.mark.parametrize(
    "reply",
    [None, [], ["not a dict"], [{"rank": "zero"}], [{"no_rank": 1}], "text"],
)
async def test_malformed_worker_reply_is_503_not_500(reply, app_client, engine, assert_error):
    engine.overrides["my_pkg_status"] = reply
    for route in ("health", "workers", "flashhead", "metrics"):
        assert_error(await app_client.get(f"/plugins/my_pkg/{route}"), 503, "unexpected_reply")
    del engine.overrides["my_pkg_status"]
    engine.overrides["my_pkg_worker_info"] = reply
    assert_error(await app_client.get("/plugins/my_pkg/workers"), 503, "unexpected_reply")


async def test_unexpected_bug_is_503_not_500(app_client, monkeypatch, assert_error):
    def broken(_statuses):
        raise KeyError("oops")

    monkeypatch.setattr("my_pkg.endpoints.routes.render_metrics", broken)
    assert_error(await app_client.get("/plugins/my_pkg/metrics"), 503, "plugin_error")
    assert metrics_mod.render is not broken


async def test_concurrent_requests_while_one_times_out(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "0.05")
    app = await make_app(engine)
    async with client_for(app, token=TOKEN) as c:
        engine.delays["my_pkg_worker_info"] = 1.0
        slow = asyncio.create_task(c.get("/plugins/my_pkg/workers"))
        while "my_pkg_worker_info" not in engine.methods:
            await asyncio.sleep(0.001)
        fast = await c.get("/plugins/my_pkg/health")
        assert fast.status_code == 200
        assert not slow.done()
        assert (await slow).status_code == 504


# ---------------------------------------------------------- health causes
async def test_health_not_in_vllm_plugins(monkeypatch, app_client, engine, assert_error):
    monkeypatch.setenv("VLLM_PLUGINS", "my_pkg_admin")
    engine.missing.add("my_pkg_ping")
    err = assert_error(await app_client.get("/plugins/my_pkg/health"), 503, "engine_plugin_missing")
    assert err["cause"] == "not_in_vllm_plugins"
    assert "VLLM_PLUGINS" in err["message"]
    assert "VLLM_PLUGINS=my_pkg_admin,my_pkg_engine" in err["hint"]


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes"])
async def test_health_disabled(value, monkeypatch, app_client, engine, assert_error):
    monkeypatch.setenv("VLLM_PLUGINS", "my_pkg_admin,my_pkg_engine")
    monkeypatch.setenv("MY_PKG_DISABLE", value)
    engine.missing.add("my_pkg_ping")
    err = assert_error(await app_client.get("/plugins/my_pkg/health"), 503, "engine_plugin_missing")
    assert err["cause"] == "disabled"
    assert "MY_PKG_DISABLE" in err["message"] and "MY_PKG_DISABLE" in err["hint"]


@pytest.mark.parametrize("value", ["0", "false", "", "off"])
async def test_health_disable_other_values_are_generic(value, monkeypatch, app_client, engine, assert_error):
    monkeypatch.setenv("MY_PKG_DISABLE", value)
    engine.missing.add("my_pkg_ping")
    err = assert_error(await app_client.get("/plugins/my_pkg/health"), 503)
    assert err["cause"] == "not_loaded"
    assert "my_pkg_engine" in err["hint"]


async def test_health_version_mismatch(app_client, engine, assert_error):
    engine.version[1] = "0.0.9"
    err = assert_error(await app_client.get("/plugins/my_pkg/health"), 503, "version_mismatch")
    assert err["workers"] == [{"rank": 1, "plugin": "my_pkg", "version": "0.0.9"}]
    assert err["endpoint_version"] == __version__
    assert "0.0.9" in err["message"] and __version__ in err["hint"]


async def test_health_worker_error_and_timeout(app_client, engine, assert_error):
    engine.errors["my_pkg_ping"] = RuntimeError("cuda error")
    assert_error(await app_client.get("/plugins/my_pkg/health"), 503, "worker_error")
    engine.errors["my_pkg_ping"] = TimeoutError()
    assert_error(await app_client.get("/plugins/my_pkg/health"), 504)


@pytest.mark.parametrize("method,path,body", ROUTES)
async def test_engine_half_missing_as_seen_from_the_cpu_worker(method, path, body, app_client, engine, assert_error):
    # vLLM's CPU worker wrapper answers an unknown method with an AttributeError, as text.
    for name in READ_METHODS:
        engine.errors[name] = Exception(
            "Call to collective_rpc method failed: Worker failed with error "
            f"''CPUWorker' object has no attribute '{name}'', please check the stack trace above"
        )
    err = assert_error(await app_client.request(method, path, json=body), 503, "engine_plugin_missing")
    assert "my_pkg_engine" in err["hint"]
