"""The engine-side call of the admin API: worker RPCs to every engine or one, bounded waits, parsed replies.

How a worker RPC is waited for (why: a late reply must never reach vLLM):
vLLM's executor matches RPC replies to calls by order, not by id, so when its
own `collective_rpc` timeout expires the worker's late reply is read as the
answer to the *next* call, which can be a model step and kills the engine.
The plugin therefore never passes a timeout to vLLM. The engine-side call runs
until the workers answer (or the engine dies, which fails it); the API server
bounds only its own wait (`MY_PKG_RPC_TIMEOUT`, 504 when it expires) and drops
the late result itself. Identical read calls in flight are coalesced
(single-flight, :class:`SingleFlight`), so a stalled worker does not pile up
RPCs behind it.

Engines: the API server talks to the engines vLLM's client manages
(`engine_ranks_managed`): every engine under internal load balancing, only
this node's under hybrid or external load balancing. Replies are labelled with
those real data-parallel ranks, and every reply is validated with the
contract's model of its method (:func:`parse_replies`); a failed call is an
:class:`~my_pkg.endpoints.errors.AdminAPIError` (`my_pkg.endpoints.rpc_failures`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from my_pkg.contract import WORKER_METHOD_REPLIES, WORKER_METHODS_CONTRACT
from my_pkg.endpoints.config import DEFAULT_RPC_TIMEOUT, logger
from my_pkg.endpoints.errors import no_engine_error, unexpected_reply_error
from my_pkg.endpoints.rpc_failures import classify_rpc_error, engine_dead_error, rpc_timeout_error

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

T = TypeVar("T")
R = TypeVar("R", bound=BaseModel)


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


class WorkerClient:
    """The engine client as the admin API calls it: worker RPCs whose waits are bounded and whose failures
    are :class:`~my_pkg.endpoints.errors.AdminAPIError` (503 worker failure / engine half missing / engine
    dead, 504 timeout). ``engine_client`` is ``None`` on the CPU-only render server."""

    def __init__(self, engine_client: EngineClient | Any | None, rpc_timeout: float = DEFAULT_RPC_TIMEOUT) -> None:
        self.engine_client = engine_client
        self.rpc_timeout = float(rpc_timeout)
        self._warned_single_engine = False

    @property
    def has_engine(self) -> bool:
        return self.engine_client is not None

    def check_engine_alive(self) -> None:
        """503 at once when vLLM already knows its engine is dead."""
        if self.engine_client is None:
            raise no_engine_error()
        if getattr(self.engine_client, "errored", False) is True:
            raise engine_dead_error()

    async def wait(self, task: asyncio.Task[T], what: str, timeout: float | None = None) -> T:
        """Wait at most ``timeout`` (default ``rpc_timeout``) for ``task`` without ever cancelling it."""
        bound = self.rpc_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=bound)
        except asyncio.TimeoutError as exc:
            if task.done():
                # It finished in the tick the wait expired: its own outcome (an applied update stays applied).
                return task.result()
            raise rpc_timeout_error(what, bound) from exc

    def engine_ranks(self) -> list[int]:
        """The data-parallel ranks of the engines this API server manages, ascending (vLLM's order)."""
        core = getattr(self.engine_client, "engine_core", None)
        engines = getattr(core, "core_engines", None)
        ranks = getattr(core, "engine_ranks_managed", None)
        if isinstance(engines, list) and engines:
            if isinstance(ranks, (list, tuple, range)) and len(ranks) == len(engines):
                return [int(r) for r in ranks]
            return list(range(len(engines)))
        if isinstance(ranks, (list, tuple, range)) and len(ranks) >= 1:
            return [int(ranks[0])]
        return [0]

    @property
    def local_engines_only(self) -> bool:
        """True under hybrid or external DP load balancing: other nodes' engines are not reachable from here."""
        config = getattr(getattr(self.engine_client, "vllm_config", None), "parallel_config", None)
        return getattr(config, "local_engines_only", False) is True

    async def call_unbounded(self, method: str, *args: Any, engine: int | None = None) -> list[Any]:
        """The engine-side call itself: waits for as long as the workers take.

        ``engine``: the index (in :meth:`engine_ranks`) of the one engine to call; None calls every engine.
        Only run it inside a task that :meth:`wait` bounds.
        """
        declared = WORKER_METHODS_CONTRACT.get(method)
        if declared is None or len(args) > len(declared.arguments):  # programming error guard
            raise ValueError(f"{method} with {len(args)} argument(s) is not in the contract (WORKER_METHODS_CONTRACT)")
        try:
            if engine is None:
                result = await self._every_engine(method, tuple(args))
            else:
                result = await self._one_engine(engine, method, tuple(args))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = classify_rpc_error(exc, method, self.rpc_timeout)
            logger.warning("Worker RPC %s failed (%s): %s", method, error.status_code, exc)
            raise error from exc
        if not isinstance(result, (list, tuple)):
            raise unexpected_reply_error(method, f"expected a list of per-worker results, got {type(result).__name__}")
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
        ranks = self.engine_ranks()
        if isinstance(engines, list) and len(engines) > 1 and callable(call_all):
            # One list per engine, in the order of `core_engines`, i.e. of `engine_ranks_managed`.
            per_engine = await call_all("collective_rpc", method, None, args, None)
            return [_labelled(reply, dp_rank) for dp_rank, replies in zip(ranks, per_engine) for reply in replies]
        if isinstance(engines, list) and len(engines) > 1 and not self._warned_single_engine:
            self._warned_single_engine = True
            logger.warning(
                "This vLLM has %d engines but no way to call them all; admin calls reach the first engine only.",
                len(engines),
            )
        replies = await self.engine_client.collective_rpc(method, args=args)
        if not isinstance(replies, (list, tuple)):
            return replies  # refused by the caller as an unexpected reply
        return [_labelled(reply, ranks[0]) for reply in replies]

    async def _one_engine(self, index: int, method: str, args: tuple[Any, ...]) -> list[Any]:
        """`collective_rpc` on the engine at ``index`` of :meth:`engine_ranks` only (every worker of it)."""
        core = getattr(self.engine_client, "engine_core", None)
        engines = getattr(core, "core_engines", None)
        call_one = getattr(core, "_call_utility_async", None)
        dp_rank = self.engine_ranks()[index]
        if isinstance(engines, list) and len(engines) > 1:
            if not callable(call_one):
                raise RuntimeError("this vLLM's engine client cannot call one engine of several")
            replies = await call_one("collective_rpc", method, None, args, None, engine=engines[index])
        else:
            replies = await self.engine_client.collective_rpc(method, args=args)
        if not isinstance(replies, (list, tuple)):
            return replies
        return [_labelled(reply, dp_rank) for reply in replies]


def _labelled(reply: Any, dp_rank: int) -> Any:
    return {**reply, "dp_rank": dp_rank} if isinstance(reply, Mapping) else reply


def parse_replies(method: str, model: type[R], replies: list[Any]) -> list[R]:
    """Every worker's reply validated with ``model``, sorted by (dp_rank, rank); 503 for any that is not valid.
    ``model`` must be the contract's reply model of ``method`` (`WORKER_METHOD_REPLIES`)."""
    if WORKER_METHOD_REPLIES.get(method) is not model:
        raise TypeError(f"{method} replies with {WORKER_METHOD_REPLIES.get(method)}, not {model.__name__}")
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
                f"worker #{index} returned an invalid reply: {exc.error_count()} error(s), first: {_first_error(exc)}",
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
