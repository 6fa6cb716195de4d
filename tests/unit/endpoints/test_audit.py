"""The audit log: every mutation and every refused mutation of an authenticated caller."""

from __future__ import annotations

import hashlib
import logging

import pytest

pytestmark = pytest.mark.anyio

ADMIN, READER = "admin-secret", "read-secret"
URL = "/plugins/my_pkg/flashhead"


@pytest.fixture
async def app(monkeypatch, engine, make_app):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_READ_TOKEN", READER)
    return await make_app(engine, api_key=["inference-key"])


def _prefix(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:8]


async def test_mutations_and_refusals_are_recorded_and_logged(app, client_for, engine, plugin_log):
    async with client_for(app, token=ADMIN) as admin, client_for(app, token=READER) as reader:
        applied = await admin.put(URL, json={"n_probes": 6}, headers={"X-Request-Id": "change-42"})
        assert applied.status_code == 200 and applied.headers["X-Request-Id"] == "change-42"
        assert (await reader.put(URL, json={"n_probes": 2})).status_code == 403
        assert (await admin.put(URL, json={"n_probes": 999})).status_code == 409  # a worker refuses
        assert (await admin.put(URL, json={"n_probes": 0})).status_code == 422  # invalid body
        entries = (await admin.get("/plugins/my_pkg/audit")).json()["entries"]
    assert [(e["status_code"], e["result"]) for e in entries] == [
        (200, "applied"), (403, "refused"), (409, "refused"), (422, "refused")]
    first = entries[0]
    assert first["request_id"] == "change-42" and first["role"] == "admin"
    assert first["token_source"] == "MY_PKG_ADMIN_TOKEN" and first["token_sha256_prefix"] == _prefix(ADMIN)
    assert first["update"] == {"n_probes": 6}
    assert [b["n_probes"] for b in first["before"]] == [4, 4] and [a["n_probes"] for a in first["after"]] == [6, 6]
    assert first["client"] and first["method"] == "PUT" and first["path"] == URL
    assert entries[1]["role"] == "read" and entries[1]["token_source"] == "MY_PKG_READ_TOKEN"
    assert ADMIN not in str(entries) and READER not in str(entries)
    logged = [m for m in plugin_log.messages(logging.INFO) if '"change-42"' in m]
    assert len(logged) == 1 and '"result": "applied"' in logged[0]


async def test_reads_are_not_audited_and_the_log_is_admin_only(app, client_for, assert_error):
    async with client_for(app, token=READER) as reader:
        assert (await reader.get(URL)).status_code == 200
        err = assert_error(await reader.get("/plugins/my_pkg/audit"), 403, "permission_error")
        assert err["required_role"] == "admin"
    async with client_for(app, token="inference-key") as inference:
        assert_error(await inference.get("/plugins/my_pkg/audit"), 403)
    async with client_for(app, token=ADMIN) as admin:
        body = (await admin.get("/plugins/my_pkg/audit")).json()
        assert body["entries"] == [] and body["size"] == 256
        generated = (await admin.get(URL)).headers["X-Request-Id"]
        assert len(generated) == 32  # generated when the caller sends none


async def test_the_ring_is_bounded(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_AUDIT_SIZE", "2")
    app = await make_app(engine)
    async with client_for(app, token=ADMIN) as admin:
        for probes in (2, 3, 5):
            assert (await admin.put(URL, json={"n_probes": probes})).status_code == 200
        entries = (await admin.get("/plugins/my_pkg/audit")).json()["entries"]
    assert [e["update"]["n_probes"] for e in entries] == [3, 5]


async def test_without_tokens_the_audit_log_is_closed(engine, make_app, client_for, assert_error):
    app = await make_app(engine)
    async with client_for(app) as anon:
        assert_error(await anon.get("/plugins/my_pkg/audit"), 403)
