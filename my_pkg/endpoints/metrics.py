"""The plugin's metrics: a `prometheus_client` collector over the workers' status snapshot.

One collector class serves both places the metrics appear:

* vLLM's own `/metrics` (the API server's process-wide registry): :func:`expose_on_registry`
  registers one collector per process, bound to the latest app's :class:`AdminState`. A
  scrape reads the handler's last snapshot, however old (its age is a gauge), and never calls
  or waits for the workers: it only schedules a background refresh when the snapshot is older
  than `MY_PKG_STATUS_MAX_AGE`, for the next scrape to read;
* `GET /plugins/my_pkg/metrics`: :func:`render` of a snapshot the route fetched (no older than
  the max age);
* vLLM's `/metrics` when it runs several API-server processes (`PROMETHEUS_MULTIPROC_DIR` set): that
  route serves only the values processes write to the multiprocess directory, so the first API server
  (client index 0) writes every new snapshot there (:class:`MultiprocessMirror`) and refreshes it in the
  background every `MIRROR_INTERVAL_S`; the others write nothing, so no counter is summed twice.

The snapshot a scrape reads is kept until the next one replaces it (an update marks it stale without
dropping it), and the first one is fetched when the plugin starts: no scrape lacks the series.

Series are labelled by `dp_rank` (the engine) and `rank` (the worker within it).
"""

from __future__ import annotations

import asyncio
import math
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from my_pkg.endpoints.admin_state import AdminState, StatusSnapshot
from my_pkg.endpoints.config import logger

#: Content type of the plugin's route: Prometheus text format 0.0.4, as vLLM's /metrics.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: Set by vLLM when it runs several API server processes: /metrics then serves multiprocess files only.
ENV_PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

#: Seconds between two background refreshes of the snapshot the multiprocess mirror writes.
MIRROR_INTERVAL_S = 5.0

_PREFIX = "my_pkg_flashhead_"
_WORKER = ("dp_rank", "rank")


def families(snapshot: StatusSnapshot | None) -> list[Metric]:
    """The metric families of ``snapshot``; without one, the families with no samples."""

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(_PREFIX + name, doc, labels=_WORKER)

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(_PREFIX + name, doc, labels=_WORKER)

    steps = counter("steps", "Decode steps that ran the LM head.")
    rows = CounterMetricFamily(
        _PREFIX + "rows",
        "Rows (tokens) through the LM head, by path (flashhead/dense) and, for dense rows, the reason "
        "FlashHead was not used.",
    )
    fallbacks = counter("fallbacks", "FlashHead calls that fell back to the dense head.")
    seconds = counter("head_seconds", "Seconds spent in the LM head.")
    fidelity_rows = counter("fidelity_rows", "FlashHead rows also checked against the dense head (live fidelity).")
    fidelity_agreed = counter("fidelity_agreed", "Checked rows whose FlashHead best token is a dense argmax.")
    fidelity_sampled = counter("fidelity_sampled_rows", "Checked rows that sample (of fidelity_rows).")
    fidelity_tv = counter(
        "fidelity_tv",
        "Sum over the checked sampled rows of the total variation distance between FlashHead's law and the dense "
        "head's at temperature 1 (divide by fidelity_sampled_rows for the mean).",
    )
    rows_verify = counter("rows_verify", "Speculative-decoding verify rows served by FlashHead (of path=flashhead).")
    rows_masked = counter(
        "rows_masked", "Rows given FlashHead's answer made from the dense product (of path=flashhead)."
    )
    rows_draft = counter(
        "rows_draft", "Speculative-decoding draft rows served by the drafter's FlashHead head (not in path=flashhead)."
    )
    exchanges = counter(
        "stage1_exchanges",
        "Tensor parallelism: decode steps on which this rank exchanged its best clusters with the other ranks.",
    )
    available = gauge("available", "1 when the model has FlashHead assets and nothing rules FlashHead out.")
    enabled = gauge("enabled", "1 when FlashHead is enabled.")
    active = gauge("active", "1 when FlashHead is in use now.")
    n_probes = gauge("n_probes", "Clusters probed per token.")
    threshold = gauge("dense_batch_threshold", "Decode steps with more rows than this use the dense head.")
    draft_n_probes = gauge("draft_n_probes", "Clusters the drafter's FlashHead head probes per draft token.")
    top_p_rows = CounterMetricFamily(
        "my_pkg_top_p_rows",
        "Rows with a top-p that vLLM's CPU sampler masked without sorting every row (MY_PKG_FAST_TOP_P).",
        labels=_WORKER,
    )
    top_p_sorted = CounterMetricFamily(
        "my_pkg_top_p_sorted_rows",
        "Of those rows, the ones whose nucleus spilled past the window: sorted.",
        labels=_WORKER,
    )
    top_p_failures = CounterMetricFamily(
        "my_pkg_top_p_failures",
        "Sampler calls where the sort-free top-p failed and vLLM's own function served the call.",
        labels=_WORKER,
    )
    compact_rows = counter("compact_rows", "Sampled rows the plugin drew from the compact law (of path=flashhead).")
    compact_bound_rows = counter(
        "compact_bound_rows", "Compact threshold rows (temperature only, min_p alone or top_p alone)."
    )
    compact_bound = counter(
        "compact_bound",
        "Sum over compact_bound_rows of each row's estimate of the mass its margin missed, over its exact set's kept "
        "mass (divide by compact_bound_rows for the mean; 0 while the margin holds).",
    )
    compact_missed = counter(
        "compact_missed_rows",
        "Compact rows vLLM's sampler drew from the exact set alone (not matched, or the draw failed).",
    )
    age = GaugeMetricFamily(
        "my_pkg_status_snapshot_age_seconds",
        "Seconds since the workers' status these metrics come from was requested.",
    )

    for worker in snapshot.workers if snapshot is not None else ():
        labels = [str(worker.dp_rank), str(worker.rank)]
        state, counters = worker.flashhead, worker.flashhead.counters
        steps.add_metric(labels, counters.steps)
        # FlashHead rows carry no `reason` label, not even an empty one.
        rows.add_sample(rows.name + "_total", dict(zip(_WORKER, labels), path="flashhead"), counters.rows_flashhead)
        for reason in sorted(counters.rows_dense):
            rows.add_sample(
                rows.name + "_total",
                dict(zip(_WORKER, labels), path="dense", reason=reason),
                counters.rows_dense[reason],
            )
        fallbacks.add_metric(labels, counters.fallbacks)
        seconds.add_metric(labels, counters.head_seconds)
        fidelity_rows.add_metric(labels, counters.fidelity_rows)
        fidelity_agreed.add_metric(labels, counters.fidelity_agreed)
        fidelity_sampled.add_metric(labels, counters.fidelity_sampled_rows)
        fidelity_tv.add_metric(labels, counters.fidelity_tv_sum)
        rows_verify.add_metric(labels, counters.rows_flashhead_verify)
        rows_masked.add_metric(labels, counters.rows_flashhead_masked)
        rows_draft.add_metric(labels, counters.rows_flashhead_draft)
        exchanges.add_metric(labels, counters.stage1_exchanges)
        compact_rows.add_metric(labels, counters.compact.rows)
        compact_bound_rows.add_metric(labels, counters.compact.bound_rows)
        compact_bound.add_metric(labels, counters.compact.bound_sum)
        compact_missed.add_metric(labels, counters.compact.unmatched_rows + counters.compact.failed_rows)
        available.add_metric(labels, state.available)
        enabled.add_metric(labels, state.enabled)
        active.add_metric(labels, state.active)
        if state.n_probes is not None:
            n_probes.add_metric(labels, state.n_probes)
        if state.dense_batch_threshold is not None:
            threshold.add_metric(labels, state.dense_batch_threshold)
        if state.spec is not None and state.spec.draft_n_probes is not None:
            draft_n_probes.add_metric(labels, state.spec.draft_n_probes)
        if worker.top_p.installed:
            top_p_rows.add_metric(labels, worker.top_p.rows)
            top_p_sorted.add_metric(labels, worker.top_p.sorted_rows)
            top_p_failures.add_metric(labels, worker.top_p.failures)
    if snapshot is not None:
        age.add_metric([], snapshot.age())
    return [
        steps,
        rows,
        fallbacks,
        seconds,
        fidelity_rows,
        fidelity_agreed,
        fidelity_sampled,
        fidelity_tv,
        rows_verify,
        rows_masked,
        rows_draft,
        exchanges,
        available,
        enabled,
        active,
        n_probes,
        threshold,
        draft_n_probes,
        top_p_rows,
        top_p_sorted,
        top_p_failures,
        compact_rows,
        compact_bound_rows,
        compact_bound,
        compact_missed,
        age,
    ]


def render(snapshot: StatusSnapshot) -> bytes:
    """``snapshot`` in Prometheus text format 0.0.4 (the body of the plugin's metrics route)."""
    return generate_latest(_SnapshotCollector(snapshot))


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: StatusSnapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return families(self._snapshot)


class ScrapeCollector(Collector):
    """The collector on the process registry: reads the bound handler's last snapshot, never waits.

    A failure here is logged once and yields no samples: it must never fail vLLM's own scrape.
    """

    def __init__(self) -> None:
        self._handler: Callable[[], AdminState | None] = lambda: None
        self._warned = False

    def bind(self, handler: AdminState) -> None:
        """Serve ``handler``'s snapshots from now on (the latest app of the process wins)."""
        self._handler = weakref.ref(handler)

    def describe(self) -> Iterable[Metric]:
        return families(None)

    def collect(self) -> Iterable[Metric]:
        try:
            handler = self._handler()
            if handler is None:
                return families(None)
            _schedule_refresh(handler)
            return families(handler.last_status())
        except Exception:  # noqa: BLE001 - a broken plugin metric must not break vLLM's /metrics
            if not self._warned:
                self._warned = True
                logger.exception("my_pkg metrics could not be collected; vLLM's /metrics goes on without them")
            return []


def _schedule_refresh(handler: AdminState) -> None:
    """Ask ``handler``'s event loop to refresh a stale snapshot; a scrape may run on another thread."""
    loop = handler.loop
    if loop is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(handler.refresh_status_soon)
    except RuntimeError:  # the loop closed in between
        pass


_SCRAPE_COLLECTOR = ScrapeCollector()
_registered: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()


#: Gauge of the multiprocess mirror: when its latest snapshot was asked for.
SNAPSHOT_TIMESTAMP = "my_pkg_status_snapshot_timestamp_seconds"


class MultiprocessMirror:
    """Writes each new snapshot into prometheus_client's multiprocess files (one writer per server).

    Counters are written as this process's value (the collector sums processes: one writer keeps the
    sum right); gauges with the `max` mode. Label sets are fixed per series as the files require.
    """

    def __init__(self) -> None:
        from prometheus_client import values

        # The process's own value class when it is the multiprocess one: one writer per file (a second
        # factory would map this process's files a second time, and two writers corrupt them).
        shared = values.ValueClass
        self._value_class = shared if getattr(shared, "_multiprocess", False) else values.MultiProcessValue()
        self._values: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], object] = {}

    def write(self, snapshot: StatusSnapshot) -> None:
        """Write `snapshot`'s series; a series written before that is not in it any more (an engine gone, a
        value now null) is set to NaN (the files cannot drop a series), and the snapshot's time is written as
        `my_pkg_status_snapshot_timestamp_seconds` (an age is only right when read)."""
        written: set[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = set()
        for family in families(snapshot):
            if family.name == "my_pkg_status_snapshot_age_seconds":
                continue  # an age is only right when read; the route serves it
            for sample in family.samples:
                names = tuple(sorted(sample.labels))
                key = (family.name, sample.name, names, tuple(sample.labels[n] for n in names))
                self._value(key, family.type, family.documentation).set(float(sample.value))
                written.add(key)
        for key, value in self._values.items():
            if key not in written and key[0] != SNAPSHOT_TIMESTAMP:
                value.set(math.nan)  # type: ignore[attr-defined]
        stamp = (SNAPSHOT_TIMESTAMP, SNAPSHOT_TIMESTAMP, (), ())
        self._value(stamp, "gauge", "When the status snapshot behind these series was asked for (Unix time).").set(
            snapshot.requested_wall_ns / 1e9
        )

    def _value(self, key: tuple[str, str, tuple[str, ...], tuple[str, ...]], kind: str, documentation: str) -> Any:
        value = self._values.get(key)
        if value is None:
            value = self._value_class(
                kind, key[0], key[1], list(key[2]), list(key[3]), documentation, multiprocess_mode="max"
            )
            self._values[key] = value
        return value


async def mirror_forever(handler: AdminState, mirror: MultiprocessMirror, interval: float = MIRROR_INTERVAL_S) -> None:
    """Refresh the snapshot in the background and write each new one to the multiprocess files."""
    written = None
    while True:
        handler.refresh_status_soon()
        snapshot = handler.last_status()
        if snapshot is not None and snapshot is not written:
            try:
                mirror.write(snapshot)
                written = snapshot
            except Exception:  # noqa: BLE001 - never let metrics kill the loop
                logger.exception("my_pkg metrics could not be written for vLLM's multiprocess /metrics")
                return
        await asyncio.sleep(min(interval, 0.5) if written is None else interval)


def expose_on_registry(handler: AdminState, registry: CollectorRegistry = REGISTRY) -> ScrapeCollector:
    """Serve ``handler``'s metrics from ``registry`` (default: the process registry vLLM's /metrics serves).

    Idempotent: the collector is registered once per registry and rebound to the latest handler. With
    several API-server processes, the first one also mirrors the snapshots into the multiprocess files.
    """
    _SCRAPE_COLLECTOR.bind(handler)
    if registry not in _registered:
        registry.register(_SCRAPE_COLLECTOR)
        _registered.add(registry)
    if registry is REGISTRY and os.environ.get(ENV_PROMETHEUS_MULTIPROC_DIR) and handler.api_server_index == 0:
        mirror = MultiprocessMirror()
        if handler.last_status() is not None:  # written before the server serves its first scrape
            mirror.write(handler.last_status())
        handler.start_background(mirror_forever(handler, mirror))
        logger.info(
            "my_pkg metrics are written to %s for vLLM's multiprocess /metrics (every %g s).",
            ENV_PROMETHEUS_MULTIPROC_DIR,
            MIRROR_INTERVAL_S,
        )
    return _SCRAPE_COLLECTOR


__all__ = ["CONTENT_TYPE", "ScrapeCollector", "expose_on_registry", "families", "render"]
