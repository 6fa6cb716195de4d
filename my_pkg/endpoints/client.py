"""Per-app state of the plugin: the engine client, tokens and RPC settings.

How a worker RPC is waited for (why: a late reply must never reach vLLM):
vLLM's executor matches RPC replies to calls by order, not by id, so when its
own `collective_rpc` timeout expires the worker's late reply is read as the
answer to the *next* call, which can be a model step and kills the engine.
The plugin therefore never passes a timeout to vLLM. The engine-side call runs
until the workers answer (or the engine dies, which fails it); the API server
bounds only its own wait (`MY_PKG_RPC_TIMEOUT`, 504 when it expires) and drops
the late result itself. Identical read calls in flight are coalesced
(single-flight), so a stalled worker does not pile up RPCs behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from my_pkg.endpoints.audit import AuditLog
from my_pkg.endpoints.auth import TokenSet
from my_pkg.endpoints.config import DEFAULT_RPC_TIMEOUT, logger
from my_pkg.endpoints.errors import (
    AdminAPIError,
    classify_rpc_error,
    engine_dead_error,
    rpc_timeout_error,
)

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

#: Prefix of every worker method of the engine half.
RPC_PREFIX = "my_pkg_"

T = TypeVar("T")
UPDATE_KEY = "flashhead_update"


class SingleFlight:
    """At most one running task per key; callers wait for it with their own bound.

    A caller that gives up (timeout, client gone) never cancels the task: it
    runs to completion and its result is dropped if nobody waits any more.
    """

    def __init__(self) -> None:
        self._tasks: dict[Hashable, asyncio.Task[Any]] = {}

    def running(self, key: Hashable) -> bool:
        task = self._tasks.get(key)
        return task is not None and not task.done()

    def start(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> asyncio.Task[T]:
        """The running task for `key`, or a new one made by `make()`."""
        task = self._tasks.get(key)
        if task is None or task.done():
            task = asyncio.ensure_future(make())
            self._tasks[key] = task
            task.add_done_callback(lambda done: self._forget(key, done))
        return task

    def _forget(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled():
            task.exception()  # retrieved here, so an abandoned failure is not logged as unhandled

    def __len__(self) -> int:
        return sum(not task.done() for task in self._tasks.values())


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
        #: Engine-side work still running: read calls keyed by (method, args),
        #: the one FlashHead update (validate, then apply) by ``UPDATE_KEY``.
        self.in_flight = SingleFlight()
        self._warned_single_engine = False
        self.audit = AuditLog()

    @property
    def has_engine(self) -> bool:
        return self.engine_client is not None

    def check_engine_alive(self) -> None:
        """503 at once when vLLM already knows its engine is dead."""
        if self.engine_client is None:
            raise no_engine_error()
        if getattr(self.engine_client, "errored", False) is True:
            raise engine_dead_error()

    async def wait(self, task: asyncio.Task[T], what: str) -> T:
        """Wait at most ``rpc_timeout`` for ``task`` without ever cancelling it."""
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=self.rpc_timeout)
        except asyncio.TimeoutError as exc:
            if task.done():
                raise  # the task's own failure, already an AdminAPIError
            raise rpc_timeout_error(what, self.rpc_timeout) from exc

    async def call(self, method: str, *args: Hashable) -> list[Any]:
        """``collective_rpc(method, args)``: bounded wait here, none in vLLM.

        An identical call already in flight is joined instead of sending
        another one, so only side-effect-free methods go through here.
        """
        self.check_engine_alive()
        task = self.in_flight.start((method, args), lambda: self.call_unbounded(method, *args))
        return await self.wait(task, f"Worker RPC {method}")

    async def call_unbounded(self, method: str, *args: Any) -> list[Any]:
        """The engine-side call itself: waits for as long as the workers take.

        Only run it inside a task that :meth:`wait` bounds (see :meth:`call`).
        """
        if not method.startswith(RPC_PREFIX):  # programming error guard
            raise ValueError(f"not a {RPC_PREFIX}* worker method: {method}")
        try:
            result = await self._every_engine(method, tuple(args))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = classify_rpc_error(exc, method, self.rpc_timeout)
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

    async def _every_engine(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """`collective_rpc` on every engine core: one reply per worker of every DP rank.

        vLLM's `EngineClient.collective_rpc` reaches only the first engine under
        data parallelism; its engine-core client's `call_utility_all_async`
        reaches each. No `timeout=` in either: see the module docstring.
        """
        core = getattr(self.engine_client, "engine_core", None)
        engines = getattr(core, "core_engines", None)
        call_all = getattr(core, "call_utility_all_async", None)
        if isinstance(engines, list) and len(engines) > 1 and callable(call_all):
            # One list per engine, in the order of `core_engines`: the data-parallel ranks.
            per_engine = await call_all("collective_rpc", method, None, args, None)
            return [
                {**reply, "dp_rank": dp_rank} if isinstance(reply, Mapping) else reply
                for dp_rank, replies in enumerate(per_engine)
                for reply in replies
            ]
        if isinstance(engines, list) and len(engines) > 1 and not self._warned_single_engine:
            self._warned_single_engine = True
            logger.warning(
                "This vLLM has %d engines but no way to call them all; admin calls reach "
                "the first engine only.", len(engines),
            )
        return await self.engine_client.collective_rpc(method, args=args)

    async def call_parsed(self, method: str, model: type[BaseModel], *args: Hashable) -> list[Any]:
        """Like :meth:`call`, validating every worker's reply with ``model``
        and returning them sorted by rank."""
        return parse_replies(method, model, await self.call(method, *args))


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
        parsed.sort(key=lambda p: (getattr(p, "dp_rank", 0), p.rank))
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
