"""The sibling API servers' update marker, and the multiprocess /metrics mirror (second admin review, #11, #13)."""

from __future__ import annotations

import math
import os
import tempfile
import time

from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from my_pkg import contract
from my_pkg.endpoints.admin_state import StatusSnapshot, UpdateMarker


def test_without_sibling_api_servers_there_is_no_marker_file(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    marker = UpdateMarker("port8000")
    before = set(os.listdir(tempfile.gettempdir()))
    marker.touch()
    assert marker.path is None and not marker.changed_since(0)
    assert {name for name in set(os.listdir(tempfile.gettempdir())) - before if "my_pkg-admin" in name} == set()


def test_siblings_share_the_marker_in_vllms_private_run_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    one, two = UpdateMarker("port8000"), UpdateMarker("port8000")
    asked = time.time_ns()
    assert not two.changed_since(asked)
    one.touch()
    assert two.changed_since(asked) and os.path.dirname(two.path) == str(tmp_path)
    assert os.stat(one.path).st_mode & 0o777 == 0o600
    assert not UpdateMarker("port9000").changed_since(asked)  # another server's port


def test_a_marker_that_is_a_link_is_never_followed(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    marker = UpdateMarker("port8000")
    elsewhere = tmp_path / "planted"
    elsewhere.write_text(str(2**62))  # a far-future time: every read would go to the engines
    os.symlink(elsewhere, marker.path)
    assert not marker.changed_since(time.time_ns())
    marker.touch()  # replaces the link itself, never writes through it
    assert not os.path.islink(marker.path) and elsewhere.read_text() == str(2**62)


def _worker(dp: int, n_probes: int | None, available: bool = True) -> contract.WorkerStatus:
    state = contract.FlashHeadState(
        available=available,
        active=available,
        enabled=True,
        n_probes=n_probes,
        counters=contract.FlashHeadCounters(steps=100, rows_flashhead=1000, rows_dense={"logprobs": 5}),
    )
    return contract.WorkerStatus(rank=0, dp_rank=dp, pid=100 + dp, flashhead=state)


def _scrape(path: str) -> dict[str, float]:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    found = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("my_pkg_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_the_multiprocess_mirror_withdraws_series_that_left_the_snapshot(monkeypatch, tmp_path):
    """Review 2 #11 (r6): an engine scaled away, or a value now null, no longer shows its last value."""
    from my_pkg.endpoints.metrics import MultiprocessMirror

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    mirror = MultiprocessMirror()
    mirror.write(StatusSnapshot((_worker(0, 8), _worker(1, 8)), 0.0, requested_wall_ns=1_000 * 10**9))
    first = _scrape(str(tmp_path))
    assert first['my_pkg_flashhead_n_probes{dp_rank="1",rank="0"}'] == 8
    assert first["my_pkg_status_snapshot_timestamp_seconds"] == 1000.0
    mirror.write(StatusSnapshot((_worker(0, None, available=False),), 1.0, requested_wall_ns=1_005 * 10**9))
    later = _scrape(str(tmp_path))
    assert math.isnan(later['my_pkg_flashhead_n_probes{dp_rank="1",rank="0"}'])
    assert math.isnan(later['my_pkg_flashhead_steps_total{dp_rank="1",rank="0"}'])
    assert math.isnan(later['my_pkg_flashhead_n_probes{dp_rank="0",rank="0"}'])  # now null
    assert later['my_pkg_flashhead_steps_total{dp_rank="0",rank="0"}'] == 100
    assert later["my_pkg_status_snapshot_timestamp_seconds"] == 1005.0
