"""The ``vllm.endpoint_plugins`` entry point: :class:`AdminEndpointPlugin`."""

from __future__ import annotations

import functools
from argparse import Namespace
from typing import TYPE_CHECKING, Any

from my_pkg import PLUGIN_NAME, __version__
from my_pkg.endpoints.admin_state import AdminState
from my_pkg.endpoints.auth import resolve_tokens, warn_about
from my_pkg.endpoints.config import (
    ENV_ADMIN_TOKEN,
    ENV_ALLOW_ANONYMOUS_READS,
    ROUTE_PREFIX,
    STATE_ATTR,
    anonymous_reads_allowed,
    engine_half_excluded_by_allowlist,
    logger,
    rpc_timeout_from_env,
    status_max_age_from_env,
)
from my_pkg.endpoints.metrics import expose_on_registry
from my_pkg.endpoints.routes import router
from my_pkg.endpoints.updates import catch_up

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.datastructures import State
    from vllm.engine.protocol import EngineClient
    from vllm.tasks import SupportedTask


class AdminEndpointPlugin:
    """Admin API of my_pkg, mounted under ``/plugins/my_pkg``.

    Satisfies vLLM's ``EndpointPlugin`` protocol.  ``required_tasks`` is
    ``None`` so that the plugin also loads on the CPU-only render server,
    where every route answers 503 (no engine) instead of the path being
    unknown.
    """

    name: str = PLUGIN_NAME
    required_tasks: tuple[SupportedTask, ...] | None = None

    def attach_router(self, app: FastAPI) -> None:
        """Register the routes; touches neither the engine nor app.state."""
        app.include_router(router)

    async def init_state(
        self,
        engine_client: EngineClient | Any | None,
        state: State,
        args: Namespace | Any | None,
    ) -> None:
        tokens = resolve_tokens(args)
        port = getattr(args, "port", None)
        handler = AdminState(
            engine_client,
            tokens,
            rpc_timeout_from_env(),
            status_max_age_from_env(),
            # The API servers of one `vllm serve` share its port: the key of their update marker.
            marker_key=f"port{port}" if isinstance(port, int) else None,
            request_id_headers=getattr(args, "enable_request_id_headers", False) is True,
        )
        setattr(state, STATE_ATTR, handler)
        # A restarted or newly joined engine is brought to the settings in force once a snapshot shows it.
        handler.on_workers_changed = functools.partial(catch_up, handler)
        warn_about(tokens)
        if engine_client is not None:
            # The first snapshot before the server serves (the engines are ready by now; a few ms), so the
            # first scrape of vLLM's /metrics has the series; retried in the background if it failed.
            if not await handler.fill_at_start(attempts=1):
                handler.start_background(handler.fill_at_start())
            try:  # onto the registry vLLM's /metrics serves
                expose_on_registry(handler)
            except Exception:  # noqa: BLE001 - the admin API and vLLM's metrics work without ours
                logger.exception("my_pkg metrics could not be added to the Prometheus registry")

        if engine_client is None:
            logger.info(
                "%s admin routes at %s/*: no engine on this server, every route will answer 503.",
                PLUGIN_NAME,
                ROUTE_PREFIX,
            )
        else:
            logger.info(
                "%s %s admin routes at %s/* (RPC timeout %g s, status max age %g s, auth: %s).",
                PLUGIN_NAME,
                __version__,
                ROUTE_PREFIX,
                handler.rpc_timeout,
                handler.status_max_age,
                ", ".join(tokens.sources) if tokens.configured else "none",
            )
        if not tokens.configured and anonymous_reads_allowed():
            logger.warning(
                "No admin token configured and %s=1: the read-only %s routes under %s "
                "(topology, configuration) are open to anyone who can reach this server; "
                "mutating routes answer 403. Set %s to require a bearer token.",
                ENV_ALLOW_ANONYMOUS_READS,
                PLUGIN_NAME,
                ROUTE_PREFIX,
                ENV_ADMIN_TOKEN,
            )
        elif not tokens.configured:
            logger.warning(
                "No admin token configured: every %s route under %s but /health answers 403. "
                "Set %s (or %s=1 to open the read routes).",
                PLUGIN_NAME,
                ROUTE_PREFIX,
                ENV_ADMIN_TOKEN,
                ENV_ALLOW_ANONYMOUS_READS,
            )
        if engine_client is not None and engine_half_excluded_by_allowlist():
            logger.warning(
                "VLLM_PLUGINS does not include my_pkg_engine: the engine half of "
                "%s will not load in the workers and %s/health will answer 503.",
                PLUGIN_NAME,
                ROUTE_PREFIX,
            )
