"""The plugin's metrics: rendered by prometheus_client, on the plugin's route and on a process registry."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from my_pkg import contract
from my_pkg.endpoints.admin_state import StatusSnapshot
from my_pkg.endpoints.metrics import expose_on_registry, render

pytestmark = pytest.mark.anyio

TOKEN = "s3cret"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``text``, parsed by prometheus_client's own parser: {(name, labels): value}."""
    found: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in found, f"duplicate sample {key}"
            found[key] = sample.value
    return found


def types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def L(dp_rank="0", **labels):  # noqa: N802 - every series is labelled by the worker's DP rank and rank
    return frozenset({"dp_rank": dp_rank, **labels}.items())


@pytest.fixture
async def app(monkeypatch, engine, make_app):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    return await make_app(engine)


async def test_metrics_route(app, client_for):
    async with client_for(app, token=TOKEN) as c:
        r = await c.get("/plugins/my_pkg/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert types(r.text) == {
        **{
            f"my_pkg_flashhead_{name}": "counter"
            for name in (
                "steps",
                "rows",
                "fallbacks",
                "head_seconds",
                "fidelity_rows",
                "fidelity_agreed",
                "fidelity_sampled_rows",
                "fidelity_tv",
                "rows_verify",
                "rows_masked",
                "rows_draft",
                "stage1_exchanges",
                "compact_rows",
                "compact_bound_rows",
                "compact_bound",
                "compact_missed_rows",
            )
        },
        **{
            f"my_pkg_flashhead_{name}": "gauge"
            for name in ("available", "enabled", "active", "n_probes", "dense_batch_threshold", "draft_n_probes")
        },
        **{f"my_pkg_top_p_{name}": "counter" for name in ("rows", "sorted_rows", "failures")},
        "my_pkg_status_snapshot_age_seconds": "gauge",
    }
    found = samples(r.text)
    for rank in (0, 1):
        r_ = str(rank)
        assert found[("my_pkg_flashhead_steps_total", L(rank=r_))] == 10 + rank
        assert found[("my_pkg_flashhead_rows_total", L(rank=r_, path="flashhead"))] == 100 + rank
        assert found[("my_pkg_flashhead_rows_total", L(rank=r_, path="dense", reason="logprobs"))] == 3
        assert found[("my_pkg_flashhead_rows_total", L(rank=r_, path="dense", reason="batch_threshold"))] == 7 + rank
        assert found[("my_pkg_flashhead_fallbacks_total", L(rank=r_))] == rank
        assert found[("my_pkg_flashhead_head_seconds_total", L(rank=r_))] == 0.5 + rank
        assert found[("my_pkg_flashhead_stage1_exchanges_total", L(rank=r_))] == 40
        assert found[("my_pkg_flashhead_active", L(rank=r_))] == 1
        assert found[("my_pkg_flashhead_n_probes", L(rank=r_))] == 4
        assert found[("my_pkg_flashhead_dense_batch_threshold", L(rank=r_))] == 32
    assert 0 <= found[("my_pkg_status_snapshot_age_seconds", frozenset())] < 1
    # FlashHead rows carry no `reason` label at all (not an empty one); the library sorts label names.
    assert 'my_pkg_flashhead_rows_total{dp_rank="0",path="flashhead",rank="0"} 100.0' in r.text.splitlines()


async def test_metrics_errors_are_json(app, engine, client_for, assert_error):
    engine.errors["my_pkg_status"] = RuntimeError("x")
    async with client_for(app, token=TOKEN) as c:
        assert_error(await c.get("/plugins/my_pkg/metrics"), 503, "worker_error")


def _snapshot(**flashhead) -> StatusSnapshot:
    state = {"available": True, "active": False, "enabled": True, "n_probes": None, **flashhead}
    worker = contract.WorkerStatus(rank=0, pid=1, flashhead=contract.FlashHeadState.model_validate(state))
    return StatusSnapshot((worker,), time.monotonic())


def test_label_values_are_escaped_and_unknown_settings_omitted():
    reason = 'we"ird\\reason\nwith newline'
    text = render(_snapshot(counters={"rows_dense": {reason: 5}, "head_seconds": 1e-9})).decode()
    found = samples(text)
    assert found[("my_pkg_flashhead_rows_total", L(rank="0", path="dense", reason=reason))] == 5
    assert '\\"' in text and "\\\\" in text and "\\n" in text
    assert found[("my_pkg_flashhead_head_seconds_total", L(rank="0"))] == 1e-9
    # n_probes unknown -> no sample, but the family is still described
    assert not any(name == "my_pkg_flashhead_n_probes" for name, _ in found)
    assert "# TYPE my_pkg_flashhead_n_probes gauge" in text


def test_a_flashhead_drafter_has_its_rows_and_probe_count():
    spec = {
        "method": "draft_model",
        "verify": {"active": True},
        "draft": {"active": True},
        "draft_n_probes": 12,
    }
    found = samples(render(_snapshot(counters={"rows_flashhead_draft": 7}, spec=spec)).decode())
    assert found[("my_pkg_flashhead_rows_draft_total", L(rank="0"))] == 7
    assert found[("my_pkg_flashhead_draft_n_probes", L(rank="0"))] == 12
    without = samples(render(_snapshot()).decode())
    assert not any(name == "my_pkg_flashhead_draft_n_probes" for name, _ in without)


def test_compact_rows_have_their_rows_bound_and_missed_rows():
    compact = {"rows": 40, "bound_rows": 10, "bound_sum": 0.25, "unmatched_rows": 2, "failed_rows": 1}
    found = samples(render(_snapshot(counters={"compact": compact})).decode())
    assert found[("my_pkg_flashhead_compact_rows_total", L(rank="0"))] == 40
    assert found[("my_pkg_flashhead_compact_bound_rows_total", L(rank="0"))] == 10
    assert found[("my_pkg_flashhead_compact_bound_total", L(rank="0"))] == 0.25
    assert found[("my_pkg_flashhead_compact_missed_rows_total", L(rank="0"))] == 3


def test_the_sort_free_top_p_has_its_rows_where_it_is_in_place():
    snapshot = _snapshot()
    counted = contract.TopPCounters(installed=True, calls=3, rows=24, sorted_rows=2, failures=1)
    worker = snapshot.workers[0].model_copy(update={"top_p": counted})
    found = samples(render(StatusSnapshot((worker,), time.monotonic())).decode())
    assert found[("my_pkg_top_p_rows_total", L(rank="0"))] == 24
    assert found[("my_pkg_top_p_sorted_rows_total", L(rank="0"))] == 2
    assert found[("my_pkg_top_p_failures_total", L(rank="0"))] == 1
    without = samples(render(snapshot).decode())  # not in place (off, or a GPU build): no series
    assert not any(name.startswith("my_pkg_top_p_") for name, _ in without)


# ------------------------------------------------------- the process registry (vLLM's /metrics)
@pytest.fixture
def registry():
    return CollectorRegistry()


async def test_a_scrape_reads_the_last_snapshot_and_never_waits_for_the_workers(app, engine, registry):
    handler = app.state.my_pkg_admin
    expose_on_registry(handler, registry)
    engine.delay = 5.0  # a stalled worker
    started = time.monotonic()
    first = generate_latest(registry).decode()
    assert time.monotonic() - started < 0.5
    assert not any(name.startswith("my_pkg_flashhead_steps") for name, _ in samples(first))
    assert engine.calls == []  # nothing sent while the scrape ran...
    await asyncio.sleep(0.05)
    assert engine.methods == ["my_pkg_status"]  # ...but it asked for a refresh, sent once the scrape was over
    engine.delay = 0.0
    handler.invalidate_status()  # drop the stalled refresh: the next one answers at once
    generate_latest(registry)
    await asyncio.sleep(0.05)
    found = samples(generate_latest(registry).decode())
    assert found[("my_pkg_flashhead_steps_total", L(rank="1"))] == 11
    assert found[("my_pkg_status_snapshot_age_seconds", frozenset())] < 1


async def test_a_scrape_on_another_thread_schedules_the_refresh_on_the_loop(app, engine, registry):
    expose_on_registry(app.state.my_pkg_admin, registry)
    await asyncio.to_thread(generate_latest, registry)
    for _ in range(100):
        if app.state.my_pkg_admin.last_status() is not None:
            break
        await asyncio.sleep(0.01)
    assert engine.methods == ["my_pkg_status"]
    assert samples(generate_latest(registry).decode())[("my_pkg_flashhead_active", L(rank="0"))] == 1


async def test_a_fresh_snapshot_is_not_fetched_again_by_scrapes(app, engine, registry, client_for):
    expose_on_registry(app.state.my_pkg_admin, registry)
    async with client_for(app, token=TOKEN) as c:
        assert (await c.get("/plugins/my_pkg/flashhead")).status_code == 200
    for _ in range(5):
        generate_latest(registry)
    await asyncio.sleep(0.05)
    assert engine.methods == ["my_pkg_status"]


async def test_registration_is_idempotent_and_follows_the_latest_app(
    monkeypatch, fake_engine_cls, make_app, registry, client_for
):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    apps = []
    for world_size in (1, 3):
        app = await make_app(fake_engine_cls(world_size=world_size))
        expose_on_registry(app.state.my_pkg_admin, registry)
        expose_on_registry(app.state.my_pkg_admin, registry)
        apps.append(app)
    async with client_for(apps[1], token=TOKEN) as c:
        assert (await c.get("/plugins/my_pkg/flashhead")).status_code == 200
    text = generate_latest(registry).decode()
    assert text.count("# TYPE my_pkg_flashhead_steps_total counter") == 1
    ranks = {dict(labels)["rank"] for name, labels in samples(text) if name == "my_pkg_flashhead_steps_total"}
    assert ranks == {"0", "1", "2"}


async def test_the_plugin_registers_on_the_process_registry_once(app, make_app, client_for):
    from prometheus_client import REGISTRY

    second = await make_app(app.state.my_pkg_admin.engine_client)
    async with client_for(second, token=TOKEN) as c:
        assert (await c.get("/plugins/my_pkg/flashhead")).status_code == 200
    text = generate_latest(REGISTRY).decode()
    assert text.count("# TYPE my_pkg_flashhead_steps_total counter") == 1
    assert samples(text)[("my_pkg_flashhead_n_probes", L(rank="1"))] == 4


async def test_a_failing_collector_leaves_the_rest_of_the_scrape_alone(app, registry, plugin_log, monkeypatch):
    from prometheus_client import Counter

    Counter("other_requests", "Another library's counter.", registry=registry).inc()
    handler = app.state.my_pkg_admin
    collector = expose_on_registry(handler, registry)
    monkeypatch.setattr(collector, "_warned", False)

    def broken():
        raise KeyError("oops")

    monkeypatch.setattr(handler, "last_status", broken)
    for _ in range(2):
        found = samples(generate_latest(registry).decode())
        assert found[("other_requests_total", frozenset())] == 1
        assert not any(name.startswith("my_pkg_") for name, _ in found)
    failures = [m for m in plugin_log.messages(logging.ERROR) if "metrics could not be collected" in m]
    assert len(failures) == 1  # logged once, not on every scrape


async def test_the_first_scrape_after_start_up_has_the_series(monkeypatch, engine, make_app, registry):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    app = await make_app(engine, fill_seen=True)  # init_state fetched the first snapshot in the background
    expose_on_registry(app.state.my_pkg_admin, registry)
    found = samples(generate_latest(registry).decode())
    assert found[("my_pkg_flashhead_steps_total", L(rank="0"))] == 10


async def test_the_scrape_after_a_put_still_has_the_series(app, engine, registry, client_for):
    expose_on_registry(app.state.my_pkg_admin, registry)
    engine.delays["my_pkg_status"] = 0.2  # the refresh after the PUT is still on its way at the scrape
    async with client_for(app, token=TOKEN) as c:
        assert (await c.get("/plugins/my_pkg/flashhead")).status_code == 200
        assert (await c.put("/plugins/my_pkg/flashhead", json={"n_probes": 9})).status_code == 200
    during = samples(generate_latest(registry).decode())
    assert during[("my_pkg_flashhead_n_probes", L(rank="0"))] == 4  # the last snapshot, not a gap
    await asyncio.sleep(0.3)
    after = samples(generate_latest(registry).decode())
    assert after[("my_pkg_flashhead_n_probes", L(rank="0"))] == 9


def test_the_multiprocess_mirror_writes_what_vllms_multiprocess_metrics_serve(monkeypatch, tmp_path):
    """With several API servers vLLM's /metrics reads prometheus_client's multiprocess files only."""
    from prometheus_client import multiprocess

    from my_pkg.endpoints.metrics import MultiprocessMirror

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    mirror = MultiprocessMirror()
    mirror.write(_snapshot(n_probes=4, dense_batch_threshold=16))
    mirror.write(_snapshot(n_probes=6, dense_batch_threshold=16))  # a later snapshot replaces the values
    served = CollectorRegistry()
    multiprocess.MultiProcessCollector(served, path=str(tmp_path))
    text = generate_latest(served).decode()
    found = samples(text)
    assert found[("my_pkg_flashhead_n_probes", L(rank="0"))] == 6
    assert types(text)["my_pkg_flashhead_steps"] == "counter"
    assert ("my_pkg_flashhead_steps_total", L(rank="0")) in found


def test_the_grafana_dashboard_queries_only_series_the_plugin_exports():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[3] / "docs/grafana/my_pkg-dashboard.json").read_text())
    queried = {
        match
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for match in re.findall(r"\bmy_pkg_[a-z_]+", target["expr"])
    }
    text = render(_snapshot(n_probes=4, dense_batch_threshold=16)).decode()
    exported = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    assert queried and queried <= exported, queried - exported
