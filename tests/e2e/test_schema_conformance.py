"""Schemathesis `--checks all` over the plugin's routes against a real vLLM server.

Every generated request (valid and invalid, every method the OpenAPI document
lists and some it does not) must get an answer that conforms to the document:
no 5xx, the declared status codes, content types, headers and schemas. The
engine must still serve completions afterwards, and the FlashHead settings the
run changed are put back so the session's other tests see the server as started.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import ADMIN_TOKEN, auth, client

pytestmark = pytest.mark.e2e

SCHEMATHESIS = [sys.executable, "-m", "schemathesis.cli"]


def _run_schemathesis(base_url: str, token: str, report: Path, max_examples: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *SCHEMATHESIS,
            "run",
            f"{base_url}/openapi.json",
            "--include-path-regex",
            "^/plugins/my_pkg/",
            "--checks",
            "all",
            "--header",
            f"Authorization: Bearer {token}",
            "--max-examples",
            str(max_examples),
            "--seed",
            "1",
            "--workers",
            "1",
            "--report",
            "junit",
            "--report-junit-path",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=report.parent,  # its cache stays out of the checkout
    )


@pytest.fixture
def settings_restored(flashhead_server):
    """Put FlashHead's settings back as they were before the test."""
    with client(flashhead_server) as http:
        before = http.get("/plugins/my_pkg/flashhead", headers=auth(ADMIN_TOKEN)).json()["workers"][0]
    yield
    with client(flashhead_server) as http:
        restore = {name: before[name] for name in ("enabled", "n_probes", "dense_batch_threshold")}
        response = http.put("/plugins/my_pkg/flashhead", json=restore, headers=auth(ADMIN_TOKEN))
        assert response.status_code == 200, response.text


def test_schemathesis_all_checks_pass(flashhead_server, settings_restored, tmp_path):
    report = tmp_path / "schemathesis.xml"
    result = _run_schemathesis(flashhead_server.url, ADMIN_TOKEN, report, max_examples=25)
    summary = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, summary
    # The run must really have exercised the routes: every plugin operation appears in the report.
    text = report.read_text()
    for operation in (
        "GET /plugins/my_pkg/health",
        "GET /plugins/my_pkg/flashhead",
        "PUT /plugins/my_pkg/flashhead",
        "GET /plugins/my_pkg/audit",
    ):
        assert operation in text, f"{operation} not tested:\n{summary}"

    with client(flashhead_server) as http:
        response = http.post(
            "/v1/completions",
            headers=auth(),
            json={"model": flashhead_server.model, "prompt": "the sun", "max_tokens": 3},
        )
        assert response.status_code == 200, response.text
        audit = http.get("/plugins/my_pkg/audit", headers=auth(ADMIN_TOKEN))
        assert audit.status_code == 200, audit.text
        body = audit.json()  # the run's mutations (and refused ones) were audited
        assert any(entry["method"] == "PUT" for entry in body["mutations"] + body["refusals"])
