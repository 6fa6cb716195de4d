"""Every environment variable my_pkg reads, in one table (as vLLM's `envs.py`).

Each entry has its name, its default, the parser of its value and one line of
documentation. Read a variable as an attribute of this module
(`from my_pkg import env; env.MY_PKG_RPC_TIMEOUT`): the environment is read at
that moment, so a test's `monkeypatch.setenv` takes effect. An unset or blank
variable gives the default; a value the parser refuses gives the default too,
with one warning per variable and value. docs/configuration.md's table is
generated from this one (`python -m my_pkg.env`), and a unit test keeps the
two, and the package's uses, in step.

Adding a variable: one `EnvVar` entry below, then regenerate the docs table.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("expected 0 or 1")


def integer(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        return value

    return parse


def integer_or(word: str, minimum: int) -> Callable[[str], int | str]:
    """An integer >= `minimum`, or `word` itself (any case)."""
    number = integer(minimum)

    def parse(raw: str) -> int | str:
        return word if raw.strip().lower() == word else number(raw)

    return parse


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw.strip())
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ValueError(
                "expected a number of seconds >= 0" if allow_zero else "expected a positive number of seconds"
            )
        return value

    return parse


def choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return value

    return parse


def backend_choice(raw: str) -> str:
    """`auto` or a registered kernel backend (`my_pkg.flashhead.kernels.backend_names`, imported when read: only
    the engine half reads it)."""
    from my_pkg.flashhead.kernels import backend_names

    return choice(*backend_names())(raw)


def secret(raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse` turns a non-blank value into the setting or raises ValueError."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    read_by: str  # "every process", "engine half" or "endpoint half"
    default_doc: str | None = None  # how the docs show the default, when it is not a plain value

    def shown_default(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        if isinstance(self.default, float) and self.default.is_integer():
            return f"`{int(self.default)}`"
        return f"`{self.default}`"


_EVERY, _ENGINE, _ENDPOINTS = "every process", "engine half", "endpoint half"

VARIABLES: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar("MY_PKG_DISABLE", False, flag, "1 leaves vLLM completely untouched", _EVERY),
        # engine half (workers)
        EnvVar("MY_PKG_FLASHHEAD", True, flag, "0 serves FlashHead models with the dense head", _ENGINE),
        EnvVar(
            "MY_PKG_FLASHHEAD_N_PROBES",
            None,
            integer(1),
            "clusters scored exactly per token at start-up",
            _ENGINE,
            default_doc="config.json `n_probes`, else the builder's default",
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_DRAFT_N_PROBES",
            None,
            integer(1),
            "clusters the drafter's FlashHead head scores exactly per draft token at start-up",
            _ENGINE,
            default_doc="the drafter's checkpoint `n_probes` (EAGLE: the target's), else the builder's default",
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD",
            None,
            integer_or("never", 0),
            "decode steps with more rows use the dense head (exact logits); `never`: none do",
            _ENGINE,
            default_doc="unset: no step goes dense for its size; a CPU head is timed at start-up to pick each step's "
            "cheaper way to FlashHead's answer",
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_PROBE_SAMPLING",
            True,
            flag,
            "0 gives sampled rows the greedy rows' logits (no estimated tail, n_probes)",
            _ENGINE,
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_SAMPLED_N_PROBES",
            None,
            integer(0),
            "clusters scored exactly for a sampled row (0: none, its estimate chooses its exact tokens)",
            _ENGINE,
            default_doc="0 (`n_probes` when the sampled rows' rank is 0 or `n_probes` is every cluster)",
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_SAMPLED_RANK",
            None,
            integer(0),
            "rank of the residual term of a sampled row's estimated logits (0: off)",
            _ENGINE,
            default_doc="the head's default",
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_BACKEND",
            "auto",
            backend_choice,
            "auto, or a registered kernel backend (torch, triton)",
            _ENGINE,
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_CLUSTER_ROWS",
            True,
            flag,
            "0: a CPU head scores its candidates from the LM head itself, without a copy of its rows in cluster order",
            _ENGINE,
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_FIDELITY_EVERY",
            100,
            integer(0),
            "one FlashHead row in N also checked against the dense head (0: off)",
            _ENGINE,
        ),
        EnvVar(
            "MY_PKG_FLASHHEAD_COMPACT_SAMPLING",
            True,
            flag,
            "0 hands FlashHead's sampled rows to vLLM's sampler as a full row instead of drawing them from the "
            "compact law",
            _ENGINE,
        ),
        EnvVar(
            "MY_PKG_FAST_TOP_P",
            True,
            flag,
            "0 keeps vLLM's CPU top-k/top-p, which sorts every row, instead of the sort-free exact one",
            _ENGINE,
        ),
        # endpoint half (API server)
        EnvVar("MY_PKG_ADMIN_TOKEN", None, secret, "bearer token of the admin role", _ENDPOINTS),
        EnvVar("MY_PKG_READ_TOKEN", None, secret, "bearer token of the read role", _ENDPOINTS),
        EnvVar(
            "MY_PKG_RPC_TIMEOUT",
            10.0,
            seconds(allow_zero=False),
            "seconds a route waits for the workers before answering 504",
            _ENDPOINTS,
        ),
        EnvVar(
            "MY_PKG_STATUS_MAX_AGE",
            1.0,
            seconds(allow_zero=True),
            "seconds a snapshot of the workers' status may be served before it is fetched again",
            _ENDPOINTS,
        ),
        EnvVar("MY_PKG_AUDIT_SIZE", 256, integer(1), "entries kept by each audit record", _EVERY),
        EnvVar(
            "MY_PKG_ALLOW_ANONYMOUS_READS",
            False,
            flag,
            "1 opens the read routes to callers without a token when no token is configured",
            _ENDPOINTS,
        ),
        EnvVar(
            "MY_PKG_ADMIN_MAX_BODY_BYTES",
            4096,
            integer(64),
            "largest request body a mutating admin route reads (larger: 413)",
            _ENDPOINTS,
        ),
    )
}

#: Name -> one-line doc of every variable (kept for callers that only need the names).
ENVIRONMENT_VARIABLES: dict[str, str] = {name: var.doc for name, var in VARIABLES.items()}


def read(name: str) -> Any:
    """The value of variable `name` now: parsed, or its default when unset, blank or invalid."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        logger.warning("my_pkg: ignoring %s=%r (%s); using the default (%s)", name, raw, exc, var.shown_default())
        return var.default


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plugin_disabled() -> bool:
    """`MY_PKG_DISABLE=1` leaves vLLM completely untouched."""
    return bool(read("MY_PKG_DISABLE"))


def markdown_table() -> str:
    """The table of docs/configuration.md, generated from `VARIABLES`."""
    lines = ["| Variable | Read by | Default | Meaning |", "|---|---|---|---|"]
    for var in VARIABLES.values():
        lines.append(f"| `{var.name}` | {var.read_by} | {var.shown_default()} | {var.doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
