"""Updates under faults, over several engines and API servers: the cases of the second admin review (r1-r7).

Every case runs the real worker methods on the fakes (`FakeEngines`: engines shared by API servers, a lease
clock the test moves, injected worker errors, calls held at a chosen engine).
"""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest

from my_pkg import contract

pytestmark = pytest.mark.anyio

ADMIN = "admin-token-admin-token-admin-token-0123"
URL = "/plugins/my_pkg/flashhead"
AUDIT = "/plugins/my_pkg/audit"
LEASE_S = 30.0  # MY_PKG_RPC_TIMEOUT=1 here: the lease is max(30 s, 3 x 1 s x engines)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_STATUS_MAX_AGE", "0")  # every read asks the engines
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "1")


@pytest.fixture
async def two_api_servers(fake_engines_cls, make_app, client_for):
    """Two engines of two workers each, two API servers over them: (engines, views, clients)."""
    engines = fake_engines_cls(engines=2, world_size=2)
    views = [engines.view(), engines.view()]
    apps = [await make_app(view) for view in views]
    for view, app in zip(views, apps):
        view.admin_state = app.state.my_pkg_admin  # the API server's own state, for tests that reach into it
    async with client_for(apps[0], token=ADMIN) as c0, client_for(apps[1], token=ADMIN) as c1:
        yield engines, views, (c0, c1)


async def _until(condition, what: str) -> None:
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def _probes(engines) -> list[int]:
    return [settings[1] for _, _, _, settings in engines.held()]


def _versions(engines) -> list[int]:
    return [version for _, _, version, _ in engines.held()]


async def test_r1_a_failed_commit_releases_every_lease_and_the_retry_converges(two_api_servers, assert_error):
    engines, _, (c0, c1) = two_api_servers
    engines.faults[(contract.FLASHHEAD_COMMIT, 1)] = (RuntimeError("dp1 worker: out of memory in apply"), "before")
    err = assert_error(await c0.put(URL, json={"n_probes": 8}), 503, "worker_error")
    assert err["committed_engines"] == [0] and err["consistent"] is False and "committed_engines" in err["note"]
    assert [(h["dp_rank"], h["settings_version"], h["settings"]["n_probes"]) for h in err["engine_settings"]] == [
        (0, 1, 8),
        (0, 1, 8),
        (1, 0, 4),
        (1, 0, 4),
    ]
    assert _probes(engines) == [8, 8, 4, 4]
    status = (await c1.get(URL)).json()
    assert status["consistent"] is False and status["settings_version"] == 1
    # the failed engine's lease was released: the retry succeeds at once, from either API server
    retry = await c0.put(URL, json={"n_probes": 8})
    assert retry.status_code == 200, retry.text
    assert retry.json()["settings_version"] == 2 and _versions(engines) == [2, 2, 2, 2]
    assert _probes(engines) == [8, 8, 8, 8]
    repaired = next(
        m for m in (await c1.get(AUDIT)).json()["mutations"] if m["transaction"] == retry.json()["transaction"]
    )
    assert [(b["dp_rank"], b["n_probes"]) for b in repaired["before"]] == [(0, 8), (1, 4)]  # each engine's own
    status = await c1.get(URL)
    assert status.json()["consistent"] is True and status.headers["ETag"] == retry.headers["ETag"]
    # the answering API server's audit folds its outcome into the engines' entry of the transaction
    mutations = (await c0.get(AUDIT)).json()["mutations"]
    failed = next(m for m in mutations if m["transaction"] == err["transaction"])
    assert failed["result"] == "partial" and failed["kept_by"] == [0] and failed["committed_engines"] == [0]
    assert [o["outcome"] for o in failed["outcomes"]] == ["committed", "failed"]


async def test_r1_an_update_of_another_field_repairs_a_divergence(two_api_servers, assert_error):
    """Whole settings, not patches: the next update gives every engine the same settings, not only the same
    version."""
    engines, _, (c0, c1) = two_api_servers
    engines.faults[(contract.FLASHHEAD_COMMIT, 1)] = (RuntimeError("dp1 broke"), "before")
    assert_error(await c0.put(URL, json={"n_probes": 8}), 503, "worker_error")
    answer = await c1.put(URL, json={"enabled": False})
    assert answer.status_code == 200 and answer.json()["settings"] == {
        "enabled": False,
        "n_probes": 8,
        "dense_batch_threshold": 32,
    }
    assert {settings for _, _, _, settings in engines.held()} == {(False, 8, 32)}
    assert set(_versions(engines)) == {2}


async def test_r1_if_match_with_the_etag_gets_through_a_divergence(two_api_servers, assert_error):
    """Review 2 #3: with versions 1 and 0 on the two engines, the ETag of GET /flashhead still matches."""
    engines, _, (c0, c1) = two_api_servers
    engines.faults[(contract.FLASHHEAD_COMMIT, 1)] = (RuntimeError("dp1 broke"), "before")
    assert_error(await c0.put(URL, json={"n_probes": 8}), 503, "worker_error")
    etag = (await c1.get(URL)).headers["ETag"]
    assert_error(await c1.put(URL, json={"enabled": False}, headers={"If-Match": '"1"'}), 409, "version_conflict")
    answer = await c1.put(URL, json={"enabled": False}, headers={"If-Match": etag})
    assert answer.status_code == 200, answer.text
    assert set(_versions(engines)) == {2}


async def test_r2_a_commit_after_its_lease_was_taken_committed_and_released_is_refused(two_api_servers, assert_error):
    engines, views, (a, b) = two_api_servers
    gate = asyncio.Event()
    views[0].hold[(contract.FLASHHEAD_COMMIT, 0)] = gate
    etag = (await a.get(URL)).headers["ETag"]
    put_a = asyncio.create_task(a.put(URL, json={"n_probes": 8}, headers={"If-Match": etag}))
    await _until(lambda: views[0].waiting, "A prepared both engines")
    engines.clock[0] += LEASE_S + 1  # A stalls past its lease
    rb = await b.put(URL, json={"n_probes": 5}, headers={"If-Match": etag})
    assert rb.status_code == 200 and rb.json()["settings_version"] == 1
    gate.set()
    err = assert_error(await put_a, 503, "worker_error")
    assert err["committed_engines"] == [] and "does not hold" in err["message"]
    assert _probes(engines) == [5, 5, 5, 5] and _versions(engines) == [1, 1, 1, 1]  # B's update is not lost
    applied = [m for m in (await b.get(AUDIT)).json()["mutations"] if m["result"] == "applied"]
    assert [(m["update"], m["settings_version"], m["kept_by"]) for m in applied] == [({"n_probes": 5}, 1, [0, 1])]


async def test_r3_a_lease_lapsing_between_two_commits_ends_equal_after_the_taker_commits(two_api_servers, assert_error):
    engines, views, (a, b) = two_api_servers
    a_gate, b_gate = asyncio.Event(), asyncio.Event()
    views[0].hold[(contract.FLASHHEAD_COMMIT, 1)] = a_gate
    views[1].hold[(contract.FLASHHEAD_COMMIT, 0)] = b_gate
    put_a = asyncio.create_task(a.put(URL, json={"n_probes": 8}))
    await _until(lambda: views[0].waiting, "A committed dp 0")
    assert _probes(engines) == [8, 8, 4, 4]
    engines.clock[0] += LEASE_S + 1  # A's lease on dp 1 lapses
    put_b = asyncio.create_task(b.put(URL, json={"enabled": False}))
    await _until(lambda: views[1].waiting, "B prepared dp 0 and dp 1")
    a_gate.set()
    err = assert_error(await put_a, 503, "worker_error")
    assert err["committed_engines"] == [0]
    b_gate.set()
    rb = await put_b
    assert rb.status_code == 200 and rb.json()["settings_version"] == 2
    # B committed the whole settings (dp 0's, the highest version, with its update): every engine equal
    assert {settings for _, _, _, settings in engines.held()} == {(False, 8, 32)}
    assert set(_versions(engines)) == {2}
    assert (await a.get(URL)).json()["consistent"] is True


async def test_r4_unauthenticated_callers_cannot_evict_refusals(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_AUDIT_SIZE", "8")
    app = await make_app(engine, api_key=["inference-key"])
    async with client_for(app, token=ADMIN) as admin, client_for(app, token="inference-key") as inference:
        assert (await inference.put(URL, json={"n_probes": 2})).status_code == 403
        for _ in range(40):
            async with client_for(app, token=secrets.token_hex(8)) as attacker:
                assert (await attacker.put(URL, json={"n_probes": 2})).status_code == 401
        refusals = (await admin.get(AUDIT)).json()["refusals"]
    assert [(r["status_code"], r.get("token_source"), r["count"]) for r in refusals] == [
        (403, "--api-key", 1),
        (401, None, 40),
    ]
    assert refusals[1]["token_fingerprint"] is None


async def test_r4_rejections_never_evict_the_applied_history(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_AUDIT_SIZE", "8")
    app = await make_app(engine)
    async with client_for(app, token=ADMIN) as admin:
        assert (await admin.put(URL, json={"n_probes": 6})).status_code == 200
        for _ in range(20):
            assert (await admin.put(URL, json={"n_probes": 999})).status_code == 409
        mutations = (await admin.get(AUDIT)).json()["mutations"]
    assert [(m["result"], m["count"]) for m in mutations] == [("applied", 1), ("rejected", 20)]


async def test_r4_every_outcome_is_one_json_line_on_the_audit_logger(two_api_servers, plugin_log, assert_error):
    engines, _, (c0, c1) = two_api_servers
    assert (await c0.put(URL, json={"n_probes": 6})).status_code == 200
    assert (await c1.put(URL, json={"n_probes": 999})).status_code == 409
    engines.faults[(contract.FLASHHEAD_COMMIT, 1)] = (RuntimeError("dp1 broke"), "before")
    assert_error(await c0.put(URL, json={"n_probes": 7}), 503)
    lines = [
        json.loads(r.getMessage())
        for r in plugin_log.records
        if r.name == "vllm.my_pkg.endpoints.audit" and r.getMessage().startswith("{")
    ]
    assert [(line["result"], [o["outcome"] for o in line["outcomes"]]) for line in lines] == [
        ("applied", ["committed", "committed"]),
        ("rejected", ["aborted", "aborted"]),
        ("partial", ["committed", "failed"]),
    ]
    assert all(line["transaction"] and line["role"] == "admin" for line in lines)
    assert lines[0]["settings_version"] == 1 and lines[2]["committed_engines"] == [0]


async def test_r4_a_restarted_engine_shows_as_inconsistent_and_the_next_update_repairs_it(two_api_servers):
    engines, _, (c0, c1) = two_api_servers
    assert (await c0.put(URL, json={"n_probes": 6})).status_code == 200
    before = await c1.get(URL)
    engines.restart(1)  # a new process: defaults, version 0
    after = await c1.get(URL)
    assert after.json()["consistent"] is False and after.headers["ETag"] != before.headers["ETag"]
    answer = await c1.put(URL, json={"dense_batch_threshold": 16})
    assert answer.status_code == 200 and answer.json()["settings_version"] == 2
    assert {settings for _, _, _, settings in engines.held()} == {(True, 6, 16)}
    assert (await c0.get(URL)).json()["consistent"] is True


async def test_r5_health_answers_behind_root_path_without_a_token(monkeypatch, engine, make_app, client_for):
    monkeypatch.delenv("MY_PKG_ADMIN_TOKEN")
    app = await make_app(engine, root_path="/api")
    async with client_for(app, root_path="/api") as anonymous:
        for path in ("/api/plugins/my_pkg/health", "/plugins/my_pkg/health"):
            assert (await anonymous.get(path)).status_code == 200, path
        assert (await anonymous.get("/api/plugins/my_pkg/workers")).status_code == 403


async def test_r7_what_reaches_collective_rpc_cannot_commit_without_a_lease_or_wedge_updates(
    engine, make_app, client_for, assert_error
):
    app = await make_app(engine)
    forged = {"request_id": "change-41", "role": "admin", "token_source": "MY_PKG_ADMIN_TOKEN"}
    with pytest.raises(Exception, match="does not hold"):
        await engine.collective_rpc(
            contract.FLASHHEAD_COMMIT,
            args=({"n_probes": 1}, {"id": "no-lease", "holder": "x", "lease_s": 1, "new_version": 10**12}, forged),
        )
    with pytest.raises(Exception, match="lease_s"):
        await engine.collective_rpc(
            contract.FLASHHEAD_PREPARE, args=({"enabled": True}, {"id": "wedge", "holder": "ops", "lease_s": 1e12})
        )
    assert [fh["n_probes"] for fh in engine.fh] == [4, 4]
    async with client_for(app, token=ADMIN) as admin:
        assert (await admin.put(URL, json={"n_probes": 5})).status_code == 200
        mutations = (await admin.get(AUDIT)).json()["mutations"]
    assert [(m["result"], m["settings_version"]) for m in mutations] == [("applied", 1)]


async def test_the_lease_and_the_wait_grow_with_the_engines(fake_engines_cls, make_app):
    from my_pkg.endpoints.updates import lease_seconds, update_wait_s

    for count, wait, lease in ((1, 1.0, 30.0), (4, 4.0, 30.0), (16, 16.0, 48.0), (512, 512.0, 600.0)):
        state = (await make_app(fake_engines_cls(engines=count, world_size=1).view())).state.my_pkg_admin
        assert (update_wait_s(state), lease_seconds(state)) == (wait, lease)


async def test_preparing_past_half_the_lease_commits_nothing(two_api_servers, monkeypatch, assert_error):
    from my_pkg.endpoints import updates

    engines, _, (c0, _) = two_api_servers
    readings = iter([0.0])  # the start; every later reading is past half the lease
    monkeypatch.setattr(updates, "clock", lambda: next(readings, 10_000.0))
    err = assert_error(await c0.put(URL, json={"n_probes": 8}), 503, "update_deadline")
    assert err["transaction"] and _probes(engines) == [4, 4, 4, 4]
    monkeypatch.setattr(updates, "clock", lambda: 0.0)
    answer = await c0.put(URL, json={"n_probes": 8})
    assert answer.status_code == 200, answer.text  # nothing left leased


async def test_a_refusal_says_what_every_engine_asked_holds(two_api_servers, assert_error):
    engines, _, (c0, _) = two_api_servers
    engines.engines[1].fh[0]["num_clusters"] = 4  # dp 1 refuses n_probes 7
    err = assert_error(await c0.put(URL, json={"n_probes": 7}), 409, "invalid_update")
    assert [(h["dp_rank"], h["settings_version"], h["settings"]["n_probes"]) for h in err["engine_settings"]] == [
        (0, 0, 4),
        (0, 0, 4),
        (1, 0, 4),
        (1, 0, 4),
    ]
    assert err["transaction"] and _probes(engines) == [4, 4, 4, 4]
    assert (await c0.put(URL, json={"n_probes": 3})).status_code == 200  # nothing left leased


async def test_a_restarted_engine_is_brought_to_the_settings_in_force_once_a_read_sees_it(two_api_servers, plugin_log):
    engines, _, (c0, c1) = two_api_servers
    assert (await c0.put(URL, json={"n_probes": 6, "enabled": False})).status_code == 200
    assert (await c1.get(URL)).json()["consistent"] is True
    engines.restart(1, new_pids=True)  # a new engine process: defaults, version 0, other pids
    seen = (await c1.get(URL)).json()
    assert seen["consistent"] is False  # what the read found; the catch-up starts in the background
    await _until(lambda: set(_versions(engines)) == {2}, "the catch-up committed")
    assert {settings for _, _, _, settings in engines.held()} == {(False, 6, 32)}
    assert (await c0.get(URL)).json()["consistent"] is True
    lines = [json.loads(r.getMessage()) for r in plugin_log.records if r.getMessage().startswith('{"api_server"')]
    assert [(line["result"], line["role"]) for line in lines][-1] == ("applied", "system")


async def test_a_catch_up_on_a_stale_snapshot_changes_nothing(two_api_servers):
    from my_pkg.endpoints.updates import catch_up

    engines, views, (c0, c1) = two_api_servers
    assert (await c0.put(URL, json={"n_probes": 6})).status_code == 200
    engines.restart(1)
    state = views[1].admin_state
    stale = await state.status()
    assert (await c0.put(URL, json={"n_probes": 9})).status_code == 200  # the engines moved on since
    catch_up(state, stale)
    await _until(lambda: not len(state.in_flight), "the catch-up ended")
    assert set(_probes(engines)) == {9} and set(_versions(engines)) == {2}  # refused: If-Match of the stale state
