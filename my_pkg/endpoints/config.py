"""Environment-driven settings of the endpoint half.

Nothing here imports vLLM; my_pkg's own variables are read through the table
in `my_pkg.env`, so the module stays cheap to import in unit tests.
"""

from __future__ import annotations

import logging
import os

from my_pkg import PLUGIN_NAME, env
from my_pkg.env import plugin_disabled

# vLLM configures a handler on the "vllm" logger only (propagate=False), so a
# child of it is what makes our messages show up in the server log with
# vLLM's formatting and VLLM_LOGGING_LEVEL.
LOGGER_NAME = "vllm.my_pkg.endpoints"

logger = logging.getLogger(LOGGER_NAME)

#: URL prefix of every route of the plugin.
ROUTE_PREFIX = f"/plugins/{PLUGIN_NAME}"

#: Attribute of ``app.state`` holding the :class:`~my_pkg.endpoints.admin_state.AdminState`.
STATE_ATTR = "my_pkg_admin"

#: Entry-point name of the engine half in ``vllm.general_plugins``.
ENGINE_PLUGIN_ENTRY = "my_pkg_engine"

ENV_ADMIN_TOKEN = "MY_PKG_ADMIN_TOKEN"
ENV_READ_TOKEN = "MY_PKG_READ_TOKEN"
ENV_ALLOW_ANONYMOUS_READS = "MY_PKG_ALLOW_ANONYMOUS_READS"
ENV_DISABLE = "MY_PKG_DISABLE"
ENV_VLLM_API_KEY = "VLLM_API_KEY"
ENV_VLLM_PLUGINS = "VLLM_PLUGINS"

ENV_RPC_TIMEOUT = "MY_PKG_RPC_TIMEOUT"
DEFAULT_RPC_TIMEOUT: float = env.VARIABLES[ENV_RPC_TIMEOUT].default
ENV_STATUS_MAX_AGE = "MY_PKG_STATUS_MAX_AGE"
DEFAULT_STATUS_MAX_AGE: float = env.VARIABLES[ENV_STATUS_MAX_AGE].default


def rpc_timeout_from_env() -> float:
    """Seconds a route waits for the workers (`MY_PKG_RPC_TIMEOUT`, > 0)."""
    return env.MY_PKG_RPC_TIMEOUT


def status_max_age_from_env() -> float:
    """Oldest status snapshot a read may be served from (`MY_PKG_STATUS_MAX_AGE`, >= 0; 0 fetches every time)."""
    return env.MY_PKG_STATUS_MAX_AGE


def max_body_bytes() -> int:
    """Largest body a mutating route reads (`MY_PKG_ADMIN_MAX_BODY_BYTES`); larger ones get 413 unread."""
    return env.MY_PKG_ADMIN_MAX_BODY_BYTES


def anonymous_reads_allowed() -> bool:
    """`MY_PKG_ALLOW_ANONYMOUS_READS=1`: with no token configured, read routes answer anyone."""
    return env.MY_PKG_ALLOW_ANONYMOUS_READS


def vllm_plugins_allowlist() -> list[str] | None:
    """The ``VLLM_PLUGINS`` allowlist as vLLM parses it (None when unset)."""
    raw = os.environ.get(ENV_VLLM_PLUGINS)
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",")]


def engine_half_excluded_by_allowlist() -> bool:
    """True when ``VLLM_PLUGINS`` is set and does not name the engine half."""
    allow = vllm_plugins_allowlist()
    return allow is not None and ENGINE_PLUGIN_ENTRY not in allow


def diagnose_engine_half() -> tuple[str, str, str]:
    """Best guess, from this process's environment, of why the engine half of
    the plugin is not answering.

    Returns ``(cause, message, hint)`` where ``cause`` is one of
    ``"not_in_vllm_plugins"``, ``"disabled"`` or ``"not_loaded"``.
    """
    if engine_half_excluded_by_allowlist():
        current = os.environ.get(ENV_VLLM_PLUGINS, "")
        wanted = ",".join([p for p in (vllm_plugins_allowlist() or []) if p] + [ENGINE_PLUGIN_ENTRY])
        return (
            "not_in_vllm_plugins",
            f"The engine half of {PLUGIN_NAME} is not loaded in the workers: "
            f"{ENV_VLLM_PLUGINS}={current!r} does not include "
            f"{ENGINE_PLUGIN_ENTRY!r}.",
            f"Add {ENGINE_PLUGIN_ENTRY} to {ENV_VLLM_PLUGINS} and restart the "
            f"server, e.g. {ENV_VLLM_PLUGINS}={wanted}.",
        )
    if plugin_disabled():
        return (
            "disabled",
            f"The engine half of {PLUGIN_NAME} is disabled: {ENV_DISABLE}={os.environ.get(ENV_DISABLE)!r}.",
            f"Unset {ENV_DISABLE} (or set it to 0) and restart the server.",
        )
    return (
        "not_loaded",
        f"The engine half of {PLUGIN_NAME} is not loaded in the workers (its worker methods are unknown).",
        f"Install the same {PLUGIN_NAME} version in the environment the "
        f"workers run in, make sure the {ENGINE_PLUGIN_ENTRY} entry point is "
        f"loaded (include it in {ENV_VLLM_PLUGINS} if you set that variable), "
        "and check the worker log for plugin load errors.",
    )
