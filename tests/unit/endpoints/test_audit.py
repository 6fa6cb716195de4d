"""The audit: mutations kept by the engines (the same from every API server), refusals collapsed with a
count, failed authentication counted and logged rate-limited, tokens only as per-process HMACs."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from prometheus_client import REGISTRY

from my_pkg.endpoints.audit import fingerprint

pytestmark = pytest.mark.anyio

ADMIN, READER = "admin-secret-admin-secret-admin-secret", "read-secret"
URL = "/plugins/my_pkg/flashhead"
AUDIT = "/plugins/my_pkg/audit"


@pytest.fixture
async def app(monkeypatch, engine, make_app):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_READ_TOKEN", READER)
    return await make_app(engine, api_key=["inference-key"])


def _failures(reason: str) -> float:
    return REGISTRY.get_sample_value("my_pkg_admin_auth_failures_total", {"reason": reason}) or 0.0


async def test_mutations_and_refusals_are_recorded_apart_and_logged(app, client_for, engine, plugin_log):
    async with client_for(app, token=ADMIN) as admin, client_for(app, token=READER) as reader:
        applied = await admin.put(URL, json={"n_probes": 6}, headers={"X-Request-Id": "change-42"})
        assert applied.status_code == 200 and applied.headers["X-Request-Id"] == "change-42"
        assert (await reader.put(URL, json={"n_probes": 2})).status_code == 403
        assert (await admin.put(URL, json={"n_probes": 999})).status_code == 409  # a worker refuses
        assert (await admin.put(URL, json={"n_probes": 0})).status_code == 422  # invalid body
        body = (await admin.get(AUDIT)).json()
    mutations, refusals = body["mutations"], body["refusals"]
    assert [(e["status_code"], e["result"]) for e in mutations] == [(200, "applied"), (409, "rejected")]
    assert [(e["status_code"], e["result"]) for e in refusals] == [(403, "refused"), (422, "refused")]
    first = mutations[0]
    assert first["request_id"] == "change-42" and first["role"] == "admin"
    assert first["token_source"] == "MY_PKG_ADMIN_TOKEN" and first["token_fingerprint"] == fingerprint(ADMIN)
    assert first["update"] == {"n_probes": 6} and first["settings_version"] == 1 and first["engines"] == [0]
    assert first["api_server"] == body["api_server"] and first["transaction"]
    assert first["settings"] == {"enabled": True, "n_probes": 6, "dense_batch_threshold": 32}
    assert [(b["dp_rank"], b["rank"], b["n_probes"]) for b in first["before"]] == [(0, 0, 4)]
    assert first["client"] and first["method"] == "PUT" and first["path"] == URL
    assert mutations[1]["error_type"] == "invalid_update" and mutations[1]["count"] == 1
    assert refusals[0]["role"] == "read" and refusals[0]["token_source"] == "MY_PKG_READ_TOKEN"
    assert ADMIN not in str(body) and READER not in str(body)
    # The durable audit: one JSON line per applied and per rejected update, with the outcome on every engine.
    lines = [json.loads(m) for m in plugin_log.messages(logging.INFO) if m.startswith("{")]
    outcomes = [(line["result"], line.get("status_code")) for line in lines if line.get("transaction")]
    assert outcomes == [("applied", 200), ("rejected", 409)]
    applied = next(line for line in lines if line["result"] == "applied")
    assert applied["transaction"] == first["transaction"] and applied["request_id"] == "change-42"
    assert applied["outcomes"] == [{"dp_rank": 0, "outcome": "committed", "settings_version": 1}]
    assert applied["settings"] == first["settings"] and applied["settings_version"] == 1


async def test_the_fingerprint_is_an_hmac_not_a_plain_hash():
    assert fingerprint(ADMIN) == fingerprint(ADMIN) != fingerprint(READER)
    assert hashlib.sha256(ADMIN.encode()).hexdigest()[: len(fingerprint(ADMIN))] != fingerprint(ADMIN)
    assert len(fingerprint(ADMIN)) == 16


async def test_a_flood_of_refusals_keeps_the_mutations_and_collapses_into_one_entry(
    monkeypatch, engine, make_app, client_for
):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_AUDIT_SIZE", "4")
    app = await make_app(engine, api_key=["inference-key"])
    async with client_for(app, token=ADMIN) as admin, client_for(app, token="inference-key") as inference:
        assert (await admin.put(URL, json={"n_probes": 6})).status_code == 200
        for _ in range(40):  # ten times the ring: an inference client trying to wipe the history
            assert (await inference.put(URL, json={"n_probes": 2})).status_code == 403
        body = (await admin.get(AUDIT)).json()
    assert [e["result"] for e in body["mutations"]] == ["applied"]
    assert len(body["refusals"]) == 1 and body["refusals"][0]["count"] == 40
    assert body["refusals"][0]["token_source"] == "--api-key" and body["refusals"][0]["first_time"]


async def test_failed_authentication_is_counted_and_logged_rate_limited(app, client_for, plugin_log):
    invalid, missing = _failures("invalid_token"), _failures("missing_token")
    async with client_for(app, token="guess") as guesser, client_for(app) as anonymous:
        for _ in range(5):
            assert (await guesser.put(URL, json={"n_probes": 2})).status_code == 401
        assert (await anonymous.get(URL)).status_code == 401
    assert _failures("invalid_token") == invalid + 5 and _failures("missing_token") == missing + 1
    lines = [m for m in plugin_log.messages(logging.WARNING) if "authentication failed (invalid_token)" in m]
    assert len(lines) == 1


async def test_every_api_server_returns_the_same_mutation_history(monkeypatch, engine, make_app, client_for):
    """Two API servers (two apps, as `vllm serve` runs them) in front of the same engine."""
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    first, second = await make_app(engine), await make_app(engine)
    async with client_for(first, token=ADMIN) as one, client_for(second, token=ADMIN) as two:
        assert (await one.put(URL, json={"n_probes": 6})).status_code == 200
        assert (await two.put(URL, json={"n_probes": 7})).status_code == 200
        seen_by_one, seen_by_two = (await one.get(AUDIT)).json(), (await two.get(AUDIT)).json()
    assert seen_by_one["mutations"] == seen_by_two["mutations"]
    assert [(e["update"]["n_probes"], e["settings_version"]) for e in seen_by_one["mutations"]] == [(6, 1), (7, 2)]


async def test_reads_are_not_audited_and_the_log_is_admin_only(app, client_for, assert_error):
    async with client_for(app, token=READER) as reader:
        assert (await reader.get(URL)).status_code == 200
        err = assert_error(await reader.get(AUDIT), 403, "permission_error")
        assert err["required_role"] == "admin"
    async with client_for(app, token="inference-key") as inference:
        assert_error(await inference.get(AUDIT), 403)
    async with client_for(app, token=ADMIN) as admin:
        body = (await admin.get(AUDIT)).json()
        assert body["mutations"] == [] and body["refusals"] == [] and body["size"] == 256
        generated = (await admin.get(URL)).headers["X-Request-Id"]
        assert len(generated) == 32  # generated when the caller sends none


async def test_the_engine_ring_is_bounded(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_AUDIT_SIZE", "2")
    app = await make_app(engine)
    async with client_for(app, token=ADMIN) as admin:
        for probes in (2, 3, 5):
            assert (await admin.put(URL, json={"n_probes": probes})).status_code == 200
        entries = (await admin.get(AUDIT)).json()["mutations"]
    assert [e["update"]["n_probes"] for e in entries] == [3, 5]


async def test_without_tokens_the_audit_log_is_closed(engine, make_app, client_for, assert_error):
    app = await make_app(engine)
    async with client_for(app) as anon:
        assert_error(await anon.get(AUDIT), 403)
