"""Parsing of my_pkg's environment variables, shared by both halves (see docs/configuration.md)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(f"vllm.{__name__}")

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
