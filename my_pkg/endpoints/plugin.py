"""The ``vllm.endpoint_plugins`` entry point: :class:`AdminEndpointPlugin`."""

from __future__ import annotations

from argparse import Namespace
from typing import TYPE_CHECKING, Any

from my_pkg import PLUGIN_NAME, __version__
from my_pkg.endpoints.auth import resolve_tokens
from my_pkg.endpoints.client import AdminHandler
from my_pkg.endpoints.config import (
    ENV_ADMIN_TOKEN,
    ROUTE_PREFIX,
    STATE_ATTR,
    engine_half_excluded_by_allowlist,
    logger,
    rpc_timeout_from_env,
    status_max_age_from_env,
)
from my_pkg.endpoints.metrics import expose_on_registry
from my_pkg.endpoints.routes import router

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
        handler = AdminHandler(engine_client, tokens, rpc_timeout_from_env(), status_max_age_from_env())
        setattr(state, STATE_ATTR, handler)
        if engine_client is not None:
            try:  # onto the registry vLLM's /metrics serves
                expose_on_registry(handler)
            except Exception:  # noqa: BLE001 - the admin API and vLLM's metrics work without ours
                logger.exception("my_pkg metrics could not be added to the Prometheus registry")

        if engine_client is None:
            logger.info(
                "%s admin routes at %s/*: no engine on this server, every route "
                "will answer 503.",
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
        if not tokens.configured:
            logger.warning(
                "No admin token configured: the read-only %s routes under %s are "
                "open to anyone who can reach this server, and mutating routes "
                "answer 403. Set %s (or start vLLM with --api-key) to require a "
                "bearer token.",
                PLUGIN_NAME,
                ROUTE_PREFIX,
                ENV_ADMIN_TOKEN,
            )
        if engine_client is not None and engine_half_excluded_by_allowlist():
            logger.warning(
                "VLLM_PLUGINS does not include my_pkg_engine: the engine half of "
                "%s will not load in the workers and %s/health will answer 503.",
                PLUGIN_NAME,
                ROUTE_PREFIX,
            )
