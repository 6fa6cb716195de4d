"""PUT /plugins/my_pkg/flashhead: body validation, all-or-none application."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio

URL = "/plugins/my_pkg/flashhead"


def _state(engine):
    return [(fh["enabled"], fh["n_probes"], fh["dense_batch_threshold"]) for fh in engine.fh]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"n_probes": 0}, "n_probes"),
        ({"n_probes": -3}, "n_probes"),
        ({"n_probes": "4"}, "n_probes"),
        ({"n_probes": 2.5}, "n_probes"),
        ({"n_probes": True}, "n_probes"),
        ({"dense_batch_threshold": -1}, "dense_batch_threshold"),
        ({"enabled": "yes"}, "enabled"),
        ({"enabled": 1}, "enabled"),
        ({"n_probes": 4, "bogus": 1}, "bogus"),
        ({}, None),
        ({"enabled": None}, None),
        ([], None),
        ("n_probes=4", None),
    ],
)
async def test_invalid_body_is_422_and_nothing_called(body, field, app_client, engine, assert_error):
    before = _state(engine)
    err = assert_error(await app_client.put(URL, json=body), 422, "invalid_request_error")
    assert isinstance(err["errors"], list) and err["errors"]
    if field is not None:
        assert any(field in e["loc"] for e in err["errors"]), err
        assert field in err["message"]
    assert engine.calls == []
    assert _state(engine) == before


@pytest.mark.parametrize("content", [b"", b"{not json", b"null", b"\xb3S\xc7"])
async def test_missing_or_broken_body_is_422(content, app_client, engine, assert_error):
    r = await app_client.put(URL, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 422, "invalid_request_error")
    assert engine.calls == []


async def test_broken_json_message(app_client, assert_error):
    r = await app_client.put(URL, content=b"{oops", headers={"Content-Type": "application/json"})
    assert "not valid JSON" in assert_error(r, 422)["message"]


async def test_wrong_method_lists_every_method_of_the_path(app_client, assert_error):
    r = await app_client.request("OPTIONS", URL)
    err = assert_error(r, 405, "method_not_allowed")
    assert r.headers["Allow"] == "GET, PUT"
    assert "GET, PUT" in err["message"]
    r = await app_client.delete("/plugins/my_pkg/health")
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["Allow"] == "GET"


async def test_empty_body_message_says_at_least_one_field(app_client, assert_error):
    err = assert_error(await app_client.put(URL, json={}), 422)
    assert "at least one" in err["message"]


async def test_valid_update_applied_on_all_workers(app_client, engine):
    r = await app_client.put(URL, json={"n_probes": 8, "enabled": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["applied"] == {"n_probes": 8, "enabled": False}
    assert body["num_workers"] == 2 and body["settings_version"] == 1 and body["engines"] == [0]
    assert body["other_nodes_untouched"] is False
    assert [w["n_probes"] for w in body["workers"]] == [8, 8]
    assert [w["enabled"] for w in body["workers"]] == [False, False]
    assert [w["settings_version"] for w in body["workers"]] == [1, 1]
    # then the background refresh of the snapshot for vLLM's /metrics
    assert engine.methods[:3] == ["my_pkg_flashhead_prepare", "my_pkg_flashhead_commit", "my_pkg_status"]
    # the prepare gets the given fields; the commit the whole settings (the update over those in force), the
    # transaction and the caller for the audit (the worker writes the outcome, time and version itself)
    assert engine.calls[0]["args"][0] == {"n_probes": 8, "enabled": False}
    assert engine.calls[1]["args"][0] == {"n_probes": 8, "enabled": False, "dense_batch_threshold": 32}
    assert body["settings"] == {"n_probes": 8, "enabled": False, "dense_batch_threshold": 32}
    assert engine.calls[0]["args"][1]["id"] == engine.calls[1]["args"][1]["id"] == body["transaction"]
    assert engine.calls[1]["args"][1]["new_version"] == 1 and engine.calls[1]["args"][2]["role"] == "admin"
    assert "result" not in engine.calls[1]["args"][2]
    assert _state(engine) == [(False, 8, 32), (False, 8, 32)]
    status = await app_client.get(URL)
    assert status.json()["settings_version"] == 1 and status.json()["consistent"] is True
    assert status.headers["ETag"] == status.json()["etag"] == body["etag"] == r.headers["ETag"]
    assert status.headers["ETag"].startswith('"1.')
    assert [(h["settings_version"], h["settings"]["n_probes"]) for h in status.json()["engine_settings"]] == [
        (1, 8),
        (1, 8),
    ]


async def test_threshold_zero_is_valid(app_client, engine):
    r = await app_client.put(URL, json={"dense_batch_threshold": 0})
    assert r.status_code == 200
    assert _state(engine) == [(True, 4, 0), (True, 4, 0)]


@pytest.mark.parametrize("field", ["n_probes", "dense_batch_threshold", "draft_n_probes"])
@pytest.mark.parametrize("value", [2**31, 2**64, 2**64 + 1, 1e300])
async def test_integers_beyond_the_bound_are_422_not_503(field, value, app_client, engine, assert_error):
    err = assert_error(await app_client.put(URL, json={field: value}), 422, "invalid_request_error")
    assert "2147483647" in err["message"] and "2147483647" in err["hint"]
    assert engine.calls == []


async def test_the_largest_integer_reaches_the_workers(app_client, engine, assert_error):
    err = assert_error(await app_client.put(URL, json={"n_probes": 2**31 - 1}), 409, "invalid_update")
    assert "exceeds num_clusters" in err["errors"][0]["errors"][0]


async def test_worker_side_rejection_on_one_rank_applies_nothing(app_client, engine, assert_error):
    engine.fh[1]["num_clusters"] = 6  # rank 0 accepts 8, rank 1 does not
    before = _state(engine)
    err = assert_error(await app_client.put(URL, json={"n_probes": 8}), 409, "invalid_update")
    assert err["errors"] == [{"dp_rank": 0, "rank": 1, "errors": ["n_probes=8 exceeds num_clusters=6"]}]
    assert err["update"] == {"n_probes": 8} and err["settings_version"] == 0
    assert "nothing was applied" in err["message"]
    assert "my_pkg_flashhead_commit" not in engine.methods
    assert engine.methods[:2] == ["my_pkg_flashhead_prepare", "my_pkg_flashhead_abort"]  # rank 0's lease released
    assert _state(engine) == before
    assert (await app_client.put(URL, json={"n_probes": 5})).status_code == 200  # nothing left held


async def test_flashhead_unavailable_is_409(app_client, engine, assert_error):
    for fh in engine.fh:
        fh["available"] = False
    err = assert_error(await app_client.put(URL, json={"enabled": True}), 409, "flashhead_unavailable")
    assert [e["rank"] for e in err["errors"]] == [0, 1]
    assert "my_pkg_flashhead_commit" not in engine.methods


async def test_if_match_applies_only_on_that_version(app_client, engine, assert_error):
    assert (await app_client.put(URL, json={"n_probes": 5}, headers={"If-Match": '"0"'})).status_code == 200
    err = assert_error(
        await app_client.put(URL, json={"n_probes": 6}, headers={"If-Match": '"0"'}), 409, "version_conflict"
    )
    assert err["settings_version"] == 1 and err["etag"].startswith('"1.') and len(err["engine_settings"]) == 2
    assert _state(engine) == [(True, 5, 32), (True, 5, 32)]
    assert (await app_client.put(URL, json={"n_probes": 6}, headers={"If-Match": "1"})).status_code == 200
    assert_error(await app_client.put(URL, json={"n_probes": 7}, headers={"If-Match": "soon"}), 422)


async def test_if_match_with_the_etag_compares_every_engines_settings(app_client, engine, assert_error):
    etag = (await app_client.get(URL)).headers["ETag"]
    assert (await app_client.put(URL, json={"n_probes": 5}, headers={"If-Match": etag})).status_code == 200
    assert_error(await app_client.put(URL, json={"n_probes": 6}, headers={"If-Match": etag}), 409, "version_conflict")
    etag = (await app_client.get(URL)).headers["ETag"]
    # Same version, other settings on one worker (what a restarted worker would show): another ETag.
    engine.fh[1]["n_probes"] = 9
    err = assert_error(
        await app_client.put(URL, json={"enabled": False}, headers={"If-Match": etag}), 409, "version_conflict"
    )
    assert err["etag"] != etag and [h["settings"]["n_probes"] for h in err["engine_settings"]] == [5, 9]
    assert_error(await app_client.put(URL, json={"enabled": False}, headers={"If-Match": "1"}), 409, "version_conflict")
    assert [fh["enabled"] for fh in engine.fh] == [True, True]  # nothing applied, every lease released
    assert (await app_client.put(URL, json={"enabled": False})).status_code == 200
    assert _state(engine) == [(False, 5, 32), (False, 5, 32)]  # whole settings: worker 1 is back in line


async def test_an_update_held_by_another_api_server_is_409_with_the_holder(app_client, engine, assert_error):
    """Another API server (another process) prepared the engine and has not committed yet."""
    from my_pkg.contract import Transaction
    from my_pkg.engine.admin_ledger import ledger_of

    for worker in engine.workers:
        ledger_of(worker).take(Transaction(id="other", holder="host:42/api1", lease_s=60))
    err = assert_error(await app_client.put(URL, json={"n_probes": 8}), 409, "update_in_progress")
    assert err["holder"] == "host:42/api1"
    assert _state(engine) == [(True, 4, 32), (True, 4, 32)]


async def test_a_lapsed_lease_does_not_wedge_updates(app_client, engine):
    """An API server that crashed between prepare and commit: its lease lapses."""
    from my_pkg.contract import Transaction
    from my_pkg.engine.admin_ledger import ledger_of

    for worker in engine.workers:
        ledger_of(worker).take(Transaction(id="crashed", holder="gone:1/api1", lease_s=0.001))
    import asyncio

    await asyncio.sleep(0.01)
    assert (await app_client.put(URL, json={"n_probes": 8})).status_code == 200


async def test_validate_failure_applies_nothing(app_client, engine, assert_error):
    engine.errors["my_pkg_flashhead_prepare"] = RuntimeError("rank 1 died")
    assert_error(await app_client.put(URL, json={"n_probes": 4}), 503, "worker_error")
    assert "my_pkg_flashhead_commit" not in engine.methods


async def test_validate_reply_malformed_applies_nothing(app_client, engine, assert_error):
    engine.overrides["my_pkg_flashhead_prepare"] = [{"rank": 0, "granted": True, "version": 0}, "junk"]
    assert_error(await app_client.put(URL, json={"n_probes": 4}), 503, "unexpected_reply")
    assert "my_pkg_flashhead_commit" not in engine.methods


async def test_apply_failure_is_503_with_note(app_client, engine, assert_error):
    engine.errors["my_pkg_flashhead_commit"] = RuntimeError("apply broke")
    err = assert_error(await app_client.put(URL, json={"n_probes": 6}), 503, "worker_error")
    assert "apply broke" in err["message"]  # the admin role sees the worker's text
    assert "nothing was applied" in err["note"] and err["committed_engines"] == []
    assert err["transaction"] and err["consistent"] is True
    assert [h["settings"]["n_probes"] for h in err["engine_settings"]] == [4, 4]
    del engine.errors["my_pkg_flashhead_commit"]
    # every lease was released: a retry succeeds at once
    assert (await app_client.put(URL, json={"n_probes": 6})).status_code == 200


async def test_engine_half_missing_on_put(app_client, engine, assert_error):
    engine.missing.add("my_pkg_flashhead_prepare")
    err = assert_error(await app_client.put(URL, json={"n_probes": 4}), 503, "engine_plugin_missing")
    assert "my_pkg_engine" in err["hint"]
    assert "my_pkg_flashhead_commit" not in engine.methods


def test_the_422_hint_is_generated_from_the_update_schema():
    from my_pkg.contract import UPDATE_FIELDS, FlashHeadUpdate
    from my_pkg.endpoints.errors import UPDATE_HINT, _update_hint

    assert UPDATE_HINT == _update_hint()
    for name in UPDATE_FIELDS:
        assert f"'{name}' (" in UPDATE_HINT
    bounds = FlashHeadUpdate.model_json_schema()["properties"]["n_probes"]
    assert f"'n_probes' (int, {bounds['minimum']} to {bounds['maximum']})" in UPDATE_HINT
    assert "'dense_batch_threshold' (int, 0 to" in UPDATE_HINT and "or null)" in UPDATE_HINT
    assert "'enabled' (bool)" in UPDATE_HINT and "or null" not in UPDATE_HINT.split("'n_probes'")[0]
