"""`@mutation(key, what)`: how a mutating route of the admin API is declared (the route class refuses one
without it). It gives the route, in one place:

* **serialisation**: one mutation per key at a time in this API server (a second answers 409 at once),
  run as a task that is never cancelled, so a caller who gives up (timeout, gone) cannot leave it half
  done; across API servers the engines' leases serialise (see `my_pkg.engine.admin_ledger`);
* **auditing**: refusals go to this server's audit log; a failure (5xx) the route did not audit itself
  is recorded as failed, and a wait that expires as pending (504, with `PENDING_NOTE`); a route that
  writes its own outcome marks its error `AUDITED` (the FlashHead update, `my_pkg.endpoints.updates`);
* **snapshot invalidation**: whatever the outcome, the status snapshot is marked stale here and on the
  sibling API servers of the node, and refreshed in the background.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from my_pkg.endpoints.admin_state import AdminState
from my_pkg.endpoints.audit import caller, record_refusal
from my_pkg.endpoints.config import ROUTE_PREFIX
from my_pkg.endpoints.errors import AdminAPIError, update_in_progress_error
from my_pkg.endpoints.route_class import MUTATION_MARK

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
#: Marks an error whose outcome its route already wrote to the audit, so that `mutation` does not again.
AUDITED = "_my_pkg_audited"
#: The `note` of a 504: the mutation goes on without its caller.
PENDING_NOTE = (
    "The engines have not answered yet, so the update's outcome is not known: it completes, or fails and "
    f"releases its leases, by itself. GET {ROUTE_PREFIX}/flashhead shows what every engine holds "
    "(`consistent`); the audit has the transaction's outcome."
)


def mutation(key: str, what: str, wait_s: Callable[[AdminState], float] | None = None) -> Callable[[F], F]:
    """Declare a mutating route (see the module docstring). The endpoint takes `request: Request` and
    `state: AdminState` (the `State` dependency) among its parameters. `wait_s(state)`: how long the caller
    waits for it (default `MY_PKG_RPC_TIMEOUT`)."""

    def decorate(endpoint: F) -> F:
        params = inspect.signature(endpoint).parameters
        if "request" not in params or "state" not in params:
            raise TypeError(f"{endpoint.__name__}: a @mutation endpoint takes `request` and `state`")

        @functools.wraps(endpoint)
        async def run(**kwargs: Any) -> Any:
            request: Request = kwargs["request"]
            state: AdminState = kwargs["state"]
            state.check_engine_alive()
            if state.in_flight.running(key):
                last = state.last_status()  # the version as last seen here: this refusal asks no engine
                error = update_in_progress_error(
                    _body_of(kwargs), holder=state.identity, version=last.settings_version if last is not None else None
                )
                record_refusal(request, error.status_code, error.message)
                raise error
            who = caller(request)
            request.state.my_pkg_caller = who

            async def work() -> Any:
                try:
                    return await endpoint(**kwargs)
                except AdminAPIError as exc:
                    if exc.status_code >= 500 and not getattr(exc, AUDITED, False):
                        state.audit.record(
                            who,
                            exc.status_code,
                            "failed",
                            reason=exc.message,
                            **{k: v for k, v in exc.extra.items() if k in ("update", "engines")},
                        )
                    raise
                finally:
                    state.invalidate_status()
                    state.refresh_status_soon()  # vLLM's /metrics gets the new values without waiting

            task = state.in_flight.start(key, work)
            try:
                return await state.wait(task, what, wait_s(state) if wait_s is not None else None)
            except AdminAPIError as exc:
                if exc.status_code == 504:
                    exc.extra.setdefault("note", PENDING_NOTE)
                    exc.extra.setdefault("transaction", who.get("transaction"))
                    state.audit.record(who, 504, "pending", reason=exc.message)
                raise

        setattr(run, MUTATION_MARK, True)
        return run  # type: ignore[return-value]

    return decorate


def _body_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request body's fields that were given, for a refusal's answer."""
    for value in kwargs.values():
        if isinstance(value, BaseModel):
            return value.model_dump(exclude_unset=True)
    return {}
