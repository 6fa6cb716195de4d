"""Least privilege, the audit log and vLLM's own /metrics, over HTTP against a real server.

The FlashHead server runs with `--api-key` (read role), MY_PKG_READ_TOKEN (read role)
and MY_PKG_ADMIN_TOKEN (admin role).
"""

from __future__ import annotations

import hashlib
import re

import pytest
from e2e_support import ADMIN_TOKEN, API_KEY, READ_TOKEN, auth, client

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
AUDIT = "/plugins/my_pkg/audit"


def _fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:8]


def _audit_entry(http, request_id: str, kind: str = "mutations") -> dict:
    response = http.get(AUDIT, headers=auth(ADMIN_TOKEN))
    assert response.status_code == 200, response.text
    matches = [e for e in response.json()[kind] if e["request_id"] == request_id]
    assert len(matches) == 1, response.json()[kind][-5:]
    return matches[0]


@pytest.mark.parametrize("token", [API_KEY, READ_TOKEN], ids=["api_key", "read_token"])
def test_read_role_reads_but_cannot_change_or_see_the_audit_log(flashhead_server, token):
    with client(flashhead_server) as http:
        before = http.get(FLASHHEAD, headers=auth(token))
        assert before.status_code == 200, before.text
        request_id = f"refused-{_fingerprint(token)}"
        refused = http.put(FLASHHEAD, json={"n_probes": 1}, headers={**auth(token), "X-Request-Id": request_id})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["required_role"] == "admin"
        assert refused.headers["X-Request-Id"] == request_id
        after = http.get(FLASHHEAD, headers=auth(token)).json()
        assert after["workers"][0]["n_probes"] == before.json()["workers"][0]["n_probes"]  # nothing changed
        audit = http.get(AUDIT, headers=auth(token))
        assert audit.status_code == 403, audit.text
        assert audit.json()["error"]["required_role"] == "admin"

        entry = _audit_entry(http, request_id, "refusals")
        assert entry["result"] == "refused" and entry["status_code"] == 403 and entry["count"] >= 1
        assert entry["role"] == "read"
        assert entry["token_fingerprint"] and entry["token_fingerprint"] != _fingerprint(token)  # an HMAC
        assert entry["method"] == "PUT" and entry["path"] == FLASHHEAD


def test_admin_change_is_audited_with_before_and_after(flashhead_server):
    with client(flashhead_server) as http:
        current = http.get(FLASHHEAD, headers=auth(ADMIN_TOKEN)).json()["workers"][0]["n_probes"]
        target = current + 1
        try:
            response = http.put(
                FLASHHEAD, json={"n_probes": target}, headers={**auth(ADMIN_TOKEN), "X-Request-Id": "e2e-admin-change"}
            )
            assert response.status_code == 200, response.text
            assert response.headers["X-Request-Id"] == "e2e-admin-change"
            entry = _audit_entry(http, "e2e-admin-change")
        finally:
            http.put(FLASHHEAD, json={"n_probes": current}, headers=auth(ADMIN_TOKEN))
    assert entry["result"] == "applied" and entry["status_code"] == 200
    assert entry["role"] == "admin" and entry["api_server"] and entry["settings_version"] >= 1
    assert entry["token_fingerprint"] and entry["token_fingerprint"] != _fingerprint(ADMIN_TOKEN)
    assert entry["update"] == {"n_probes": target}
    assert [w["n_probes"] for w in entry["before"]] == [current]
    assert entry["client"].startswith("127.0.0.1:")


def test_plugin_series_appear_on_vllms_own_metrics(flashhead_server):
    with client(flashhead_server) as http:
        completion = http.post(
            "/v1/completions",
            headers=auth(),
            json={"model": flashhead_server.model, "prompt": "hello world", "max_tokens": 4, "temperature": 0},
        )
        assert completion.status_code == 200, completion.text
        rows = http.get(FLASHHEAD, headers=auth()).json()["workers"][0]["counters"]["rows_flashhead"]
        assert rows > 0
        scrape = http.get("/metrics")  # vLLM's route, as Prometheus scrapes it
    assert scrape.status_code == 200
    text = scrape.text
    assert "vllm:" in text  # vLLM's own series are still there
    match = re.search(r'^my_pkg_flashhead_rows_total\{dp_rank="0",path="flashhead",rank="0"\} (\S+)$', text, re.M)
    assert match, [line for line in text.splitlines() if line.startswith("my_pkg_")]
    assert float(match.group(1)) >= rows
    assert re.search(r'^my_pkg_flashhead_active\{dp_rank="0",rank="0"\} 1\.0$', text, re.M)


def test_a_large_body_is_413_and_an_unauthenticated_one_401(flashhead_server):
    with client(flashhead_server) as http:
        big = b'{"n_probes": 3' + b" " * 8192 + b"}"
        assert http.put(FLASHHEAD, content=big, headers={"Content-Type": "application/json"}).status_code == 401
        too_large = http.put(FLASHHEAD, content=big, headers={**auth(ADMIN_TOKEN), "Content-Type": "application/json"})
        assert too_large.status_code == 413, too_large.text
        assert too_large.json()["error"]["type"] == "request_too_large"


def test_failed_logins_are_counted_on_vllms_metrics(flashhead_server):
    def failures(text: str) -> float:
        match = re.search(r'^my_pkg_admin_auth_failures_total\{reason="invalid_token"\} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    with client(flashhead_server) as http:
        before = failures(http.get("/metrics").text)
        for _ in range(3):
            assert http.get(FLASHHEAD, headers=auth("a-guess")).status_code == 401
        assert failures(http.get("/metrics").text) == before + 3
