"""`vllm serve` with two API-server processes, as vLLM runs it: `--data-parallel-size 2` (two engines) and
`--api-server-count 2` with one engine. One server at a time (module-scoped, one per topology).

Each API server has its own memory; what must hold across them comes from the engines: one winner per
settings version among concurrent PUTs, equal engines, the same audit history from either API server,
a read after a PUT that sees it from either, and vLLM's /metrics with the my_pkg series from the first
scrape on. Every request opens its own connection, so the kernel spreads them over both processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2e_support import ADMIN_TOKEN, BOTH_HALVES, auth

from tests.support.server import VllmServer

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
AUDIT = "/plugins/my_pkg/audit"
SERIES = "my_pkg_flashhead_n_probes{"


TOPOLOGIES = {"dp2": ["--data-parallel-size", "2"], "api2": ["--api-server-count", "2"]}
ENGINES = {"dp2": [0, 1], "api2": [0]}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES, reverse=True))
def dp2_serve(request, flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    env = {
        "VLLM_PLUGINS": BOTH_HALVES,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN,
        "VLLM_API_KEY": None,
        "MY_PKG_DISABLE": None,
        "MY_PKG_FLASHHEAD": None,
        "PROMETHEUS_MULTIPROC_DIR": None,
        "MY_PKG_STATUS_MAX_AGE": None,
    }  # the default max age: only the update marker makes reads fresh
    server = VllmServer(
        model=str(flashhead_model),
        launcher="serve",
        env=env,
        log_path=logs_dir / f"{request.param}-serve.log",
        args=TOPOLOGIES[request.param],
    )
    server.engines = ENGINES[request.param]
    with server:
        yield server


def fresh(server: VllmServer, method: str, path: str, **kwargs) -> httpx.Response:
    """One request on a connection of its own (either API-server process may answer)."""
    with httpx.Client(base_url=server.url, timeout=120.0) as http:
        return http.request(method, path, headers=auth(ADMIN_TOKEN), **kwargs)


def test_the_first_scrape_after_start_up_has_the_series(dp2_serve):
    log = dp2_serve.log_path.read_text(errors="replace")
    assert "ApiServer_1" in log  # two API-server processes, as `vllm serve` runs them with DP=2
    with httpx.Client(base_url=dp2_serve.url, timeout=60.0) as http:
        text = http.get("/metrics").text
    for dp_rank in dp2_serve.engines:
        assert f'my_pkg_flashhead_n_probes{{dp_rank="{dp_rank}",rank="0"}}' in text


def test_concurrent_puts_have_one_winner_per_version_and_end_with_equal_engines(dp2_serve):
    start = fresh(dp2_serve, "GET", FLASHHEAD).json()
    base = start["workers"][0]["n_probes"]
    targets = [base + 1 + i for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": n}), targets))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 409} and 200 in codes, [a.text for a in answers]
    won = [a.json() for a in answers if a.status_code == 200]
    versions = [w["settings_version"] for w in won]
    assert len(versions) == len(set(versions))  # exactly one 200 per version
    assert all(w["engines"] == dp2_serve.engines and w["other_nodes_untouched"] is False for w in won)
    for lost in (a.json()["error"] for a in answers if a.status_code == 409):
        assert lost["type"] == "update_in_progress" and lost["settings_version"] is not None
    last = max(won, key=lambda w: w["settings_version"])
    for _ in range(6):  # a read after the PUTs sees the last one, whichever API server answers
        now = fresh(dp2_serve, "GET", FLASHHEAD).json()
        assert now["settings_version"] == last["settings_version"]
        assert {(w["dp_rank"], w["n_probes"]) for w in now["workers"]} == {
            (dp_rank, last["applied"]["n_probes"]) for dp_rank in dp2_serve.engines
        }
    text = httpx.get(f"{dp2_serve.url}/metrics", timeout=60.0).text
    assert SERIES in text  # no gap after the PUTs


def test_every_api_server_returns_the_same_audit_history(dp2_serve):
    assert fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": 9}).status_code == 200
    assert httpx.get(f"{dp2_serve.url}/metrics", timeout=60.0).text.count(SERIES) == len(dp2_serve.engines)
    reads = [fresh(dp2_serve, "GET", AUDIT).json() for _ in range(12)]
    assert len({r["api_server"] for r in reads}) == 2  # both processes answered
    histories = {tuple(e["transaction"] for e in r["mutations"] if "transaction" in e) for r in reads}
    assert len(histories) == 1
    applied = [e for e in reads[0]["mutations"] if e["result"] == "applied"]
    assert applied and applied[-1]["update"] == {"n_probes": 9}
    assert {e["api_server"] for e in applied} <= {r["api_server"] for r in reads}
