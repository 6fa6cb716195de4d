"""A stalled worker: bounded waits in the API server only, single-flight, updates all-or-none.

The fake engine answers late (``delay``) the way a paused worker does. The
real-server version of these cases is ``tests/e2e/test_faults.py``.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.anyio

TOKEN = "s3cret"
FLASHHEAD = "/plugins/my_pkg/flashhead"


@pytest.fixture
async def stalled(monkeypatch, engine, make_app, client_for):
    """A client of an app that waits 0.1 s for workers that take 0.4 s; every read asks the workers
    (no status snapshot is reused), so only single-flight keeps the calls down."""
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "0.1")
    monkeypatch.setenv("MY_PKG_STATUS_MAX_AGE", "0")
    app = await make_app(engine)
    engine.delay = 0.4
    async with client_for(app, token=TOKEN) as c:
        yield c, app.state.my_pkg_admin


async def _settle(handler) -> None:
    """Wait until every engine-side call has ended (the stall is over)."""
    for _ in range(100):
        if not len(handler.in_flight):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("engine-side calls still running")


async def test_identical_reads_share_one_engine_call_while_a_worker_stalls(stalled, engine, assert_error):
    c, handler = stalled
    replies = await asyncio.gather(*[c.get("/plugins/my_pkg/workers") for _ in range(5)])
    for reply in replies:
        assert_error(reply, 504, "timeout_error")
    assert engine.methods == ["my_pkg_status"]  # one RPC, not five
    # Another read that is still waiting joins the same call instead of sending a new one.
    assert_error(await c.get("/plugins/my_pkg/workers"), 504, "timeout_error")
    assert engine.methods == ["my_pkg_status"]
    await _settle(handler)
    engine.delay = 0.0
    assert (await c.get("/plugins/my_pkg/workers")).status_code == 200
    assert engine.methods == ["my_pkg_status", "my_pkg_status", "my_pkg_worker_info"]


async def test_different_reads_are_not_coalesced(stalled, engine):
    c, handler = stalled
    await asyncio.gather(c.get("/plugins/my_pkg/config/model"), c.get("/plugins/my_pkg/config/cache"))
    assert sorted(call["args"] for call in engine.calls) == [("cache",), ("model",)]
    await _settle(handler)


async def test_a_late_reply_is_dropped_and_the_next_call_gets_its_own(stalled, engine, assert_error):
    c, handler = stalled
    assert_error(await c.get(FLASHHEAD), 504, "timeout_error")
    await _settle(handler)
    engine.delay = 0.0
    r = await c.get("/plugins/my_pkg/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


async def test_an_update_whose_wait_expires_is_still_applied_on_every_worker(stalled, engine, assert_error):
    c, handler = stalled
    err = assert_error(await c.put(FLASHHEAD, json={"n_probes": 3}), 504, "timeout_error")
    assert "outcome is not known" in err["note"] and err["transaction"]
    # A second update while the first is unanswered is refused, not queued behind it.
    busy = assert_error(await c.put(FLASHHEAD, json={"n_probes": 5}), 409, "update_in_progress")
    assert busy["update"] == {"n_probes": 5} and "settings_version" in busy  # as last seen (none yet here)
    await _settle(handler)
    assert engine.methods[:2] == ["my_pkg_flashhead_prepare", "my_pkg_flashhead_commit"]
    assert [fh["n_probes"] for fh in engine.fh] == [3, 3]
    engine.delay = 0.0
    mutations = (await c.get("/plugins/my_pkg/audit")).json()["mutations"]
    # One entry for the transaction: what the engines kept, with the 504 its caller got folded in.
    [entry] = [m for m in mutations if m.get("transaction") == err["transaction"]]
    assert (entry["result"], entry["answered_status_code"], entry["kept_by"]) == ("applied", 504, [0])
    r = await c.put(FLASHHEAD, json={"n_probes": 5})
    assert r.status_code == 200, r.text
    assert [fh["n_probes"] for fh in engine.fh] == [5, 5]


async def test_an_update_rejected_after_its_wait_expired_changes_nothing(stalled, engine, assert_error):
    c, handler = stalled
    assert_error(await c.put(FLASHHEAD, json={"n_probes": 999}), 504, "timeout_error")
    await _settle(handler)
    assert "my_pkg_flashhead_commit" not in engine.methods
    assert [fh["n_probes"] for fh in engine.fh] == [4, 4]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/plugins/my_pkg/health"), ("GET", FLASHHEAD), ("GET", "/plugins/my_pkg/metrics"), ("PUT", FLASHHEAD)],
)
async def test_a_dead_engine_answers_503_at_once_without_an_rpc(stalled, engine, assert_error, method, path):
    c, _ = stalled
    engine.errored = True
    assert_error(await c.request(method, path, json={"n_probes": 2} if method == "PUT" else None), 503, "engine_dead")
    assert engine.calls == []


async def test_an_update_that_ends_in_the_tick_its_wait_expires_answers_its_result(
    monkeypatch, engine, make_app, client_for
):
    """The wait race: the task is done when the wait's timeout fires; its result is the answer, not 503."""
    from types import SimpleNamespace

    from my_pkg.endpoints import client as client_mod

    async def expires_as_the_task_ends(awaitable, timeout):
        await awaitable  # the task ends...
        raise asyncio.TimeoutError  # ...and the timeout fires in the same tick

    monkeypatch.setattr(
        client_mod,
        "asyncio",
        SimpleNamespace(
            wait_for=expires_as_the_task_ends,
            shield=asyncio.shield,
            TimeoutError=asyncio.TimeoutError,
            ensure_future=asyncio.ensure_future,
            Task=asyncio.Task,
            Future=asyncio.Future,
            AbstractEventLoop=asyncio.AbstractEventLoop,
            get_running_loop=asyncio.get_running_loop,
            CancelledError=asyncio.CancelledError,
            sleep=asyncio.sleep,
        ),
    )
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    app = await make_app(engine)
    async with client_for(app, token=TOKEN) as c:
        r = await c.put(FLASHHEAD, json={"n_probes": 3})
    assert r.status_code == 200, r.text
    assert [fh["n_probes"] for fh in engine.fh] == [3, 3]
