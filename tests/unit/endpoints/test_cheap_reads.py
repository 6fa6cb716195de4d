"""Cheap reads: static replies fetched once, dynamic ones from a snapshot no older than MY_PKG_STATUS_MAX_AGE."""

from __future__ import annotations

import asyncio
import logging

import pytest

from my_pkg.endpoints.config import DEFAULT_STATUS_MAX_AGE, status_max_age_from_env

pytestmark = pytest.mark.anyio

TOKEN = "s3cret"
FLASHHEAD = "/plugins/my_pkg/flashhead"
READ_ROUTES = ("health", "workers", "config/scheduler", "flashhead", "metrics")
LONG = 60  # a max age no test outlives, however slow the machine


@pytest.fixture
def client(monkeypatch, engine, make_app, client_for):
    """``await client(max_age=None)``: a client of a fresh app whose status max age is ``max_age`` seconds."""
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)

    async def make(max_age: float | None = None):
        if max_age is not None:
            monkeypatch.setenv("MY_PKG_STATUS_MAX_AGE", str(max_age))
        app = await make_app(engine, fill_seen=True)  # the start-up snapshot counts as the first status call
        return client_for(app, token=TOKEN), app.state.my_pkg_admin

    return make


async def test_polling_every_read_route_within_the_max_age_costs_one_call_per_kind(client, engine):
    c, _ = await client(max_age=LONG)
    async with c:
        for _ in range(4):
            for route in READ_ROUTES:
                assert (await c.get(f"/plugins/my_pkg/{route}")).status_code == 200, route
    assert sorted(engine.methods) == ["my_pkg_config", "my_pkg_ping", "my_pkg_status", "my_pkg_worker_info"]


async def test_concurrent_reads_share_one_status_call(client, engine):
    c, _ = await client(max_age=LONG)
    engine.delay = 0.1
    async with c:
        replies = await asyncio.gather(
            *[c.get(f"/plugins/my_pkg/{route}") for route in ("flashhead", "metrics", "flashhead", "health", "workers")]
        )
    assert [r.status_code for r in replies] == [200] * 5
    assert engine.methods.count("my_pkg_status") == 1


async def test_each_config_section_is_fetched_once(client, engine):
    c, _ = await client(max_age=LONG)
    async with c:
        for section in ("model", "cache", "model", "cache", "model"):
            body = (await c.get(f"/plugins/my_pkg/config/{section}")).json()
            assert body["section"] == section and body["workers"][0]["section"] == section
    assert [call["args"] for call in engine.calls if call["method"] == "my_pkg_config"] == [("model",), ("cache",)]


async def test_a_snapshot_is_served_until_it_is_older_than_the_max_age(client, engine):
    c, _ = await client(max_age=1.0)
    async with c:
        first = (await c.get(FLASHHEAD)).json()
        engine.fh[0]["counters"] = engine.fh[0]["counters"].model_copy(update={"steps": 99})
        await asyncio.sleep(0.1)
        cached = (await c.get(FLASHHEAD)).json()
        assert cached["workers"][0]["counters"]["steps"] == 10  # the snapshot, not the workers' new count
        assert 0.1 <= cached["snapshot_age_s"] <= 1.0 and cached["snapshot_age_s"] > first["snapshot_age_s"]
        await asyncio.sleep(1.0)
        fresh = (await c.get(FLASHHEAD)).json()
    assert fresh["workers"][0]["counters"]["steps"] == 99 and fresh["snapshot_age_s"] < 1.0
    assert engine.methods == ["my_pkg_status", "my_pkg_status"]


async def test_max_age_zero_asks_the_workers_on_every_read(client, engine):
    c, _ = await client(max_age=0)
    async with c:
        for _ in range(3):
            assert (await c.get(FLASHHEAD)).status_code == 200
    assert engine.methods == ["my_pkg_status"] * 4  # the start-up snapshot, then one per read


async def test_a_read_after_a_put_shows_the_new_settings(client, engine):
    c, _ = await client(max_age=LONG)
    async with c:
        assert [w["n_probes"] for w in (await c.get(FLASHHEAD)).json()["workers"]] == [4, 4]
        assert (await c.put(FLASHHEAD, json={"n_probes": 8})).status_code == 200
        after = (await c.get(FLASHHEAD)).json()
        metrics = (await c.get("/plugins/my_pkg/metrics")).text
    assert [w["n_probes"] for w in after["workers"]] == [8, 8]
    assert 'my_pkg_flashhead_n_probes{dp_rank="0",rank="0"} 8.0' in metrics
    assert engine.methods.count("my_pkg_status") == 2


async def test_a_rejected_put_also_drops_the_snapshot(client, engine):
    c, _ = await client(max_age=LONG)
    async with c:
        assert (await c.get(FLASHHEAD)).status_code == 200
        assert (await c.put(FLASHHEAD, json={"n_probes": 999})).status_code == 409
        assert (await c.get(FLASHHEAD)).status_code == 200
    # the start-up snapshot serves the first read; the rejected PUT (prepare, then abort) marks it stale
    assert engine.methods == ["my_pkg_status", "my_pkg_flashhead_prepare", "my_pkg_flashhead_abort", "my_pkg_status"]


async def test_a_status_call_sent_before_a_put_is_neither_joined_nor_kept_after_it(client, engine, monkeypatch):
    """The race a plain cache would lose: a read in flight when an update lands answers with the old
    settings to its own caller, but a read after the update neither joins it nor gets its result later."""
    c, handler = await client(max_age=LONG)
    release = asyncio.Event()
    real = engine.collective_rpc
    held = []

    async def first_status_call_waits(method, timeout=None, args=(), kwargs=None):
        replies = await real(method, timeout=timeout, args=args, kwargs=kwargs)
        if method == "my_pkg_status" and not held:
            held.append(method)
            await release.wait()  # the workers answered; the reply is still on its way
        return replies

    monkeypatch.setattr(engine, "collective_rpc", first_status_call_waits)
    handler.invalidate_status()  # the start-up snapshot is not what this test races
    async with c:
        before = asyncio.create_task(c.get(FLASHHEAD))
        while not held:
            await asyncio.sleep(0.001)
        assert (await c.put(FLASHHEAD, json={"n_probes": 8})).status_code == 200
        after = (await c.get(FLASHHEAD)).json()
        release.set()
        old = (await before).json()
        again = (await c.get(FLASHHEAD)).json()
    assert [w["n_probes"] for w in old["workers"]] == [4, 4]
    assert [w["n_probes"] for w in after["workers"]] == [8, 8]
    assert [w["n_probes"] for w in again["workers"]] == [8, 8]
    assert engine.methods.count("my_pkg_status") == 3  # at start-up, the held one, and the one after the PUT


async def test_a_stalled_worker_is_noticed_once_the_snapshot_is_too_old(client, engine, monkeypatch, assert_error):
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "0.1")
    c, handler = await client(max_age=1.0)
    async with c:
        assert (await c.get("/plugins/my_pkg/health")).status_code == 200
        engine.delay = 2.0
        assert (await c.get("/plugins/my_pkg/health")).status_code == 200  # within the max age
        await asyncio.sleep(1.05)
        for route in ("health", "workers", "flashhead", "metrics"):
            assert_error(await c.get(f"/plugins/my_pkg/{route}"), 504, "timeout_error")
        assert (await c.get("/plugins/my_pkg/config/cache")).status_code == 504  # never fetched yet
        engine.delay = 0.0
        await asyncio.sleep(2.0)  # the stalled calls end
        assert (await c.get("/plugins/my_pkg/health")).status_code == 200


async def test_a_dead_engine_is_503_even_with_everything_cached(client, engine, assert_error):
    c, _ = await client(max_age=LONG)
    async with c:
        for route in READ_ROUTES:
            assert (await c.get(f"/plugins/my_pkg/{route}")).status_code == 200
        calls = len(engine.calls)
        engine.errored = True
        for route in READ_ROUTES:
            assert_error(await c.get(f"/plugins/my_pkg/{route}"), 503, "engine_dead")
    assert len(engine.calls) == calls


async def test_when_the_workers_change_their_identity_and_config_are_fetched_again(client, engine):
    c, _ = await client(max_age=0)
    async with c:
        assert [w["pid"] for w in (await c.get("/plugins/my_pkg/workers")).json()["workers"]] == [1000, 1001]
        assert (await c.get("/plugins/my_pkg/config/parallel")).status_code == 200
        engine.pids[1] = 2001  # e.g. an engine scaled or restarted behind the same API server
        workers = (await c.get("/plugins/my_pkg/workers")).json()["workers"]
        health = (await c.get("/plugins/my_pkg/health")).json()["workers"]
        assert (await c.get("/plugins/my_pkg/config/parallel")).status_code == 200
    assert [w["pid"] for w in workers] == [1000, 2001] and [w["pid"] for w in health] == [1000, 2001]
    assert engine.methods.count("my_pkg_worker_info") == 2 and engine.methods.count("my_pkg_config") == 2


async def test_a_late_identity_reply_is_kept(monkeypatch, client, engine, assert_error):
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "0.1")
    c, handler = await client(max_age=LONG)
    engine.delays["my_pkg_config"] = 0.3
    async with c:
        assert_error(await c.get("/plugins/my_pkg/config/model"), 504, "timeout_error")
        await asyncio.sleep(0.4)
        assert (await c.get("/plugins/my_pkg/config/model")).status_code == 200
    assert [m for m in engine.methods if m != "my_pkg_status"] == ["my_pkg_config"]


@pytest.mark.parametrize(("raw", "expected"), [("0", 0.0), (" 2.5 ", 2.5), ("", DEFAULT_STATUS_MAX_AGE)])
def test_status_max_age_from_env(raw, expected, monkeypatch):
    monkeypatch.setenv("MY_PKG_STATUS_MAX_AGE", raw)
    assert status_max_age_from_env() == expected


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "inf"])
def test_an_invalid_status_max_age_keeps_the_default_with_a_warning(raw, monkeypatch, plugin_log):
    monkeypatch.setenv("MY_PKG_STATUS_MAX_AGE", raw)
    assert status_max_age_from_env() == DEFAULT_STATUS_MAX_AGE
    assert any("MY_PKG_STATUS_MAX_AGE" in m for m in plugin_log.messages(logging.WARNING))
