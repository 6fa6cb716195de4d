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

How reads stay cheap under polling (every RPC occupies the engine core between
two model steps):

* replies that cannot change while the engine lives (`my_pkg_ping`,
  `my_pkg_worker_info`, `my_pkg_config`) are fetched once and kept; they are
  dropped when the set of workers changes (another pid, another rank);
* everything that changes (`my_pkg_status`: memory, FlashHead state and
  counters) is fetched by one call at a time into a snapshot that reads serve
  while it is no older than `MY_PKG_STATUS_MAX_AGE` (age counted from when the
  call was sent); a FlashHead update invalidates it, so a read after a `PUT`
  sees the new settings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from my_pkg.contract import RPC_PREFIX, STATUS, WorkerStatus
from my_pkg.endpoints.audit import AuditLog
from my_pkg.endpoints.auth import TokenSet
from my_pkg.endpoints.config import DEFAULT_RPC_TIMEOUT, DEFAULT_STATUS_MAX_AGE, logger
from my_pkg.endpoints.errors import (
    AdminAPIError,
    classify_rpc_error,
    engine_dead_error,
    rpc_timeout_error,
)

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)
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


@dataclass(frozen=True)
class StatusSnapshot:
    """Every worker's `WorkerStatus`, sorted by (dp_rank, rank), and when the call for it was sent."""

    workers: tuple[WorkerStatus, ...]
    requested_at: float  # time.monotonic()

    def age(self) -> float:
        """Seconds since the call for this snapshot was sent."""
        return max(0.0, time.monotonic() - self.requested_at)

    @property
    def worker_ids(self) -> frozenset[tuple[int, int, int | None]]:
        return worker_ids(self.workers)


def worker_ids(replies: Iterable[BaseModel]) -> frozenset[tuple[int, int, int | None]]:
    """`(dp_rank, rank, pid)` of every worker that sent one of `replies`."""
    return frozenset((getattr(r, "dp_rank", 0), getattr(r, "rank", 0), getattr(r, "pid", None)) for r in replies)


class AdminHandler:
    """What ``init_state`` stores on ``app.state.my_pkg_admin``.

    Wraps the engine client so that routes only ever see validated worker
    replies or an :class:`AdminAPIError` (503 worker failure / engine half
    missing, 504 timeout). ``engine_client`` is ``None`` on the CPU-only
    render server.
    """

    def __init__(
        self,
        engine_client: EngineClient | Any | None,
        tokens: TokenSet,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        status_max_age: float = DEFAULT_STATUS_MAX_AGE,
    ) -> None:
        self.engine_client = engine_client
        self.tokens = tokens
        self.rpc_timeout = float(rpc_timeout)
        self.status_max_age = float(status_max_age)
        #: Engine-side work still running: reads keyed by what they fetch,
        #: the one FlashHead update (validate, then apply) by ``UPDATE_KEY``.
        self.in_flight = SingleFlight()
        self._warned_single_engine = False
        self.audit = AuditLog()
        #: The loop the routes run on; a metrics scrape from another thread schedules refreshes on it.
        self.loop: asyncio.AbstractEventLoop | None = _running_loop()
        self._static: dict[tuple[str, tuple[Hashable, ...]], list[Any]] = {}
        self._static_generation = 0
        self._snapshot: StatusSnapshot | None = None
        self._status_generation = 0
        self._known_workers: frozenset[tuple[int, int, int | None]] | None = None

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

    # ---- data that cannot change while the engine lives --------------------------------------

    async def static(self, method: str, model: type[R], *args: Hashable) -> list[R]:
        """The replies of ``method(*args)``, validated with ``model``: fetched once, then kept."""
        self.check_engine_alive()
        key = (method, args)
        cached = self._static.get(key)
        if cached is not None:
            return cached
        task = self.in_flight.start(("static", key, self._static_generation), lambda: self._fetch_static(key, model))
        return await self.wait(task, f"Worker RPC {method}")

    async def _fetch_static(self, key: tuple[str, tuple[Hashable, ...]], model: type[R]) -> list[R]:
        generation = self._static_generation
        method, args = key
        replies = parse_replies(method, model, await self.call_unbounded(method, *args))
        if generation == self._static_generation:  # kept even when every waiter gave up: it cannot change
            self._static[key] = replies
        return replies

    async def identity(self, method: str, model: type[R], snapshot: StatusSnapshot) -> list[R]:
        """Static replies of ``method`` from the workers of ``snapshot`` (fetched again if the workers changed)."""
        replies = await self.static(method, model)
        if worker_ids(replies) != snapshot.worker_ids:
            self.forget_static()
            replies = await self.static(method, model)
        return replies

    def forget_static(self) -> None:
        self._static.clear()
        self._static_generation += 1

    # ---- data that changes: one snapshot, one call at a time --------------------------------

    async def status(self) -> StatusSnapshot:
        """The workers' status, no older than ``status_max_age`` (fetched when it is)."""
        self.check_engine_alive()
        snapshot = self._snapshot
        if snapshot is not None and snapshot.age() <= self.status_max_age:
            return snapshot
        return await self.wait(self._refresh_status(), f"Worker RPC {STATUS}")

    def last_status(self) -> StatusSnapshot | None:
        """The latest snapshot, however old (None before the first one); never calls the workers."""
        return self._snapshot

    def refresh_status_soon(self) -> None:
        """Start fetching a new snapshot when the latest one is missing or too old; does not wait for it.

        Runs on the event loop (a metrics scrape from another thread schedules it there).
        """
        if self.engine_client is None or getattr(self.engine_client, "errored", False) is True:
            return
        snapshot = self._snapshot
        if snapshot is None or snapshot.age() > self.status_max_age:
            self._refresh_status()

    def invalidate_status(self) -> None:
        """Drop the snapshot, and any still in flight: the next read fetches the workers' status anew."""
        self._status_generation += 1
        self._snapshot = None

    def _refresh_status(self) -> asyncio.Task[StatusSnapshot]:
        return self.in_flight.start((STATUS, self._status_generation), self._fetch_status)

    async def _fetch_status(self) -> StatusSnapshot:
        generation, requested_at = self._status_generation, time.monotonic()
        workers = parse_replies(STATUS, WorkerStatus, await self.call_unbounded(STATUS))
        snapshot = StatusSnapshot(tuple(workers), requested_at)
        current = self._snapshot
        if generation == self._status_generation and (current is None or current.requested_at <= requested_at):
            self._snapshot = snapshot
        if self._known_workers is not None and snapshot.worker_ids != self._known_workers:
            logger.info("The engine's workers changed; fetching their identity and configuration again.")
            self.forget_static()
        self._known_workers = snapshot.worker_ids
        return snapshot

    # ---- the engine-side call ---------------------------------------------------------------

    async def call_unbounded(self, method: str, *args: Any) -> list[Any]:
        """The engine-side call itself: waits for as long as the workers take.

        Only run it inside a task that :meth:`wait` bounds.
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


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def parse_replies(method: str, model: type[R], replies: list[Any]) -> list[R]:
    """Every worker's reply validated with ``model``, sorted by (dp_rank, rank); 503 for any that is not valid."""
    parsed: list[R] = []
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
