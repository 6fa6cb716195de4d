"""Per-app state of the plugin: the engine client, tokens and RPC settings."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from my_pkg.endpoints.auth import TokenSet
from my_pkg.endpoints.config import DEFAULT_RPC_TIMEOUT, logger
from my_pkg.endpoints.errors import AdminAPIError, classify_rpc_error

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

#: Prefix of every worker method of the engine half.
RPC_PREFIX = "my_pkg_"


def guard_timeout(timeout_s: float) -> float:
    """Outer ``asyncio.wait_for`` bound: a little above the engine-side one,
    so that the executor's own timeout (with its clearer message) normally
    fires first."""
    return timeout_s + min(timeout_s, 2.0)


class AdminHandler:
    """What ``init_state`` stores on ``app.state.my_pkg_admin``.

    Wraps the engine client so that routes only ever see per-worker dicts or
    an :class:`AdminAPIError` (503 worker failure / engine half missing, 504
    timeout).  ``engine_client`` is ``None`` on the CPU-only render server.
    """

    def __init__(
        self,
        engine_client: EngineClient | Any | None,
        tokens: TokenSet,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    ) -> None:
        self.engine_client = engine_client
        self.tokens = tokens
        self.rpc_timeout = float(rpc_timeout)
        # Serialises validate+apply sequences so that two updates cannot
        # interleave between validation and application.
        self.update_lock = asyncio.Lock()

    @property
    def has_engine(self) -> bool:
        return self.engine_client is not None

    async def call(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc(method, args)`` with a bounded timeout."""
        if not method.startswith(RPC_PREFIX):  # programming error guard
            raise ValueError(f"not a {RPC_PREFIX}* worker method: {method}")
        if self.engine_client is None:
            raise no_engine_error()
        timeout = self.rpc_timeout
        try:
            result = await asyncio.wait_for(
                self.engine_client.collective_rpc(
                    method, timeout=timeout, args=tuple(args)
                ),
                timeout=guard_timeout(timeout),
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = classify_rpc_error(exc, method, timeout)
            logger.warning(
                "Worker RPC %s failed (%s): %s", method, error.status_code, exc
            )
            raise error from exc
        if not isinstance(result, (list, tuple)):
            raise unexpected_reply_error(
                method, f"expected a list of per-worker results, got {type(result).__name__}"
            )
        if not result:
            raise unexpected_reply_error(method, "no worker answered")
        return list(result)

    async def call_parsed(self, method: str, model: type[BaseModel], *args: Any) -> list[Any]:
        """Like :meth:`call`, validating every worker's reply with ``model``
        and returning them sorted by rank."""
        replies = await self.call(method, *args)
        return parse_replies(method, model, replies)


def parse_replies(method: str, model: type[BaseModel], replies: list[Any]) -> list[Any]:
    parsed = []
    for index, reply in enumerate(replies):
        if not isinstance(reply, Mapping):
            raise unexpected_reply_error(
                method,
                f"worker #{index} returned {type(reply).__name__}, expected a dict",
            )
        try:
            parsed.append(model.model_validate(dict(reply)))
        except ValidationError as exc:
            raise unexpected_reply_error(
                method,
                f"worker #{index} returned an invalid reply: "
                f"{exc.error_count()} error(s), first: {_first_error(exc)}",
            ) from exc
    if parsed and all(hasattr(p, "rank") for p in parsed):
        parsed.sort(key=lambda p: p.rank)
    return parsed


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return str(exc)
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{loc}: {first.get('msg', '')}"


def no_engine_error() -> AdminAPIError:
    return AdminAPIError(
        503,
        "This server has no engine (e.g. the CPU-only render server), so the "
        "my_pkg admin routes cannot reach any worker.",
        type="engine_unavailable",
        hint="Use the admin routes on a vLLM server that runs a model.",
    )


def not_initialised_error() -> AdminAPIError:
    return AdminAPIError(
        503,
        "The my_pkg admin plugin is not initialised yet (init_state has not run).",
        type="engine_unavailable",
        hint="Retry once the server has finished starting up.",
    )


def unexpected_reply_error(method: str, detail: str) -> AdminAPIError:
    return AdminAPIError(
        503,
        f"Unexpected reply from worker RPC {method}: {detail}",
        type="unexpected_reply",
        hint=(
            "The engine half and the endpoint half of my_pkg probably differ in "
            "version; install the same version everywhere and restart."
        ),
        method=method,
    )
