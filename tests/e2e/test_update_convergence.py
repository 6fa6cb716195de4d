"""Updates under a stalled engine on a real `vllm serve --data-parallel-size 2` (two engines, two API servers).

One engine's worker is paused (SIGSTOP) while an update prepares it: the update answers 504 with its
transaction, a concurrent update from either API server is refused (409) with nothing applied, and once the
worker resumes the pending update lands on both engines; afterwards every engine holds the same settings and
version, the next update from either API server succeeds at once, and completions still work. One server
start.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_support import ADMIN_TOKEN, BOTH_HALVES, RPC_TIMEOUT, auth

from tests.support.server import VllmServer

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
AUDIT = "/plugins/my_pkg/audit"


@pytest.fixture(scope="module")
def dp2_server(flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    env = {
        "VLLM_PLUGINS": BOTH_HALVES,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN,
        "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT,
        "MY_PKG_STATUS_MAX_AGE": "0",
        "VLLM_API_KEY": None,
        "MY_PKG_DISABLE": None,
        "MY_PKG_FLASHHEAD": None,
        "PROMETHEUS_MULTIPROC_DIR": None,
    }
    server = VllmServer(
        model=str(flashhead_model),
        launcher="serve",
        env=env,
        log_path=logs_dir / "dp2-convergence-serve.log",
        args=["--data-parallel-size", "2"],
    )
    with server:
        yield server


def fresh(server: VllmServer, method: str, path: str, **kwargs) -> httpx.Response:
    """One request on a connection of its own (either API-server process may answer)."""
    with httpx.Client(base_url=server.url, timeout=120.0) as http:
        return http.request(method, path, headers=auth(ADMIN_TOKEN), **kwargs)


def _held(server: VllmServer) -> dict:
    return fresh(server, "GET", FLASHHEAD).json()


def test_a_stalled_engine_delays_an_update_and_every_engine_ends_equal(dp2_server):
    workers = fresh(dp2_server, "GET", "/plugins/my_pkg/workers").json()["workers"]
    pid_of = {w["dp_rank"]: w["pid"] for w in workers if w["rank"] == 0}
    assert sorted(pid_of) == [0, 1]
    start = _held(dp2_server)
    base, version = start["workers"][0]["n_probes"], start["settings_version"]
    assert start["consistent"] is True

    os.kill(pid_of[1], signal.SIGSTOP)
    try:
        began = time.monotonic()
        pending = fresh(dp2_server, "PUT", FLASHHEAD, json={"n_probes": base + 2})
        waited = time.monotonic() - began
        assert pending.status_code == 504, pending.text
        error = pending.json()["error"]
        assert error["transaction"] and "not known" in error["note"]
        assert waited >= 2 * float(RPC_TIMEOUT) - 0.5  # the wait grows with the engines
        for _ in range(4):  # either API server: the engines' leases (or its own update in flight) refuse it
            other = fresh(dp2_server, "PUT", FLASHHEAD, json={"n_probes": base + 3})
            assert other.status_code == 409, other.text
            assert other.json()["error"]["type"] == "update_in_progress"
    finally:
        os.kill(pid_of[1], signal.SIGCONT)

    deadline = time.monotonic() + 60
    while True:  # the pending update completes by itself once the worker answers
        now = _held(dp2_server)
        if now["settings_version"] == version + 1 and now["consistent"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    assert {w["n_probes"] for w in now["workers"]} == {base + 2}

    for n in (base + 4, base + 5):  # at once, from whichever API server answers
        answer = fresh(dp2_server, "PUT", FLASHHEAD, json={"n_probes": n})
        assert answer.status_code == 200, answer.text
        assert {h["settings_version"] for h in answer.json()["engine_settings"]} == {answer.json()["settings_version"]}
    final = _held(dp2_server)
    assert final["consistent"] is True and {w["n_probes"] for w in final["workers"]} == {base + 5}
    assert len({w["dp_rank"] for w in final["workers"]}) == 2

    mutations = fresh(dp2_server, "GET", AUDIT).json()["mutations"]
    stalled = [m for m in mutations if m.get("transaction") == error["transaction"]]
    assert [(m["result"], m["kept_by"]) for m in stalled] == [("applied", [0, 1])]

    with httpx.Client(base_url=dp2_server.url, timeout=120.0) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for _ in range(4):  # spread over both engines; a stale RPC reply would kill an engine here
            body = {"model": model, "prompt": "the world and the sun", "max_tokens": 8, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
    log = dp2_server.log_path.read_text(errors="replace")
    assert f'"transaction": "{error["transaction"]}"' in log and "EngineCore" in log
