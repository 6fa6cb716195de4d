"""A stateful property test of FlashHead updates: N engines x M API servers with injected faults.

Hypothesis drives the real worker methods (`FakeEngines`) through sequences of updates, conditional updates,
worker errors before and after a call ran (a lost reply), calls held at one engine while the lease clock
moves (late prepares and late commits, lapsed and taken leases), and engine restarts. It checks:

* every 200 carries the version and settings every engine holds right after it (but an engine that restarted
  while that update was in flight: it committed, then lost it, and is caught up by a later snapshot or update),
  and versions only increase (per worker, until it restarts; and from one 200 to the next);
* a conditional update with a fresh ETag and nothing else in flight is never lost (200);
* at quiescence (faults off, everything released) one update from any API server succeeds at once and
  leaves every worker of every engine with the same settings and version, and GET says `consistent`;
* the audit is the history: one `applied` line per 200 and none other, and every engine's applied
  entries are exactly the transactions that committed on it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from my_pkg import contract
from my_pkg.engine.admin_ledger import ledger_of

ADMIN = "admin-token-admin-token-admin-token-0123"
URL = "/plugins/my_pkg/flashhead"
LEASE_S = 30.0
FIELDS = st.one_of(
    st.fixed_dictionaries({"n_probes": st.integers(1, 16)}),
    st.fixed_dictionaries({"enabled": st.booleans()}),
    st.fixed_dictionaries({"dense_batch_threshold": st.one_of(st.none(), st.integers(0, 64))}),
)
PHASES = st.sampled_from([contract.FLASHHEAD_PREPARE, contract.FLASHHEAD_COMMIT])
EXAMPLES = 40


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("{"):
            self.lines.append(json.loads(message))


def machine(make_app, client_for, fake_engines_cls, engines: int, api_servers: int) -> type[RuleBasedStateMachine]:
    class Updates(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.shared = fake_engines_cls(engines=engines, world_size=2)
            self.views = [self.shared.view() for _ in range(api_servers)]
            self.apps = [self.run(make_app(view)) for view in self.views]
            self.clients = [client_for(app, token=ADMIN) for app in self.apps]
            self.stalled: dict[int, tuple[asyncio.Task, asyncio.Event]] = {}
            self.oks: list[dict] = []  # every 200's body
            self.seen: dict[tuple[int, int], int] = {}  # last version seen per worker
            self.restarted: dict[int, set[str]] = {}  # per engine: the commits its last restart forgot
            self.restarted_in_flight: dict[int, set[int]] = {}  # per stalled API server: engines restarted since
            self.audit = _Lines()
            self.logger = logging.getLogger("vllm.my_pkg.endpoints.audit")
            self.logger.addHandler(self.audit)
            self.logger.setLevel(logging.INFO)

        def run(self, coroutine):
            return self.loop.run_until_complete(coroutine)

        def teardown(self) -> None:
            try:
                self.quiesce()
            finally:
                self.logger.removeHandler(self.audit)
                for client in self.clients:
                    self.run(client.aclose())
                self.loop.close()

        # ---- checks ------------------------------------------------------------------------------

        def check_ok(self, body: dict, restarted: frozenset[int] = frozenset()) -> None:
            """A 200: every worker holds its version and settings now (but those of the engines `restarted` while
            the update was in flight); it is above every earlier 200's."""
            version, whole = body["settings_version"], body["settings"]
            expected = (whole["enabled"], whole["n_probes"], whole["dense_batch_threshold"])
            held = self.shared.held()
            kept = {dp for dp, *_ in held} - restarted  # every engine may have restarted while it was in flight
            assert {(v, s) for dp, _, v, s in held if dp in kept} == ({(version, expected)} if kept else set())
            assert all(h["settings_version"] == version for h in body["engine_settings"])
            assert all(version > ok["settings_version"] for ok in self.oks)
            self.oks.append(body)

        @invariant()
        def versions_only_increase(self) -> None:
            for dp, rank, version, _ in self.shared.held():
                assert version >= self.seen.get((dp, rank), 0)
                self.seen[(dp, rank)] = version

        # ---- rules -------------------------------------------------------------------------------

        def _free(self, api: int) -> bool:
            return api not in self.stalled

        @rule(api=st.integers(0, api_servers - 1), update=FIELDS, conditional=st.booleans())
        def put(self, api: int, update: dict, conditional: bool) -> None:
            if not self._free(api):
                return
            client = self.clients[api]
            headers = {}
            if conditional:
                read = self.run(client.get(URL))
                assert read.status_code == 200, read.text
                headers["If-Match"] = read.headers["ETag"]
            quiet = not self.stalled and not self.shared.faults
            answer = self.run(client.put(URL, json=update, headers=headers))
            if answer.status_code == 200:
                self.check_ok(answer.json())
            else:
                # Only a fault or another update in flight may refuse it: no update with a fresh ETag is lost.
                assert not quiet, answer.text
                assert answer.status_code in (409, 503), answer.text

        @rule(
            dp=st.integers(0, engines - 1),
            method=PHASES,
            when=st.sampled_from(["before", "after"]),
        )
        def fail_next_call(self, dp: int, method: str, when: str) -> None:
            self.shared.faults[(method, dp)] = (RuntimeError(f"injected {method} fault on dp {dp}"), when)

        @rule(api=st.integers(0, api_servers - 1), update=FIELDS, method=PHASES, dp=st.integers(0, engines - 1))
        def stall(self, api: int, update: dict, method: str, dp: int) -> None:
            """Start an update on `api` that is held when it calls `method` on engine `dp`."""
            if not self._free(api):
                return
            view = self.views[api]
            gate = asyncio.Event()
            view.hold = {(method, dp): gate}
            task = self.loop.create_task(self.clients[api].put(URL, json=update))

            async def until_held_or_done() -> None:
                while not view.waiting and not task.done():
                    await asyncio.sleep(0.001)

            self.run(until_held_or_done())
            if task.done():
                view.hold = {}
                self.finish(task)
            else:
                self.stalled[api] = (task, gate)
                self.restarted_in_flight[api] = set()

        @precondition(lambda self: self.stalled)
        @rule(data=st.data())
        def release(self, data) -> None:
            api = data.draw(st.sampled_from(sorted(self.stalled)))
            task, gate = self.stalled.pop(api)
            gate.set()
            self.views[api].hold = {}
            self.finish(task, frozenset(self.restarted_in_flight.pop(api)))

        def finish(self, task: asyncio.Task, restarted: frozenset[int] = frozenset()) -> None:
            answer = self.run(task)
            if answer.status_code == 200:
                self.check_ok(answer.json(), restarted)
            else:
                assert answer.status_code in (409, 503), answer.text

        @rule(seconds=st.sampled_from([1.0, LEASE_S + 1, 700.0]))
        def advance_clock(self, seconds: float) -> None:
            self.shared.clock[0] += seconds

        @rule(dp=st.integers(0, engines - 1))
        def restart(self, dp: int) -> None:
            """A new process for engine `dp`, while another engine holds the highest version (when every engine
            restarts, the count starts again: see docs/failure-modes.md)."""
            held = self.shared.held()
            top = max(v for _, _, v, _ in held)
            if not any(v == top for d, _, v, _ in held if d != dp):
                return
            self.shared.restart(dp)
            for engines_restarted in self.restarted_in_flight.values():
                engines_restarted.add(dp)
            self.restarted[dp] = {txn for txn, where in self.shared.commits.items() if dp in where}
            for rank in range(2):
                self.seen.pop((dp, rank), None)

        # ---- quiescence --------------------------------------------------------------------------

        def quiesce(self) -> None:
            for api in sorted(self.stalled):
                task, gate = self.stalled.pop(api)
                gate.set()
                self.views[api].hold = {}
                self.finish(task, frozenset(self.restarted_in_flight.pop(api)))
            self.shared.faults.clear()
            answer = self.run(self.clients[-1].put(URL, json={"n_probes": 3}))
            assert answer.status_code == 200, answer.text  # at once: no lease is left behind
            self.check_ok(answer.json())
            status = self.run(self.clients[0].get(URL)).json()
            assert status["consistent"] is True and status["settings_version"] == answer.json()["settings_version"]
            # The audit log: one applied line per 200, none other.
            applied = [line for line in self.audit.lines if line["result"] == "applied"]
            assert [line["transaction"] for line in applied] == [ok["transaction"] for ok in self.oks]
            assert [line["settings_version"] for line in applied] == [ok["settings_version"] for ok in self.oks]
            # Every engine's applied entries are the transactions that committed on it (since it last restarted).
            for dp, fake in enumerate(self.shared.engines):
                kept = [e["transaction"] for e in ledger_of(fake.workers[0]).applied]
                ran = {txn for txn, where in self.shared.commits.items() if dp in where} - self.restarted.get(dp, set())
                assert set(kept) == ran and kept[-1] == answer.json()["transaction"]

    return Updates


@pytest.mark.slow
@pytest.mark.parametrize(("engines", "api_servers"), [(1, 2), (2, 2), (3, 2)])
def test_updates_stay_all_or_none_under_faults(
    engines, api_servers, monkeypatch, make_app, client_for, fake_engines_cls
):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("MY_PKG_STATUS_MAX_AGE", "0")
    monkeypatch.setenv("MY_PKG_RPC_TIMEOUT", "5")
    run_state_machine_as_test(
        machine(make_app, client_for, fake_engines_cls, engines, api_servers),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
