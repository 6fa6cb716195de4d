"""The plugin against vLLM's real plugin machinery, middleware and exception
handlers (imports vLLM, so slower than the other tests)."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace

import pytest
from fastapi import FastAPI

from my_pkg.endpoints import AdminEndpointPlugin
from my_pkg.endpoints.config import ROUTE_PREFIX, STATE_ATTR

pytestmark = pytest.mark.anyio

TOKEN = "s3cret"
ADMIN = "admin-only-token"


@pytest.fixture(scope="module")
def vllm_iface():
    return pytest.importorskip("vllm.plugins.endpoint_plugins.interface")


def test_satisfies_vllm_endpoint_plugin_protocol(vllm_iface):
    plugin = AdminEndpointPlugin()
    assert isinstance(plugin, vllm_iface.EndpointPlugin)
    assert plugin.name == "my_pkg"
    assert plugin.required_tasks is None  # loads on the render server too


def _core_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def core_health():
        return {"core": True}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    return app


def _server_args(api_key=None) -> Namespace:
    return Namespace(
        api_key=api_key,
        allowed_origins=["*"],
        allow_credentials=False,
        allowed_methods=["*"],
        allowed_headers=["*"],
        enable_request_id_headers=False,
        middleware=[],
        log_error_stack=False,
        root_path=None,
    )


@pytest.fixture
async def vllm_app(vllm_iface, monkeypatch, engine):
    """An app wired the way vLLM's build_app/init_app_state wire plugins."""
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    monkeypatch.setenv("VLLM_PLUGINS", "my_pkg_admin,my_pkg_engine")
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    args = _server_args(api_key=[TOKEN])
    app = _core_app()
    app.state.args = args
    vllm_iface.attach_endpoint_plugins(app, ())
    init_exception_handler(app)
    init_entrypoints_middleware(args, app, ())
    await vllm_iface.init_endpoint_plugins_state(engine, app.state, args)
    return app


async def test_loaded_through_entry_point_and_allowlist(vllm_app, client_for, engine):
    plugins = vllm_app.state.endpoint_plugins
    assert [type(p) for p in plugins] == [AdminEndpointPlugin]
    assert getattr(vllm_app.state, STATE_ATTR).engine_client is engine
    async with client_for(vllm_app, token=TOKEN) as c:
        assert (await c.get("/plugins/my_pkg/health")).status_code == 200
        # core routes are untouched
        assert (await c.get("/health")).json() == {"core": True}
        assert (await c.get("/v1/models")).status_code == 200


def test_not_loaded_without_allowlist(vllm_iface, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    app = _core_app()
    vllm_iface.attach_endpoint_plugins(app, ())
    assert not any(getattr(r, "path", "").startswith(ROUTE_PREFIX) for r in app.routes)


def test_does_not_shadow_core_routes(vllm_iface, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "my_pkg_admin")
    app = _core_app()
    before = {(r.path, frozenset(getattr(r, "methods", None) or ())) for r in app.routes}
    vllm_iface.attach_endpoint_plugins(app, ())
    after = {(r.path, frozenset(getattr(r, "methods", None) or ())) for r in app.routes}
    assert before <= after
    added = after - before
    assert added and all(path.startswith(ROUTE_PREFIX + "/") for path, _ in added)


async def test_api_key_guards_plugin_routes_and_errors_keep_our_format(vllm_app, client_for, assert_error, engine):
    async with client_for(vllm_app) as anon:
        # vLLM's middleware guards /v1 but not /plugins: our check answers
        assert (await anon.get("/v1/models")).status_code == 401
        r = await anon.get("/plugins/my_pkg/workers")
        assert_error(r, 401, "authentication_error")
        assert r.headers["www-authenticate"].startswith("Bearer")
        preflight = await anon.options(
            "/plugins/my_pkg/flashhead",
            headers={"Origin": "http://x.example", "Access-Control-Request-Method": "PUT"},
        )
        assert preflight.status_code in (200, 400, 405)  # answered by CORS, not us
    assert engine.methods in ([], ["my_pkg_status"])  # at most the start-up snapshot
    async with client_for(vllm_app, token=TOKEN) as c:
        # The server's API key reads; it never mutates (every inference client holds it).
        err = assert_error(await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 3}), 403, "permission_error")
        assert err["required_role"] == "admin"
        engine.errors["my_pkg_worker_info"] = ValueError("bad")
        assert_error(await c.get("/plugins/my_pkg/workers"), 503, "worker_error")
    assert "my_pkg_flashhead_validate" not in engine.methods
    async with client_for(vllm_app, token=ADMIN) as admin:
        # vLLM maps validation errors to 400 in its own format; ours stay 422
        err = assert_error(
            await admin.put("/plugins/my_pkg/flashhead", json={"n_probes": 0}), 422, "invalid_request_error"
        )
        assert err["errors"]
        assert (await admin.put("/plugins/my_pkg/flashhead", json={"n_probes": 3})).status_code == 200


async def test_render_server_no_engine(vllm_iface, monkeypatch, client_for, assert_error):
    monkeypatch.setenv("VLLM_PLUGINS", "my_pkg_admin")
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    app = _core_app()
    vllm_iface.attach_endpoint_plugins(app, ("render",))
    await vllm_iface.init_endpoint_plugins_state(None, app.state, _server_args())
    async with client_for(app, token=TOKEN) as c:
        assert_error(await c.get("/plugins/my_pkg/health"), 503, "engine_unavailable")


async def test_openapi_lists_routes_and_models(vllm_app):
    spec = vllm_app.openapi()
    paths = spec["paths"]
    expected = {
        "/plugins/my_pkg/health": ("get", "HealthResponse"),
        "/plugins/my_pkg/workers": ("get", "WorkersResponse"),
        "/plugins/my_pkg/config/{section}": ("get", "ConfigResponse"),
        "/plugins/my_pkg/flashhead": ("get", "FlashHeadStatusResponse"),
    }
    for path, (method, model) in expected.items():
        op = paths[path][method]
        ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
        assert op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "503" in op["responses"] and "504" in op["responses"]
    put = paths["/plugins/my_pkg/flashhead"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/FlashHeadUpdate")
    assert put["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/FlashHeadUpdateResponse")
    assert {"409", "422"} <= set(put["responses"])
    assert "404" in paths["/plugins/my_pkg/config/{section}"]["get"]["responses"]
    assert "text/plain" in paths["/plugins/my_pkg/metrics"]["get"]["responses"]["200"]["content"]
    schemas = spec["components"]["schemas"]
    upd = schemas["FlashHeadUpdate"]
    assert upd["additionalProperties"] is False
    assert set(upd["properties"]) == {"enabled", "n_probes", "dense_batch_threshold", "draft_n_probes"}
    for name in ("WorkerInfo", "FlashHeadStatus", "ErrorResponse", "ErrorInfo"):
        assert name in schemas
    # nothing outside our prefix came from us
    assert all(not p.startswith("/plugins/") or p.startswith(ROUTE_PREFIX + "/") for p in paths)
    # the bearer scheme is in the document, on every plugin operation (and on nothing of vLLM's)
    scheme = spec["components"]["securitySchemes"]["my_pkg_bearer"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer" and "MY_PKG_ADMIN_TOKEN" in scheme["description"]
    for path, operations in paths.items():
        for operation in operations.values():
            assert (operation.get("security") == [{"my_pkg_bearer": []}]) is path.startswith(ROUTE_PREFIX), path
    for name in ("HealthResponse", "WorkersResponse", "FlashHeadStatusResponse"):
        assert "snapshot_age_s" in schemas[name]["required"]
    assert upd["minProperties"] == 1
    # null is a value of dense_batch_threshold only ("never switch to the dense head")
    assert [name for name, field in upd["properties"].items() if "anyOf" in field] == ["dense_batch_threshold"]


async def test_the_metrics_are_on_vllms_own_metrics_route(vllm_app, client_for, monkeypatch, engine):
    """vLLM's /metrics (its instrumentator on the process registry) shows the plugin's series next to its own."""
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router as attach_vllm_metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    attach_vllm_metrics(vllm_app)
    async with client_for(vllm_app, token=ADMIN) as c:
        assert (await c.get("/plugins/my_pkg/flashhead")).status_code == 200
        calls = len(engine.calls)
        scraped = await c.get("/metrics")
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    lines = scraped.text.splitlines()
    assert 'my_pkg_flashhead_steps_total{dp_rank="0",rank="1"} 11.0' in lines
    assert any(line.startswith("http_requests_total{") for line in lines)  # vLLM's own HTTP metrics
    assert len(engine.calls) == calls  # the scrape read the snapshot the route fetched


def test_import_pulls_in_neither_vllm_nor_engine_half():
    code = (
        "import sys, my_pkg.endpoints, my_pkg.endpoints.routes, my_pkg.endpoints.plugin\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')\n"
        "       or m == 'my_pkg.engine' or m.startswith('my_pkg.engine.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("sent", [None, "caller-id-7"])
async def test_with_vllms_request_id_headers_one_x_request_id_goes_out(
    sent, vllm_iface, monkeypatch, engine, client_for
):
    """`--enable-request-id-headers`: vLLM's middleware writes the header; the plugin uses the same id."""
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    monkeypatch.setenv("VLLM_PLUGINS", "my_pkg_admin,my_pkg_engine")
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    args = _server_args()
    args.enable_request_id_headers = True
    app = _core_app()
    app.state.args = args
    vllm_iface.attach_endpoint_plugins(app, ())
    init_entrypoints_middleware(args, app, ())
    await vllm_iface.init_endpoint_plugins_state(engine, app.state, args)
    headers = {"X-Request-Id": sent} if sent else {}
    async with client_for(app, token=ADMIN) as c:
        r = await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 3}, headers=headers)
        assert r.status_code == 200, r.text
        audit = (await c.get("/plugins/my_pkg/audit")).json()["mutations"]
    ids = r.headers.get_list("X-Request-Id")
    assert len(ids) == 1
    if sent:  # the caller's id is the one vLLM echoes and the one the audit keeps
        assert ids == [sent] and audit[-1]["request_id"] == sent
