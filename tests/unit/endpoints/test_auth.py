"""Authentication of the admin routes: token sources, 401/403 rules, and
path/method variants that must never reach a handler unauthenticated."""

from __future__ import annotations

import logging

import pytest

from my_pkg.endpoints import auth
from my_pkg.endpoints.auth import require_admin_auth, resolve_tokens
from my_pkg.endpoints.config import ROUTE_PREFIX
from my_pkg.endpoints.routes import router

pytestmark = pytest.mark.anyio


def _concrete(path: str) -> str:
    return path.replace("{section}", "model")


#: Every read route of the router (the admin-only audit aside), derived from it.
GET_PATHS = [_concrete(r.path) for r in router.routes if "GET" in r.methods and not r.path.endswith("/audit")]
PUT_BODY = {"n_probes": 8}


# ------------------------------------------------------------ token sources
@pytest.mark.parametrize("source", ["admin_env", "api_key_arg", "vllm_env"])
async def test_token_sources_accept_matching_bearer(source, monkeypatch, engine, make_app, client_for, assert_error):
    api_key = None
    if source == "admin_env":
        monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    elif source == "api_key_arg":
        api_key = ["other", "s3cret"]
    else:
        monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    app = await make_app(engine, api_key=api_key)

    async with client_for(app) as anon:
        for path in GET_PATHS:
            err = assert_error(await anon.get(path), 401, "authentication_error")
            assert "Bearer" in err["hint"]
        r = await anon.get(GET_PATHS[0])
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert_error(await anon.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 401)
    async with client_for(app, token="wrong") as bad:
        r = await bad.get(GET_PATHS[0])
        assert_error(r, 401)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert_error(await bad.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 401)
    async with client_for(app, token="s3cret3") as prefix_plus:
        assert_error(await prefix_plus.get(GET_PATHS[0]), 401)
    assert engine.calls == []

    async with client_for(app, token="s3cret") as good:
        for path in GET_PATHS:
            assert (await good.get(path)).status_code == 200, path
        r = await good.put("/plugins/my_pkg/flashhead", json=PUT_BODY)
        if source == "admin_env":
            assert r.status_code == 200, r.text
        else:  # the server's API keys are shared with every inference client: read role only
            err = assert_error(r, 403, "permission_error")
            assert err["required_role"] == "admin" and err["role"] == "read"
            assert "MY_PKG_ADMIN_TOKEN" in err["hint"]
    assert engine.fh[0]["n_probes"] == (8 if source == "admin_env" else 4)


async def test_read_token_reads_and_only_the_admin_token_mutates(
    monkeypatch, engine, make_app, client_for, assert_error
):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "admin-t")
    monkeypatch.setenv("MY_PKG_READ_TOKEN", "read-t")
    app = await make_app(engine, api_key=["inference-key"])
    for token in ("read-t", "inference-key"):
        async with client_for(app, token=token) as reader:
            for path in GET_PATHS:
                assert (await reader.get(path)).status_code == 200, (token, path)
            err = assert_error(await reader.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 403, "permission_error")
            assert err["required_role"] == "admin" and "admin role" in err["message"]
            # An invalid body from a reader is refused for its role first, not validated.
            assert_error(await reader.put("/plugins/my_pkg/flashhead", json={"n_probes": 0}), 403)
    assert "my_pkg_flashhead_validate" not in engine.methods
    async with client_for(app, token="admin-t") as admin:
        assert (await admin.put("/plugins/my_pkg/flashhead", json=PUT_BODY)).status_code == 200
    assert [fh["n_probes"] for fh in engine.fh] == [8, 8]


async def test_read_tokens_without_an_admin_token_say_how_to_get_one(
    monkeypatch, engine, make_app, client_for, assert_error
):
    monkeypatch.setenv("MY_PKG_READ_TOKEN", "read-t")
    app = await make_app(engine)
    async with client_for(app, token="read-t") as reader:
        err = assert_error(await reader.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 403)
        assert "No admin token is configured" in err["hint"]


def _role(tokens, presented):
    identity = tokens.identify(presented)
    return identity[0] if identity else None


def test_a_token_that_is_both_admin_and_api_key_is_admin_and_warned_about(monkeypatch, plugin_log):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "same")
    tokens = resolve_tokens(type("A", (), {"api_key": ["same", "other"]})())
    assert _role(tokens, "same") == "admin" and _role(tokens, "other") == "read"
    assert _role(tokens, "nope") is None
    auth.warn_about(tokens)
    warnings = plugin_log.messages(logging.WARNING)
    assert any("MY_PKG_ADMIN_TOKEN equals --api-key" in m for m in warnings)
    assert any("shorter than 32 characters" in m for m in warnings)


def test_a_long_admin_token_of_its_own_draws_no_warning(monkeypatch):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "x" * 32)
    monkeypatch.setenv("MY_PKG_READ_TOKEN", "reader")
    assert resolve_tokens(type("A", (), {"api_key": ["other"]})()).warnings == ()
    monkeypatch.setenv("MY_PKG_READ_TOKEN", "x" * 32)
    assert any("equals MY_PKG_READ_TOKEN" in w for w in resolve_tokens(None).warnings)


async def test_admin_token_and_api_keys_are_all_accepted(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "admin")
    app = await make_app(engine, api_key=["k1", "k2"])
    for token in ("admin", "k1", "k2"):
        async with client_for(app, token=token) as c:
            assert (await c.get("/plugins/my_pkg/health")).status_code == 200


async def test_api_key_arg_takes_precedence_over_vllm_api_key_env(
    monkeypatch, engine, make_app, client_for, assert_error
):
    # Same rule as vLLM's own middleware: --api-key wins over VLLM_API_KEY.
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    app = await make_app(engine, api_key=["from-arg"])
    async with client_for(app, token="from-env") as c:
        assert_error(await c.get("/plugins/my_pkg/health"), 401)
    async with client_for(app, token="from-arg") as c:
        assert (await c.get("/plugins/my_pkg/health")).status_code == 200


@pytest.mark.parametrize(
    "header",
    ["Basic s3cret", "s3cret", "Bearer", "Bearer ", "Token s3cret", "Bearers3cret"],
)
async def test_malformed_authorization_header_is_401(header, monkeypatch, engine, make_app, client_for, assert_error):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    app = await make_app(engine)
    async with client_for(app) as c:
        r = await c.get("/plugins/my_pkg/health", headers={"Authorization": header})
        assert_error(r, 401)
    assert engine.calls == []


async def test_bearer_scheme_is_case_insensitive(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    app = await make_app(engine)
    async with client_for(app) as c:
        r = await c.get("/plugins/my_pkg/health", headers={"Authorization": "bearer s3cret"})
        assert r.status_code == 200


# ----------------------------------------------------------- no token at all
async def test_no_token_denies_everything_but_health_with_the_fix(
    engine, make_app, client_for, assert_error, plugin_log
):
    app = await make_app(engine)
    assert any("No admin token configured" in m for m in plugin_log.messages(logging.WARNING))
    async with client_for(app) as c:
        assert (await c.get(f"{ROUTE_PREFIX}/health")).status_code == 200
        for path in GET_PATHS + [f"{ROUTE_PREFIX}/audit"]:
            if path.endswith("/health"):
                continue
            err = assert_error(await c.get(path), 403, "permission_error")
            assert "MY_PKG_ADMIN_TOKEN" in err["hint"] and "MY_PKG_ALLOW_ANONYMOUS_READS=1" in err["hint"], path
        assert_error(await c.put(f"{ROUTE_PREFIX}/flashhead", json=PUT_BODY), 403)
    assert "my_pkg_config" not in engine.methods and "my_pkg_worker_info" not in engine.methods


async def test_no_token_get_allowed_with_the_opt_in_put_forbidden(
    monkeypatch, engine, make_app, client_for, assert_error, plugin_log
):
    monkeypatch.setenv("MY_PKG_ALLOW_ANONYMOUS_READS", "1")
    app = await make_app(engine)
    warnings = plugin_log.messages(logging.WARNING)
    assert any("No admin token configured and MY_PKG_ALLOW_ANONYMOUS_READS=1" in m for m in warnings)

    async with client_for(app) as c:
        for path in GET_PATHS:
            assert (await c.get(path)).status_code == 200, path
        assert_error(await c.get(f"{ROUTE_PREFIX}/audit"), 403)
        calls_before = list(engine.methods)
        err = assert_error(await c.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 403, "permission_error")
        assert "MY_PKG_ADMIN_TOKEN" in err["hint"] and err["required_role"] == "admin"
        # Invalid body too: 403 comes first, nothing reaches the workers.
        assert_error(await c.put("/plugins/my_pkg/flashhead", json={}), 403)
        # A token sent while none is configured does not unlock mutation.
        r = await c.put(
            "/plugins/my_pkg/flashhead",
            json=PUT_BODY,
            headers={"Authorization": "Bearer anything"},
        )
        assert_error(r, 403)
    assert engine.methods == calls_before
    assert "my_pkg_flashhead_prepare" not in engine.methods
    assert "my_pkg_flashhead_commit" not in engine.methods
    assert engine.fh[0]["n_probes"] == 4


async def test_no_warning_when_token_configured(monkeypatch, engine, make_app, plugin_log):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    await make_app(engine)
    assert not any("No admin token" in m for m in plugin_log.messages())


# ------------------------------------------------ request-time resolution
async def test_tokens_come_from_state_set_by_init_state(monkeypatch, engine, make_app, client_for, assert_error):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "at-start")
    app = await make_app(engine)
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "changed-later")
    async with client_for(app, token="at-start") as c:
        assert (await c.get("/plugins/my_pkg/health")).status_code == 200
    async with client_for(app, token="changed-later") as c:
        assert_error(await c.get("/plugins/my_pkg/health"), 401)


async def test_falls_back_to_env_when_init_state_has_not_run(monkeypatch, engine, make_app, client_for, assert_error):
    app = await make_app(engine, init=False)
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "env-token")
    async with client_for(app) as c:
        assert_error(await c.get("/plugins/my_pkg/health"), 401)
    async with client_for(app, token="env-token") as c:
        # authenticated, but no state yet: 503, not 500
        assert_error(await c.get("/plugins/my_pkg/health"), 503, "engine_unavailable")


async def test_falls_back_to_app_args_api_key_when_init_state_has_not_run(engine, make_app, client_for, assert_error):
    app = await make_app(engine, api_key=["arg-key"], init=False)
    async with client_for(app) as c:
        assert_error(await c.get("/plugins/my_pkg/health"), 401)
        assert_error(await c.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 401)


async def test_no_state_no_token_put_is_403(engine, make_app, client_for, assert_error):
    app = await make_app(engine, init=False)
    async with client_for(app) as c:
        assert_error(await c.put("/plugins/my_pkg/flashhead", json=PUT_BODY), 403)


# --------------------------------------------------------- constant time
@pytest.mark.parametrize("presented", ["t1", "t3", "nope"])
def test_token_check_compares_all_tokens(presented, monkeypatch):
    tokens = resolve_tokens(type("A", (), {"api_key": ["t1", "t2", "t3"]})())
    compared = []
    real = auth.secrets.compare_digest

    def counting(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.secrets, "compare_digest", counting)
    assert (tokens.identify(presented) is not None) is (presented != "nope")
    # every token compared, over fixed-size digests, whichever matched
    assert compared == [(32, 32)] * 3


def test_resolve_tokens_sources(monkeypatch):
    assert not resolve_tokens(None).configured
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "  ")
    assert not resolve_tokens(None).configured  # blank means unset
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "a")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    ts = resolve_tokens(None)
    assert ts.sources == ("MY_PKG_ADMIN_TOKEN", "VLLM_API_KEY")
    assert ts.identify("a") and ts.identify("v") and not ts.identify("b")
    ts = resolve_tokens(type("A", (), {"api_key": "single"})())
    assert ts.identify("single") and not ts.identify("v")


# ---------------------------------------------------------- path variants
VARIANTS = [
    ("GET", "/plugins/my_pkg/health/"),
    ("GET", "/plugins/my_pkg/HEALTH"),
    ("GET", "/PLUGINS/MY_PKG/health"),
    ("GET", "/plugins/MY_PKG/workers"),
    ("GET", "/plugins/my_pkg/%68ealth"),
    ("GET", "/plugins%2Fmy_pkg%2Fworkers"),
    ("GET", "/plugins/my_pkg/%66lashhead"),
    ("GET", "/plugins/my_pkg/./metrics"),
    ("GET", "/plugins/my_pkg//health"),
    ("GET", "/plugins//my_pkg/health"),
    ("GET", "/plugins/my_pkg/config/model/"),
    ("GET", "/plugins/my_pkg/config/%6dodel"),
    ("GET", "/plugins/my_pkg/config/%2e%2e"),
    ("GET", "/plugins/my_pkg/config/..%2fworkers"),
    ("GET", "/plugins/my_pkg/workers?x=1"),
    ("GET", "/proxy/plugins/my_pkg/health"),
    ("HEAD", "/plugins/my_pkg/health"),
    ("HEAD", "/plugins/my_pkg/flashhead"),
    ("HEAD", "/plugins/my_pkg/metrics"),
    ("OPTIONS", "/plugins/my_pkg/health"),
    ("OPTIONS", "/plugins/my_pkg/flashhead"),
    ("PUT", "/plugins/my_pkg/flashhead/"),
    ("PUT", "/plugins/my_pkg/FLASHHEAD"),
    ("PUT", "/plugins/my_pkg/%66lashhead"),
    ("POST", "/plugins/my_pkg/flashhead"),
    ("PATCH", "/plugins/my_pkg/flashhead"),
    ("DELETE", "/plugins/my_pkg/flashhead"),
]


@pytest.mark.parametrize("root_path", ["", "/proxy"])
@pytest.mark.parametrize("method,path", VARIANTS)
async def test_path_variants_never_reach_a_handler_unauthenticated(
    method, path, root_path, monkeypatch, engine, make_app, client_for
):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    app = await make_app(engine, root_path=root_path)
    async with client_for(app) as c:
        r = await c.request(method, path, json=PUT_BODY if method == "PUT" else None)
        assert r.status_code in (307, 401, 404, 405), (r.status_code, r.text)
        if r.status_code == 307:
            # following the redirect meets the check too
            r2 = await c.request(method, r.headers["location"], json=PUT_BODY if method == "PUT" else None)
            assert r2.status_code in (401, 404, 405)
        assert r.status_code not in range(200, 300)
    assert engine.calls == []
    assert engine.fh[0]["n_probes"] == 4


@pytest.mark.parametrize("path", ["/proxy/plugins/my_pkg/health", "/plugins/my_pkg/health"])
async def test_root_path_authenticated_works(path, monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    app = await make_app(engine, root_path="/proxy")
    async with client_for(app, token="s3cret") as c:
        assert (await c.get(path)).status_code == 200


@pytest.mark.parametrize(
    "method,path",
    [
        ("PUT", "/plugins/my_pkg/flashhead/"),
        ("PUT", "/plugins/my_pkg/%66lashhead"),
        ("PUT", "/plugins/my_pkg/Flashhead"),
        ("POST", "/plugins/my_pkg/flashhead"),
        ("HEAD", "/plugins/my_pkg/flashhead"),
        ("OPTIONS", "/plugins/my_pkg/flashhead"),
    ],
)
async def test_no_token_mutation_variants_never_apply(method, path, engine, make_app, client_for):
    app = await make_app(engine)
    async with client_for(app) as c:
        r = await c.request(method, path, json=PUT_BODY if method in ("PUT", "POST") else None, follow_redirects=True)
        assert r.status_code in (403, 404, 405), r.text
    assert "my_pkg_flashhead_validate" not in engine.methods
    assert "my_pkg_flashhead_apply" not in engine.methods


async def test_cors_preflight_does_not_reach_handler(monkeypatch, engine, make_app, client_for):
    from starlette.middleware.cors import CORSMiddleware

    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    app = await make_app(engine)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    async with client_for(app) as c:
        r = await c.options(
            "/plugins/my_pkg/flashhead",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "PUT"},
        )
        assert r.status_code in (200, 400, 405)
        r = await c.put("/plugins/my_pkg/flashhead", json=PUT_BODY, headers={"Origin": "http://evil.example"})
        assert r.status_code == 401
    assert engine.calls == []


async def test_every_plugin_route_carries_the_auth_dependency(engine, make_app):
    from fastapi.routing import APIRoute

    app = await make_app(engine)
    routes = [r for r in app.routes if getattr(r, "path", "").startswith(ROUTE_PREFIX)]
    assert len(routes) >= 6
    for route in routes:
        assert isinstance(route, APIRoute)
        calls = [d.call for d in route.dependant.dependencies]
        assert require_admin_auth in calls, route.path
        # it runs before anything else the route depends on
        assert calls[0] is require_admin_auth


@pytest.mark.parametrize("content", [b"{not json", b"", b"null", b'{"bogus": 1}'])
@pytest.mark.parametrize("configured", [True, False])
async def test_auth_decides_before_body_validation(
    content, configured, monkeypatch, engine, make_app, client_for, assert_error
):
    if configured:
        monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", "s3cret")
    app = await make_app(engine)
    async with client_for(app) as c:
        r = await c.put("/plugins/my_pkg/flashhead", content=content, headers={"Content-Type": "application/json"})
        assert_error(r, 401 if configured else 403)
    assert engine.calls == []
