"""Prometheus text exposition (format 0.0.4) of the FlashHead counters."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from my_pkg.endpoints.models import FlashHeadStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_PREFIX = "my_pkg_flashhead_"


def escape_label_value(value: str) -> str:
    """Escape a label value: backslash, double quote and line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Escape HELP text: backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


class _Family:
    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name = _PREFIX + name
        self.kind = kind
        self.help = help_text
        self.samples: list[tuple[str, float | int | bool]] = []

    def add(self, labels: Sequence[tuple[str, str]], value: float | int | bool) -> None:
        self.samples.append((_labels(labels), value))

    def render(self) -> list[str]:
        lines = [
            f"# HELP {self.name} {escape_help(self.help)}",
            f"# TYPE {self.name} {self.kind}",
        ]
        lines.extend(f"{self.name}{lbl} {format_value(v)}" for lbl, v in self.samples)
        return lines


def render_metrics(statuses: Sequence[FlashHeadStatus]) -> str:
    """Render the per-worker FlashHead status as Prometheus text."""
    steps = _Family("steps_total", "counter", "Decode steps that ran the LM head.")
    rows = _Family(
        "rows_total",
        "counter",
        "Rows (tokens) through the LM head, by path (flashhead/dense) and, "
        "for dense rows, the reason FlashHead was not used.",
    )
    fallbacks = _Family(
        "fallbacks_total", "counter", "FlashHead calls that fell back to the dense head."
    )
    seconds = _Family(
        "head_seconds_total", "counter", "Seconds spent in the LM head."
    )
    fidelity_rows = _Family(
        "fidelity_rows_total", "counter",
        "FlashHead rows also checked against the dense head (live fidelity telemetry).",
    )
    fidelity_agreed = _Family(
        "fidelity_agreed_total", "counter",
        "Checked rows whose FlashHead best token is a dense argmax.",
    )
    available = _Family(
        "available", "gauge", "1 when the model has FlashHead assets and the head was built."
    )
    enabled = _Family("enabled", "gauge", "1 when FlashHead is enabled.")
    active = _Family("active", "gauge", "1 when FlashHead is in use now.")
    n_probes = _Family("n_probes", "gauge", "Clusters probed per token.")
    threshold = _Family(
        "dense_batch_threshold",
        "gauge",
        "Batches with more rows than this use the dense head.",
    )

    for status in statuses:
        rank = ("rank", str(status.rank))
        worker = [("dp_rank", str(status.dp_rank)), rank]
        c = status.counters
        steps.add(worker, c.steps)
        rows.add([*worker, ("path", "flashhead")], c.rows_flashhead)
        for reason in sorted(c.rows_dense):
            rows.add([*worker, ("path", "dense"), ("reason", reason)], c.rows_dense[reason])
        fallbacks.add(worker, c.fallbacks)
        seconds.add(worker, float(c.head_seconds))
        fidelity_rows.add(worker, c.fidelity_rows)
        fidelity_agreed.add(worker, c.fidelity_agreed)
        available.add(worker, status.available)
        enabled.add(worker, status.enabled)
        active.add(worker, status.active)
        if status.n_probes is not None:
            n_probes.add(worker, status.n_probes)
        if status.dense_batch_threshold is not None:
            threshold.add(worker, status.dense_batch_threshold)

    lines: list[str] = []
    for family in (
        steps, rows, fallbacks, seconds, fidelity_rows, fidelity_agreed, available, enabled,
        active, n_probes, threshold,
    ):
        lines.extend(family.render())
    return "\n".join(lines) + "\n"
