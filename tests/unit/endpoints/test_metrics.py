"""GET /plugins/my_pkg/metrics: Prometheus text exposition format 0.0.4."""

from __future__ import annotations

import re

import pytest

from my_pkg.endpoints.metrics import escape_label_value, format_value, render_metrics
from my_pkg.endpoints.models import FlashHeadStatus

pytestmark = pytest.mark.anyio

TOKEN = "s3cret"

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
_SAMPLE_RE = re.compile(
    rf"^(?P<name>{_NAME})(?:\{{(?P<labels>{_LABEL}(?:,{_LABEL})*)?\}})?"
    r" (?P<value>[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|Inf|NaN))$"
)
_HELP_RE = re.compile(rf"^# HELP (?P<name>{_NAME}) (?P<text>.*)$")
_TYPE_RE = re.compile(
    rf"^# TYPE (?P<name>{_NAME}) (?P<type>counter|gauge|histogram|summary|untyped)$"
)
_LABEL_PAIR_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def parse_exposition(text: str) -> tuple[dict, dict]:
    """Strict parser: returns ({name: type}, {(name, frozenset(labels)): value})."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: dict = {}
    current = None
    for line in text.splitlines():
        assert line, "no blank lines expected"
        if line.startswith("#"):
            if m := _HELP_RE.match(line):
                assert m["name"] not in helps
                helps.add(m["name"])
                current = m["name"]
                continue
            m = _TYPE_RE.match(line)
            assert m, f"bad comment line: {line!r}"
            assert m["name"] == current, "TYPE must follow its HELP, before samples"
            assert m["name"] not in types
            types[m["name"]] = m["type"]
            continue
        m = _SAMPLE_RE.match(line)
        assert m, f"bad sample line: {line!r}"
        name = m["name"]
        assert name == current, f"sample {name} outside its family"
        labels = frozenset(
            (k, _unescape(v)) for k, v in _LABEL_PAIR_RE.findall(m["labels"] or "")
        )
        key = (name, labels)
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(m["value"].replace("Inf", "inf"))
    assert set(types) == helps
    return types, samples


def L(dp_rank="0", **kw):  # noqa: N802 - every series is labelled by the worker's DP rank and rank
    return frozenset({"dp_rank": dp_rank, **kw}.items())


async def test_metrics_route(monkeypatch, engine, make_app, client_for):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    app = await make_app(engine)
    async with client_for(app, token=TOKEN) as c:
        r = await c.get("/plugins/my_pkg/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = parse_exposition(r.text)
    assert types["my_pkg_flashhead_rows_total"] == "counter"
    assert types["my_pkg_flashhead_steps_total"] == "counter"
    assert types["my_pkg_flashhead_fallbacks_total"] == "counter"
    assert types["my_pkg_flashhead_head_seconds_total"] == "counter"
    assert types["my_pkg_flashhead_active"] == "gauge"
    assert types["my_pkg_flashhead_n_probes"] == "gauge"
    for rank in (0, 1):
        r_ = str(rank)
        assert samples[("my_pkg_flashhead_steps_total", L(rank=r_))] == 10 + rank
        assert samples[("my_pkg_flashhead_rows_total", L(rank=r_, path="flashhead"))] == 100 + rank
        assert samples[("my_pkg_flashhead_rows_total",
                        L(rank=r_, path="dense", reason="logprobs"))] == 3
        assert samples[("my_pkg_flashhead_rows_total",
                        L(rank=r_, path="dense", reason="large_batch"))] == 7 + rank
        assert samples[("my_pkg_flashhead_fallbacks_total", L(rank=r_))] == rank
        assert samples[("my_pkg_flashhead_head_seconds_total", L(rank=r_))] == 0.5 + rank
        assert samples[("my_pkg_flashhead_active", L(rank=r_))] == 1
        assert samples[("my_pkg_flashhead_n_probes", L(rank=r_))] == 4
    assert 'my_pkg_flashhead_rows_total{dp_rank="0",rank="0",path="flashhead"} 100' in r.text.splitlines()


async def test_metrics_errors_are_json(monkeypatch, engine, make_app, client_for, assert_error):
    monkeypatch.setenv("MY_PKG_ADMIN_TOKEN", TOKEN)
    app = await make_app(engine)
    engine.errors["my_pkg_flashhead_status"] = RuntimeError("x")
    async with client_for(app, token=TOKEN) as c:
        assert_error(await c.get("/plugins/my_pkg/metrics"), 503)


def _status(rank=0, **kw):
    base = {"rank": rank, "available": True, "active": False, "enabled": True,
            "n_probes": None, "dense_batch_threshold": 0,
            "counters": {"steps": 0, "rows_flashhead": 0, "rows_dense": {},
                         "fallbacks": 0, "head_seconds": 0.0}}
    base.update(kw)
    return FlashHeadStatus.model_validate(base)


def test_label_values_are_escaped():
    reason = 'we"ird\\reason\nwith newline'
    st = _status(counters={"steps": 1, "rows_flashhead": 2, "rows_dense": {reason: 5},
                           "fallbacks": 0, "head_seconds": 1e-9})
    text = render_metrics([st])
    _, samples = parse_exposition(text)
    assert samples[("my_pkg_flashhead_rows_total",
                    L(rank="0", path="dense", reason=reason))] == 5
    assert '\\"' in text and "\\\\" in text and "\\n" in text
    assert samples[("my_pkg_flashhead_head_seconds_total", L(rank="0"))] == 1e-9
    # n_probes unknown -> no sample (but the family is still described)
    assert not any(k[0] == "my_pkg_flashhead_n_probes" for k in samples)


def test_metrics_empty_and_values():
    types, samples = parse_exposition(render_metrics([]))
    assert samples == {} and "my_pkg_flashhead_steps_total" in types
    assert escape_label_value('a"b') == 'a\\"b'
    assert format_value(True) == "1" and format_value(False) == "0"
    assert format_value(float("nan")) == "NaN" and format_value(float("inf")) == "+Inf"
    assert format_value(3) == "3" and format_value(0.25) == "0.25"
