"""Data parallelism: every route covers every engine core, and an update lands on all or none."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.anyio

TOKEN = "s3cret"


class FakeDPEngineClient:
    """Two engines behind one API server, as vLLM's DP client has them: `collective_rpc`
    reaches engine 0 only; `engine_core.call_utility_all_async` reaches each."""

    def __init__(self, fake_engine_cls) -> None:
        self.engines = [fake_engine_cls(world_size=2), fake_engine_cls(world_size=2)]
        self.errored = False
        self.engine_core = SimpleNamespace(
            core_engines=[b"\x00\x00", b"\x01\x00"],
            engine_ranks_managed=[0, 1],
            call_utility_all_async=self._call_all,
            _call_utility_async=self._call_one,
        )

    async def _one(self, dp_rank: int, method: str, args: tuple) -> list:
        return await self.engines[dp_rank].collective_rpc(method, args=args)

    async def _call_one(self, utility: str, method: str, timeout, args, kwargs, *, engine: bytes) -> list:
        assert utility == "collective_rpc" and timeout is None
        return await self._one(self.engine_core.core_engines.index(engine), method, args)

    async def _call_all(self, utility: str, method: str, timeout, args, kwargs) -> list:
        assert utility == "collective_rpc" and timeout is None
        return list(await asyncio.gather(*(self._one(dp, method, args) for dp in range(2))))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self._one(0, method, args)


@pytest.fixture
async def dp_client(monkeypatch, fake_engine_cls, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    engine = FakeDPEngineClient(fake_engine_cls)
    app = await make_app(engine)
    async with client_for(app, token=TOKEN) as c:
        yield c, engine


async def test_reads_list_every_worker_of_every_engine(dp_client):
    c, _ = dp_client
    workers = (await c.get("/plugins/my_pkg/workers")).json()
    assert workers["num_workers"] == 4
    assert [(w["dp_rank"], w["rank"]) for w in workers["workers"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    statuses = (await c.get("/plugins/my_pkg/flashhead")).json()["workers"]
    assert [s["dp_rank"] for s in statuses] == [0, 0, 1, 1]


async def test_an_update_lands_on_every_engine(dp_client):
    c, engine = dp_client
    r = await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 7})
    assert r.status_code == 200, r.text
    assert r.json()["num_workers"] == 4
    assert [fh["n_probes"] for e in engine.engines for fh in e.fh] == [7, 7, 7, 7]


async def test_an_update_one_engine_rejects_lands_nowhere(dp_client, assert_error):
    c, engine = dp_client
    engine.engines[1].fh[0]["num_clusters"] = 4  # n_probes 7 > 4 clusters on DP rank 1 only
    err = assert_error(await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 7}), 409, "invalid_update")
    assert [(e["dp_rank"], e["rank"]) for e in err["errors"]] == [(1, 0)]
    assert [fh["n_probes"] for e in engine.engines for fh in e.fh] == [4, 4, 4, 4]
    assert all("my_pkg_flashhead_apply" not in e.methods for e in engine.engines)


async def test_hybrid_lb_labels_with_the_real_ranks_and_says_other_nodes_were_not_touched(
    monkeypatch, fake_engine_cls, make_app, client_for
):
    """Node 2 of a hybrid/external-LB deployment: its API server manages engines 2 and 3 only."""
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    engine = FakeDPEngineClient(fake_engine_cls)
    engine.engine_core.engine_ranks_managed = [2, 3]
    engine.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(local_engines_only=True))
    app = await make_app(engine)
    async with client_for(app, token=TOKEN) as c:
        statuses = (await c.get("/plugins/my_pkg/flashhead")).json()["workers"]
        assert [s["dp_rank"] for s in statuses] == [2, 2, 3, 3]
        metrics = (await c.get("/plugins/my_pkg/metrics")).text
        assert 'dp_rank="3"' in metrics and 'dp_rank="0"' not in metrics
        answer = (await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 5})).json()
    assert answer["engines"] == [2, 3] and answer["other_nodes_untouched"] is True
    assert [w["dp_rank"] for w in answer["workers"]] == [2, 2, 3, 3]


async def test_engines_are_prepared_in_ascending_rank_before_any_commit(dp_client):
    c, engine = dp_client
    order = []
    for dp, fake in enumerate(engine.engines):
        real = fake.collective_rpc

        async def recording(method, timeout=None, args=(), kwargs=None, _dp=dp, _real=real):
            order.append((method, _dp))
            return await _real(method, timeout=timeout, args=args, kwargs=kwargs)

        fake.collective_rpc = recording
    assert (await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 7})).status_code == 200
    updates = [o for o in order if o[0] != "my_pkg_status"]
    assert updates == [
        ("my_pkg_flashhead_prepare", 0),
        ("my_pkg_flashhead_prepare", 1),
        ("my_pkg_flashhead_commit", 0),
        ("my_pkg_flashhead_commit", 1),
    ]
