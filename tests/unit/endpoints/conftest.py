"""Fixtures for the endpoint-half unit tests: a fake engine client and an app.

Helpers are handed out as fixtures (not imported) so that the tests work
under any pytest import mode."""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from my_pkg import PLUGIN_NAME, __version__, contract
from my_pkg.endpoints import AdminEndpointPlugin
from my_pkg.endpoints.config import LOGGER_NAME

ENV_VARS = (
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


class FakeEngineClient:
    """Stands in for vLLM's EngineClient: ``collective_rpc`` answers the my_pkg worker
    methods with one reply per worker, built from the contract's models as the engine half does."""

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
                ),
            }
            for rank in range(world_size)
        ]

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
        self.calls.append(
            {"method": method, "timeout": timeout, "args": args, "kwargs": kwargs}
        )
        delay = self.delays.get(method, self.delay)
        if delay:
            await asyncio.sleep(delay)
        if method in self.errors:
            raise self.errors[method]
        if method in self.overrides:
            return self.overrides[method]
        impl = getattr(self, "_" + method, None)
        if impl is None or method in self.missing:
            raise Exception(not_implemented_text(method))
        return [impl(rank, *args, **(kwargs or {})).model_dump(mode="json") for rank in range(self.world_size)]

    # ---- the engine half, one contract model per method ----------------
    def _my_pkg_ping(self, rank: int) -> contract.PingReply:
        return contract.PingReply(plugin=PLUGIN_NAME, version=self.version[rank], rank=rank, pid=self.pids[rank])

    def _my_pkg_worker_info(self, rank: int) -> contract.WorkerIdentity:
        return contract.WorkerIdentity(
            rank=rank, local_rank=rank, world_size=self.world_size,
            pid=self.pids[rank], hostname="node-a", device=f"cuda:{rank}",
            plugin_version=self.version[rank], torch_version="2.13.0", vllm_version="0.32.0",
            model=contract.ModelInfo(name="tiny-model", path="/models/tiny", dtype="bfloat16", max_model_len=4096),
            kv_cache=contract.KVCacheInfo(block_size=16, num_blocks=1000 + rank),
        )

    def _my_pkg_config(self, rank: int, section: str) -> contract.WorkerConfig:
        if section not in contract.CONFIG_SECTIONS:
            raise ValueError(f"unknown section {section}")
        return contract.WorkerConfig(rank=rank, section=section, config={"max_num_seqs": 256})

    def _flashhead_state(self, rank: int) -> contract.FlashHeadState:
        fh = self.fh[rank]
        return contract.FlashHeadState(
            available=fh["available"], active=fh["available"] and fh["enabled"],
            reason=None if fh["available"] else "model has no FlashHead assets",
            reason_code=None if fh["available"] else "no_assets",
            enabled=fh["enabled"],
            num_clusters=fh["num_clusters"] if fh["available"] else None,
            cluster_size=64, vocab_size=32000, n_probes=fh["n_probes"],
            dense_batch_threshold=fh["dense_batch_threshold"], probe_sampling=True,
            pinned_token_ids=[2], fidelity_every=100,
            backend="torch", extra_memory_bytes=1234, counters=fh["counters"],
        )

    def _my_pkg_status(self, rank: int) -> contract.WorkerStatus:
        return contract.WorkerStatus(
            rank=rank, pid=self.pids[rank],
            memory=contract.MemoryInfo(device_allocated_bytes=1 << 30, device_reserved_bytes=2 << 30,
                                       process_rss_bytes=3 << 30, kv_cache_bytes=None),
            flashhead=self._flashhead_state(rank),
        )

    def _my_pkg_flashhead_status(self, rank: int) -> contract.FlashHeadStatus:
        return self._my_pkg_status(rank).flashhead_status()

    def _my_pkg_flashhead_validate(self, rank: int, update: dict) -> contract.ValidationReply:
        fh = self.fh[rank]
        errors = contract.update_errors(update)
        if not fh["available"]:
            errors.append("FlashHead is not available on this model")
        n = update.get("n_probes")
        if n is not None and n > fh["num_clusters"]:
            errors.append(f"n_probes={n} exceeds num_clusters={fh['num_clusters']}")
        return contract.ValidationReply(rank=rank, errors=errors)

    def _my_pkg_flashhead_apply(self, rank: int, update: dict) -> contract.FlashHeadStatus:
        self.fh[rank].update(contract.FlashHeadUpdate.model_validate(update).to_update())
        return self._my_pkg_flashhead_status(rank)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


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
) -> FastAPI:
    app = FastAPI(root_path=root_path)
    args = Namespace(api_key=api_key, root_path=root_path or None)
    app.state.args = args
    plugin = AdminEndpointPlugin()
    plugin.attach_router(app)
    if init:
        await plugin.init_state(engine, app.state, args)
    return app


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


ADMIN_TOKEN = "s3cret"


@pytest.fixture
async def app_client(monkeypatch, engine, make_app, client_for):
    """A client of an app whose admin token is ADMIN_TOKEN, sending that token."""
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", ADMIN_TOKEN)
    app = await make_app(engine)
    async with client_for(app, token=ADMIN_TOKEN) as c:
        yield c
