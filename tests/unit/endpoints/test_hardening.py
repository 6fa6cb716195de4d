"""Authentication before the body, a bounded body, errors without worker internals for non-admins,
one declaration for every mutating route."""

from __future__ import annotations

import pytest
from fastapi import APIRouter

from my_pkg.endpoints.mutation import mutation
from my_pkg.endpoints.route_class import AdminRoute
from my_pkg.endpoints.routes import mutating_routes

pytestmark = pytest.mark.anyio

ADMIN, READER = "admin-token-admin-token-admin-token", "reader-token"
URL = "/plugins/my_pkg/flashhead"


@pytest.fixture
async def app(monkeypatch, engine, make_app):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_READ_TOKEN", READER)
    return await make_app(engine)


class CountingStream:
    """A request body that counts how much of it the server pulled."""

    def __init__(self, size: int, chunk: int = 1024) -> None:
        self.size, self.chunk, self.read = size, chunk, 0

    async def __aiter__(self):
        while self.read < self.size:
            self.read += self.chunk
            yield b" " * self.chunk


async def test_an_unauthenticated_body_is_never_read(app, client_for, assert_error):
    body = CountingStream(8 << 20)
    async with client_for(app, token="wrong") as c:
        assert_error(await c.put(URL, content=body, headers={"Content-Type": "application/json"}), 401)
    assert body.read <= 64 * 1024  # at most what the transport buffers, not the 8 MiB


async def test_a_large_declared_body_is_413_unread(app, client_for, assert_error, engine):
    async with client_for(app, token=ADMIN) as c:
        r = await c.put(URL, content=b"{" + b" " * 10_000 + b"}", headers={"Content-Type": "application/json"})
    err = assert_error(r, 413, "request_too_large")
    assert err["limit_bytes"] == 4096
    assert engine.calls == []


async def test_a_streamed_body_is_cut_at_the_limit(app, client_for, assert_error):
    body = CountingStream(1 << 20)  # chunked: no Content-Length
    async with client_for(app, token=ADMIN) as c:
        assert_error(await c.put(URL, content=body, headers={"Content-Type": "application/json"}), 413)
    assert body.read <= 4096 + 2 * 1024 + 64 * 1024


async def test_the_limit_is_configurable_and_a_small_body_passes(
    monkeypatch, engine, make_app, client_for, assert_error
):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_ADMIN_MAX_BODY_BYTES", "64")
    app = await make_app(engine)
    async with client_for(app, token=ADMIN) as c:
        assert (await c.put(URL, json={"n_probes": 3})).status_code == 200
        assert_error(await c.put(URL, json={"n_probes": 3, "pad": "x" * 80}), 413)


async def test_worker_text_reaches_the_admin_only(app, client_for, engine, assert_error, plugin_log):
    engine.errors["my_pkg_status"] = RuntimeError("/secret/path/on/worker-7 exploded")
    async with client_for(app, token=READER) as reader:
        r = await reader.get(URL)
    err = assert_error(r, 503, "worker_error")
    assert "secret" not in r.text and "worker-7" not in r.text
    assert err["request_id"] == r.headers["X-Request-Id"] and err["request_id"] in err["message"]
    assert any(err["request_id"] in m and "worker-7" in m for m in plugin_log.messages())
    async with client_for(app, token=ADMIN) as admin:
        assert "worker-7" in (await admin.get(URL)).text


async def test_a_bug_is_503_without_its_text_for_readers(app, client_for, monkeypatch, assert_error):
    def broken(_snapshot):
        raise KeyError("internal-detail")

    monkeypatch.setattr("my_pkg.endpoints.routes.render_metrics", broken)
    async with client_for(app, token=READER) as reader:
        r = await reader.get("/plugins/my_pkg/metrics")
    assert_error(r, 503, "plugin_error")
    assert "internal-detail" not in r.text and "KeyError" not in r.text


def test_a_mutating_route_must_be_declared_with_mutation():
    router = APIRouter(route_class=AdminRoute)
    with pytest.raises(TypeError, match="@mutation"):

        @router.post("/forgot")
        async def forgot() -> dict:
            return {}

    @router.post("/declared")
    @mutation("declared", "The declared mutation")
    async def declared(request, state) -> dict:  # noqa: ANN001 - never called
        return {}


def test_every_mutating_route_of_the_router_is_declared():
    routes = mutating_routes()
    assert routes and all(getattr(r.endpoint, "__my_pkg_mutation__", False) for r in routes)


async def test_two_api_servers_racing_end_with_one_winner_and_equal_engines(monkeypatch, engine, make_app, client_for):
    """Two apps (two API-server processes) over one engine: the engine's lease picks one winner."""
    import asyncio

    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    first, second = await make_app(engine), await make_app(engine)
    # Both prepares reach the engine before either commits (the commit is slower than the prepares).
    engine.delays["my_pkg_flashhead_prepare"] = 0.05
    engine.delays["my_pkg_flashhead_commit"] = 0.1
    async with client_for(first, token=ADMIN) as one, client_for(second, token=ADMIN) as two:
        a, b = await asyncio.gather(one.put(URL, json={"n_probes": 11}), two.put(URL, json={"n_probes": 13}))
    codes = sorted([a.status_code, b.status_code])
    assert codes == [200, 409], (a.text, b.text)
    loser = a if a.status_code == 409 else b
    assert loser.json()["error"]["type"] == "update_in_progress"
    winner = (a if a.status_code == 200 else b).json()
    assert {fh["n_probes"] for fh in engine.fh} == {winner["applied"]["n_probes"]}
