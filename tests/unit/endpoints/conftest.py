"""Fixtures for the endpoint-half unit tests: a fake engine client and an app.

Helpers are handed out as fixtures (not imported) so that the tests work
under any pytest import mode."""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import vllm  # noqa: F401 - imported once here, not inside the first test that reaches a worker method
from fastapi import FastAPI

from my_pkg import __version__, contract
from my_pkg.endpoints import AdminEndpointPlugin
from my_pkg.engine import rpc

ENV_VARS = (
    "MY_PKG_ALLOW_ANONYMOUS_READS",
    "MY_PKG_ADMIN_MAX_BODY_BYTES",
    "MY_PKG_ADMIN_TOKEN",
    "MY_PKG_READ_TOKEN",
    "MY_PKG_RPC_TIMEOUT",
    "MY_PKG_STATUS_MAX_AGE",
    "MY_PKG_AUDIT_SIZE",
    "MY_PKG_DISABLE",
    "VLLM_API_KEY",
    "VLLM_PLUGINS",
)


def not_implemented_text(method: str) -> str:
    """What vLLM's multiprocess engine returns for an unknown worker method."""
    return (
        "Call to collective_rpc method failed: Worker failed with error "
        f"'Method {method!r} is not implemented.', please check the stack "
        "trace above for the root cause"
    )


class FakeController:
    """The model-dependent part of a worker's FlashHead controller (what the real one checks after the
    contract): FlashHead available, `n_probes` at most the number of clusters. Reads and writes `fh`."""

    def __init__(self, fh: dict[str, Any]) -> None:
        self.fh = fh

    def status(self) -> contract.FlashHeadState:
        fh = self.fh
        return contract.FlashHeadState(
            available=fh["available"],
            active=fh["available"] and fh["enabled"],
            reason=None if fh["available"] else "model has no FlashHead assets",
            reason_code=None if fh["available"] else "no_assets",
            enabled=fh["enabled"],
            num_clusters=fh["num_clusters"] if fh["available"] else None,
            cluster_size=64,
            vocab_size=32000,
            n_probes=fh["n_probes"],
            dense_batch_threshold=fh["dense_batch_threshold"],
            probe_sampling=True,
            sampled_n_probes=None,
            sampled_rank=None,
            sampled_rescore=None,
            pinned_token_ids=[2],
            fidelity_every=100,
            backend="torch",
            extra_memory_bytes=1234,
            counters=fh["counters"],
        )

    def validate(self, update: contract.FlashHeadUpdate) -> list[str]:
        if not self.fh["available"]:
            return ["FlashHead is not available on this model"]
        n = update.n_probes
        if n is not None and n > self.fh["num_clusters"]:
            return [f"n_probes={n} exceeds num_clusters={self.fh['num_clusters']}"]
        return []

    def apply(self, update: contract.FlashHeadUpdate) -> None:
        self.fh.update(update.to_update())


class FakeEngineClient:
    """Stands in for vLLM's EngineClient: ``collective_rpc`` runs the engine half's real worker methods
    (`my_pkg.engine.rpc.WORKER_METHODS`) on stand-in workers, one reply per worker; only the process
    identity (pid, host, version) and the controller's model are simulated."""

    def __init__(self, world_size: int = 2, num_clusters: int = 16) -> None:
        self.world_size = world_size
        self.errored = False
        self.calls: list[dict[str, Any]] = []
        self.errors: dict[str, BaseException] = {}
        self.delay = 0.0
        self.delays: dict[str, float] = {}
        self.version = {rank: __version__ for rank in range(world_size)}
        self.pids = {rank: 1000 + rank for rank in range(world_size)}
        self.missing: set[str] = set()
        self.overrides: dict[str, Any] = {}
        self.fh = [
            {
                "available": True,
                "enabled": True,
                "n_probes": 4,
                "dense_batch_threshold": 32,
                "num_clusters": num_clusters,
                "counters": contract.FlashHeadCounters(
                    steps=10 + rank,
                    rows_flashhead=100 + rank,
                    rows_dense={"logprobs": 3, "batch_threshold": 7 + rank},
                    fallbacks=rank,
                    head_seconds=0.5 + rank,
                    stage1_exchanges=40,
                ),
            }
            for rank in range(world_size)
        ]
        self.workers = [self._worker(rank) for rank in range(world_size)]

    def _worker(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(
            rank=rank,
            local_rank=rank,
            device=f"cuda:{rank}",
            model_config=SimpleNamespace(
                model="/models/tiny", served_model_name="tiny-model", dtype="bfloat16", max_model_len=4096
            ),
            cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=1000 + rank),
            parallel_config=SimpleNamespace(world_size=self.world_size),
            scheduler_config=SimpleNamespace(max_num_seqs=256),
            my_pkg_fake_controller=FakeController(self.fh[rank]),
        )

    @property
    def methods(self) -> list[str]:
        return [c["method"] for c in self.calls]

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        self.calls.append({"method": method, "timeout": timeout, "args": args, "kwargs": kwargs})
        delay = self.delays.get(method, self.delay)
        if delay:
            await asyncio.sleep(delay)
        if method in self.errors:
            raise self.errors[method]
        if method in self.overrides:
            return self.overrides[method]
        impl = rpc.WORKER_METHODS.get(method)
        if impl is None or method in self.missing:
            raise Exception(not_implemented_text(method))
        replies = []
        for rank, worker in enumerate(self.workers):
            try:
                reply = impl(worker, *args, **(kwargs or {}))
            except Exception as exc:  # as vLLM's engine core returns a worker's failure
                raise Exception(f"Call to collective_rpc method failed: Worker failed with error '{exc}'") from exc
            replies.append(self._as_process(rank, method, reply))
        return replies

    def _as_process(self, rank: int, method: str, reply: dict[str, Any]) -> dict[str, Any]:
        """The reply as worker process `rank` of this fake would send it (its pid, host and version)."""
        if "pid" in reply:
            reply["pid"] = self.pids[rank]
        if method == contract.PING:
            reply["version"] = self.version[rank]
        if method == contract.WORKER_INFO:
            reply.update(
                hostname="node-a", plugin_version=self.version[rank], torch_version="2.13.0", vllm_version="0.32.0"
            )
        if method == contract.STATUS:
            reply["memory"] = {
                "device_allocated_bytes": 1 << 30,
                "device_reserved_bytes": 2 << 30,
                "process_rss_bytes": 3 << 30,
                "kv_cache_bytes": None,
            }
        return reply


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def fake_controllers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real worker methods find a stand-in worker's controller where the fake put it."""
    monkeypatch.setattr(rpc, "_controller", lambda worker: getattr(worker, "my_pkg_fake_controller", None))


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


class LogCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def plugin_log():
    """Records of the plugin's logger (attached directly: vLLM's logging
    config stops "vllm.*" records from reaching the root logger)."""
    collector = LogCollector()
    log = logging.getLogger("vllm.my_pkg")  # the endpoint half's loggers and the env table's
    old_level = log.level
    log.addHandler(collector)
    log.setLevel(logging.DEBUG)
    try:
        yield collector
    finally:
        log.removeHandler(collector)
        log.setLevel(old_level)


async def _make_app(
    engine: Any = None,
    *,
    api_key: list[str] | None = None,
    root_path: str = "",
    init: bool = True,
    fill_seen: bool = False,
) -> FastAPI:
    app = FastAPI(root_path=root_path)
    args = Namespace(api_key=api_key, root_path=root_path or None)
    app.state.args = args
    plugin = AdminEndpointPlugin()
    plugin.attach_router(app)
    if init:
        await plugin.init_state(engine, app.state, args)
        await _settled(app)
        calls = getattr(engine, "calls", None)
        if not fill_seen:
            # Most tests count the calls, and see the failures, their own requests cause: forget the
            # start-up snapshot and its call (tests of the start-up fill pass fill_seen=True).
            app.state.my_pkg_admin._snapshot = None
            if isinstance(calls, list):
                calls.clear()
    return app


async def _settled(app: FastAPI) -> None:
    """Let the plugin's start-up work (the first status snapshot) finish."""
    state = getattr(app.state, "my_pkg_admin", None)
    for _ in range(200):
        if not getattr(state, "_background", None) or all(t.done() for t in state._background):
            return
        await asyncio.sleep(0.005)


def _client_for(app: FastAPI, token: str | None = None, **kw: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, **kw),
        base_url="http://testserver",
        headers=headers,
    )


def _assert_error(resp: httpx.Response, status: int, type_: str | None = None) -> dict:
    """The response is a vLLM-style JSON error with the given status."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status
    assert isinstance(err["type"], str) and err["type"]
    assert "hint" in err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


@pytest.fixture
def make_app():
    """``await make_app(engine, api_key=..., root_path=..., init=...)``."""
    return _make_app


@pytest.fixture
def client_for():
    """``client_for(app, token=None)`` -> httpx.AsyncClient over ASGI."""
    return _client_for


@pytest.fixture
def assert_error():
    """``assert_error(resp, status, type_=None)`` -> the ``error`` object."""
    return _assert_error


@pytest.fixture
def fake_engine_cls():
    return FakeEngineClient


@pytest.fixture
def unknown_method_text():
    return not_implemented_text


ADMIN_TOKEN = "s3cret-admin-token-of-32-characters"


@pytest.fixture
async def app_client(monkeypatch, engine, make_app, client_for):
    """A client of an app whose admin token is ADMIN_TOKEN, sending that token."""
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN_TOKEN)
    app = await make_app(engine)
    async with client_for(app, token=ADMIN_TOKEN) as c:
        yield c


class FakeEngines:
    """`engines` engines (dp ranks 0..n-1) of `world_size` workers each, shared by any number of API servers
    (each gets a :meth:`view`), with faults to inject: the workers run the real worker methods
    (`FakeEngineClient`), their leases follow `clock` (seconds, moved by the test), and every commit that ran
    on an engine is recorded in `commits` (transaction id -> dp ranks)."""

    def __init__(self, engines: int = 2, world_size: int = 2) -> None:
        self.engines = [FakeEngineClient(world_size=world_size) for _ in range(engines)]
        self.clock = [1000.0]
        #: (method, dp_rank) -> (exception, when): the next such call fails once, "before" it runs (nothing
        #: happens on the engine) or "after" (it ran, its reply is lost).
        self.faults: dict[tuple[str, int], tuple[BaseException, str]] = {}
        self.fired: list[tuple[str, int, str]] = []
        self.commits: dict[str, set[int]] = {}
        for dp in range(engines):
            self._set_clock(dp)

    def _set_clock(self, dp: int) -> None:
        from my_pkg.engine.admin_ledger import ledger_of

        for worker in self.engines[dp].workers:
            ledger_of(worker).clock = lambda: self.clock[0]

    def restart(self, dp: int, new_pids: bool = False) -> None:
        """What a new engine process starts with: default settings, no ledger (version 0, no audit); with
        `new_pids`, its workers answer with other pids (as the API server then sees a restart)."""
        from my_pkg.engine.admin_ledger import WORKER_ATTR

        if new_pids:
            fake = self.engines[dp]
            fake.pids = {rank: pid + 100 for rank, pid in fake.pids.items()}
        for worker, fh in zip(self.engines[dp].workers, self.engines[dp].fh):
            if hasattr(worker, WORKER_ATTR):
                delattr(worker, WORKER_ATTR)
            fh.update(enabled=True, n_probes=4, dense_batch_threshold=32)
        self._set_clock(dp)

    async def call(self, dp: int, method: str, args: tuple) -> list:
        fault = self.faults.pop((method, dp), None)
        if fault is not None and fault[1] == "before":
            self.fired.append((method, dp, "before"))
            raise fault[0]
        replies = await self.engines[dp].collective_rpc(method, args=args)
        if method == contract.FLASHHEAD_COMMIT:
            self.commits.setdefault(args[1]["id"], set()).add(dp)
        if fault is not None:
            self.fired.append((method, dp, "after"))
            raise fault[0]
        return replies

    def view(self) -> EngineView:
        return EngineView(self)

    def held(self) -> list[tuple[int, int, int, tuple]]:
        """(dp_rank, rank, version, (enabled, n_probes, dense_batch_threshold)) of every worker."""
        from my_pkg.engine.admin_ledger import ledger_of

        return [
            (dp, rank, ledger_of(worker).version, (fh["enabled"], fh["n_probes"], fh["dense_batch_threshold"]))
            for dp, fake in enumerate(self.engines)
            for rank, (worker, fh) in enumerate(zip(fake.workers, fake.fh))
        ]


class EngineView:
    """One API server's engine client over `FakeEngines`, as vLLM's DP client has it; `hold[(method, dp)]`
    (an `asyncio.Event`) holds that call of this API server until it is set, `waiting` says which is held."""

    def __init__(self, engines: FakeEngines) -> None:
        self.shared = engines
        self.errored = False
        self.hold: dict[tuple[str, int], asyncio.Event] = {}
        self.waiting: set[tuple[str, int]] = set()
        n = len(engines.engines)
        self.engine_core = SimpleNamespace(
            core_engines=[dp.to_bytes(2, "little") for dp in range(n)],
            engine_ranks_managed=list(range(n)),
            call_utility_all_async=self._call_all,
            _call_utility_async=self._call_one,
        )

    async def _call(self, dp: int, method: str, args: tuple) -> list:
        gate = self.hold.get((method, dp))
        if gate is not None:
            self.waiting.add((method, dp))
            try:
                await gate.wait()
            finally:
                self.waiting.discard((method, dp))
        return await self.shared.call(dp, method, args)

    async def _call_one(self, utility: str, method: str, timeout, args, kwargs, *, engine: bytes) -> list:
        assert utility == "collective_rpc" and timeout is None
        return await self._call(self.engine_core.core_engines.index(engine), method, args)

    async def _call_all(self, utility: str, method: str, timeout, args, kwargs) -> list:
        assert utility == "collective_rpc" and timeout is None
        return list(await asyncio.gather(*(self._call(dp, method, args) for dp in range(len(self.shared.engines)))))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self._call(0, method, args)


@pytest.fixture
def fake_engines_cls():
    """``fake_engines_cls(engines=2, world_size=2)`` -> `FakeEngines` (engines shared by API servers, faults)."""
    return FakeEngines
