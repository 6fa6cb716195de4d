"""`vllm serve` with two API-server processes, as vLLM runs it: `--data-parallel-size 2` (two engines) and
`--api-server-count 2` with one engine. One server at a time (module-scoped, one per topology).

Each API server has its own memory; what must hold across them comes from the engines: one winner per
settings version among concurrent PUTs, equal engines, the same audit history from either API server,
a read after a PUT that sees it from either, and vLLM's /metrics with the my_pkg series from the first
scrape on. Every request opens its own connection, so the kernel spreads them over both processes.

Then, with two engines, updates under a stalled engine. One engine's worker is paused (SIGSTOP) while an
update prepares it: the update answers 504 with its transaction, a concurrent update from either API server
is refused (409) with nothing applied, and once the worker resumes the pending update lands on both engines;
afterwards every engine holds the same settings and version, the next update from either API server succeeds
at once, and completions still work. Then engines freeze at random moments while updates of different fields
run, and everything converges once they thaw (`MY_PKG_TEST_SEED` replays one run's choices).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2e_support import ADMIN_TOKEN, BOTH_HALVES, EAGER, RPC_TIMEOUT, auth

from tests.support.server import VllmServer

pytestmark = pytest.mark.e2e

FLASHHEAD = "/plugins/my_pkg/flashhead"
AUDIT = "/plugins/my_pkg/audit"
SERIES = "my_pkg_flashhead_n_probes{"


TOPOLOGIES = {"dp2": ["--data-parallel-size", "2", *EAGER], "api2": ["--api-server-count", "2", *EAGER]}
ENGINES = {"dp2": [0, 1], "api2": [0]}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES, reverse=True))
def dp2_serve(request, flashhead_model: Path, logs_dir: Path) -> Iterator[VllmServer]:
    env = {
        "VLLM_PLUGINS": BOTH_HALVES,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "MY_PKG_ADMIN_TOKEN": ADMIN_TOKEN,
        "MY_PKG_RPC_TIMEOUT": RPC_TIMEOUT,
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


#: The tests that need two engines run on the `dp2` server only.
DP2_ONLY = pytest.mark.parametrize("dp2_serve", ["dp2"], indirect=True)


def fresh(
    server: VllmServer, method: str, path: str, headers: dict[str, str] | None = None, **kwargs
) -> httpx.Response:
    """One request on a connection of its own (either API-server process may answer)."""
    with httpx.Client(base_url=server.url, timeout=120.0) as http:
        return http.request(method, path, headers={**auth(ADMIN_TOKEN), **(headers or {})}, **kwargs)


def _held(server: VllmServer) -> dict:
    return fresh(server, "GET", FLASHHEAD).json()


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


def engine_kept(audit: dict) -> list[tuple]:
    """What the engines kept, the same from every API server: one entry per applied transaction and the
    rejections they recorded. The other entries are the answering API server's own outcomes (a 409 it
    refused, a 504 whose update the engines never applied) and differ between API servers by design."""
    return [
        (e.get("transaction"), e.get("settings_version"), tuple(e["kept_by"]), json.dumps(e.get("settings")))
        for e in audit["mutations"]
        if "kept_by" in e
    ]


def test_every_api_server_returns_the_same_audit_history(dp2_serve):
    assert fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": 9}).status_code == 200
    assert httpx.get(f"{dp2_serve.url}/metrics", timeout=60.0).text.count(SERIES) == len(dp2_serve.engines)
    reads = [fresh(dp2_serve, "GET", AUDIT).json() for _ in range(12)]
    assert len({r["api_server"] for r in reads}) == 2  # both processes answered
    assert len({json.dumps(engine_kept(r)) for r in reads}) == 1
    applied = [e for e in reads[0]["mutations"] if e["result"] == "applied"]
    assert applied and applied[-1]["update"] == {"n_probes": 9}
    assert {e["api_server"] for e in applied} <= {r["api_server"] for r in reads}


@DP2_ONLY
def test_a_stalled_engine_delays_an_update_and_every_engine_ends_equal(dp2_serve):
    workers = fresh(dp2_serve, "GET", "/plugins/my_pkg/workers").json()["workers"]
    pid_of = {w["dp_rank"]: w["pid"] for w in workers if w["rank"] == 0}
    assert sorted(pid_of) == [0, 1]
    start = _held(dp2_serve)
    base, version = start["workers"][0]["n_probes"], start["settings_version"]
    assert start["consistent"] is True

    os.kill(pid_of[1], signal.SIGSTOP)
    try:
        began = time.monotonic()
        pending = fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": base + 2})
        waited = time.monotonic() - began
        assert pending.status_code == 504, pending.text
        error = pending.json()["error"]
        assert error["transaction"] and "not known" in error["note"]
        assert waited >= 2 * float(RPC_TIMEOUT) - 0.5  # the wait grows with the engines
        for _ in range(4):  # either API server: the engines' leases (or its own update in flight) refuse it
            other = fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": base + 3})
            assert other.status_code == 409, other.text
            assert other.json()["error"]["type"] == "update_in_progress"
    finally:
        os.kill(pid_of[1], signal.SIGCONT)

    deadline = time.monotonic() + 60
    while True:  # the pending update completes by itself once the worker answers
        now = _held(dp2_serve)
        if now["settings_version"] == version + 1 and now["consistent"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    assert {w["n_probes"] for w in now["workers"]} == {base + 2}

    for n in (base + 4, base + 5):  # at once, from whichever API server answers
        answer = fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": n})
        assert answer.status_code == 200, answer.text
        assert {h["settings_version"] for h in answer.json()["engine_settings"]} == {answer.json()["settings_version"]}
    final = _held(dp2_serve)
    assert final["consistent"] is True and {w["n_probes"] for w in final["workers"]} == {base + 5}
    assert len({w["dp_rank"] for w in final["workers"]}) == 2

    mutations = fresh(dp2_serve, "GET", AUDIT).json()["mutations"]
    stalled = [m for m in mutations if m.get("transaction") == error["transaction"]]
    assert [(m["result"], m["kept_by"]) for m in stalled] == [("applied", [0, 1])]

    with httpx.Client(base_url=dp2_serve.url, timeout=120.0) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for _ in range(4):  # spread over both engines; a stale RPC reply would kill an engine here
            body = {"model": model, "prompt": "the world and the sun", "max_tokens": 8, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
    log = dp2_serve.log_path.read_text(errors="replace")
    assert f'"transaction": "{error["transaction"]}"' in log and "EngineCore" in log


#: The fields the concurrent PUTs change, each with values valid on the test model.
FIELD_VALUES = {"n_probes": (6, 7, 9, 11), "enabled": (True, False), "dense_batch_threshold": (None, 64, 128)}
FAULT_PHASE_S = 25.0
LONGEST_FREEZE_S = 15.0


@DP2_ONLY
def test_updates_of_different_fields_converge_after_engines_freeze_at_random_moments(dp2_serve):
    """While two clients PUT different fields through either API server, an engine (either one, chosen at random)
    is frozen (SIGSTOP) for up to 15 s at random moments and thawed. Every answer is 200, 409, 503 or 504; every 200
    carries a version no other 200 carried, and every engine held it. Once the faults stop, a PUT answers 200, every
    worker holds the same settings and version, a conditional PUT with the ETag just read answers 200, and both API
    servers return the same engine-kept audit, whose applied updates are every 200 with increasing versions."""
    seed = int(os.environ.get("MY_PKG_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    workers = fresh(dp2_serve, "GET", "/plugins/my_pkg/workers").json()["workers"]
    pids = sorted(w["pid"] for w in workers if w["rank"] == 0)
    assert len(pids) == 2, workers
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def put_loop(fields: tuple[str, ...], client_seed: int) -> None:
        local = random.Random(client_seed)
        while not stop.is_set():
            field = local.choice(fields)
            answers.append(fresh(dp2_serve, "PUT", FLASHHEAD, json={field: local.choice(FIELD_VALUES[field])}))
            time.sleep(local.uniform(0.0, 0.5))

    clients = [
        threading.Thread(target=put_loop, args=(("n_probes",), seed + 1)),
        threading.Thread(target=put_loop, args=(("enabled", "dense_batch_threshold"), seed + 2)),
    ]
    frozen: list[tuple[int, float]] = []
    for thread in clients:
        thread.start()
    began = time.monotonic()
    try:
        while (left := FAULT_PHASE_S - (time.monotonic() - began)) > 0.5:
            time.sleep(rng.uniform(0.0, min(2.0, left)))
            pid, hold = rng.choice(pids), rng.uniform(0.5, min(LONGEST_FREEZE_S, max(0.5, left)))
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(hold)
            finally:
                os.kill(pid, signal.SIGCONT)
            frozen.append((pid, round(hold, 2)))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        stop.set()
        for thread in clients:
            thread.join(timeout=300)
    context = f"seed {seed}, freezes {frozen}"
    assert frozen and answers, context

    codes = [answer.status_code for answer in answers]
    assert set(codes) <= {200, 409, 503, 504}, (
        context,
        [a.text for a in answers if a.status_code not in (200, 409, 503, 504)],
    )
    won = [answer.json() for answer in answers if answer.status_code == 200]
    for body in won:
        assert {h["settings_version"] for h in body["engine_settings"]} == {body["settings_version"]}, context
    assert len({body["settings_version"] for body in won}) == len(won), (context, [b["settings_version"] for b in won])

    deadline = time.monotonic() + 120  # a pending update finishes, or its leases lapse
    while (last := fresh(dp2_serve, "PUT", FLASHHEAD, json={"n_probes": 5, "enabled": True})).status_code != 200:
        assert last.status_code in (409, 503, 504) and time.monotonic() < deadline, (context, last.text)
        time.sleep(1.0)
    version = last.json()["settings_version"]
    reads = [fresh(dp2_serve, "GET", FLASHHEAD) for _ in range(4)]
    for read in reads:
        held = read.json()
        assert held["consistent"] is True and held["settings_version"] == version, (context, held)
        assert {w["n_probes"] for w in held["workers"]} == {5} and len({w["dp_rank"] for w in held["workers"]}) == 2
    conditional = fresh(
        dp2_serve, "PUT", FLASHHEAD, json={"n_probes": 4}, headers={"If-Match": reads[-1].headers["ETag"]}
    )
    assert conditional.status_code == 200, (context, conditional.text)
    assert conditional.json()["settings_version"] == version + 1

    audits: list[dict] = []
    while len(audits) < 24 and (len(audits) < 4 or len({audit["api_server"] for audit in audits}) < 2):
        audits.append(fresh(dp2_serve, "GET", AUDIT).json())
    assert len({audit["api_server"] for audit in audits}) == 2, "both API servers answered"

    assert len({json.dumps(engine_kept(audit)) for audit in audits}) == 1, context
    # An applied entry keeps "applied", or the partial/failed outcome of the API server that ran it.
    applied = [e for e in audits[0]["mutations"] if "kept_by" in e and e["result"] != "rejected"]
    versions = [e["settings_version"] for e in applied]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), (context, versions)
    assert all(e["kept_by"] == [0, 1] for e in applied if e["settings_version"] >= version), context
    by_transaction = {e["transaction"]: e for e in applied}
    for body in [*won, last.json(), conditional.json()]:
        entry = by_transaction.get(body["transaction"])
        assert entry is not None and entry["settings_version"] == body["settings_version"], (context, body)
        assert entry["settings"] == body["settings"], context
