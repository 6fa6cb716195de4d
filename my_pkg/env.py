"""Parsing of my_pkg's environment variables, shared by both halves (see docs/configuration.md)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(f"vllm.{__name__}")

#: Every environment variable my_pkg reads, one line each; docs/configuration.md has the details
#: (a unit test keeps the package, this table and that page in step).
ENVIRONMENT_VARIABLES: dict[str, str] = {
    # every vLLM process
    "MY_PKG_DISABLE": "1 leaves vLLM completely untouched",
    # engine half (workers)
    "MY_PKG_FLASHHEAD": "0 serves FlashHead models with the dense head",
    "MY_PKG_FLASHHEAD_N_PROBES": "clusters scored exactly per token at start-up",
    "MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD": "when set, decode steps with more rows use the dense head (unset: never)",
    "MY_PKG_FLASHHEAD_PROBE_SAMPLING": "0 gives sampled rows the greedy rows' logits (no estimated tail, n_probes)",
    "MY_PKG_FLASHHEAD_SAMPLED_N_PROBES": "clusters scored exactly for a sampled row (default follows n_probes)",
    "MY_PKG_FLASHHEAD_SAMPLED_RANK": "rank of the residual term of a sampled row's estimated logits (0: off)",
    "MY_PKG_FLASHHEAD_BACKEND": "auto, torch or triton",
    "MY_PKG_FLASHHEAD_FIDELITY_EVERY": "one FlashHead row in N also checked against the dense head",
    # endpoint half (API server)
    "MY_PKG_ADMIN_TOKEN": "bearer token of the admin role",
    "MY_PKG_READ_TOKEN": "bearer token of the read role",
    "MY_PKG_RPC_TIMEOUT": "seconds a route waits for the workers before answering 504",
    "MY_PKG_STATUS_MAX_AGE": "seconds a snapshot of the workers' status may be served before it is fetched again",
    "MY_PKG_AUDIT_SIZE": "entries kept by the audit log ring",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(name: str, default: bool) -> bool:
    """Read a boolean variable; an unrecognised value keeps the default (with a warning)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    logger.warning("my_pkg: ignoring %s=%r (expected 0 or 1); using %s", name, raw, int(default))
    return default


def env_int(name: str, default: int | None, minimum: int = 0) -> int | None:
    """Read an integer variable >= `minimum`; anything else keeps the default (with a warning)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        logger.warning(
            "my_pkg: ignoring %s=%r (expected an integer >= %d); using %s",
            name, raw, minimum, default,
        )
        return default
    return value


def plugin_disabled() -> bool:
    """`MY_PKG_DISABLE=1` leaves vLLM completely untouched."""
    return env_flag("MY_PKG_DISABLE", False)
