"""Mutations of the admin API: the `@mutation` decorator and the FlashHead update transaction.

`@mutation(key, what)` is how a mutating route is declared (the route class refuses one without it). It
gives the route, in one place:

* **serialisation**: one mutation per key at a time in this API server (a second answers 409 at once),
  run as a task that is never cancelled, so a caller who gives up (timeout, gone) cannot leave it half
  done; across API servers the engines' leases serialise (see `my_pkg.engine.admin_state`);
* **auditing**: refusals and this server's outcomes (pending, failed) go to its audit log, the engines
  keep what they applied or rejected;
* **snapshot invalidation**: whatever the outcome, the status snapshot is marked stale here and on the
  sibling API servers of the node, and refreshed in the background.

`update_flashhead` is the transaction (one truth for every API server, the engines):

1. **prepare** the engines one by one in ascending data-parallel rank: each worker validates the update
   and takes its lease for this transaction, or answers why not (invalid here, busy, version mismatch);
2. on any refusal, **abort** on the engines already prepared (their entry records the rejection);
3. **commit** on every engine: apply, set the version to one above the highest seen, keep the audit
   entry, release the lease. Taking the engines in one order means that of two concurrent updates,
   from any API servers, exactly one wins and the other is refused with 409, holding nothing.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from my_pkg.contract import (
    AUDIT,
    FLASHHEAD_ABORT,
    FLASHHEAD_COMMIT,
    FLASHHEAD_PREPARE,
    AuditEntry,
    AuditReply,
    CommitReply,
    PrepareReply,
    Transaction,
)
from my_pkg.endpoints.audit import caller, record_refusal
from my_pkg.endpoints.client import AdminState, parse_replies
from my_pkg.endpoints.config import logger
from my_pkg.endpoints.errors import (
    PARTIAL_APPLY_NOTE,
    PENDING_NOTE,
    AdminAPIError,
    flashhead_unavailable_error,
    invalid_update_error,
    update_in_progress_error,
    version_conflict_error,
)
from my_pkg.endpoints.route_class import MUTATION_MARK

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
#: Seconds a worker's lease lasts at least; longer when the API server waits longer for the workers.
MIN_LEASE_S = 30.0


def mutation(key: str, what: str) -> Callable[[F], F]:
    """Declare a mutating route (see the module docstring). The endpoint takes `request: Request` and
    `state: AdminState` (the `State` dependency) among its parameters."""

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
                    if exc.status_code >= 500:
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
                return await state.wait(task, what)
            except AdminAPIError as exc:
                if exc.status_code == 504:
                    exc.extra["note"] = PENDING_NOTE
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


# ---- the FlashHead update ---------------------------------------------------------------------------


def lease_seconds(state: AdminState) -> float:
    return max(MIN_LEASE_S, 3 * state.rpc_timeout)


def parse_if_match(value: str | None) -> int | None:
    """The settings version of an `If-Match` header (`7` or `"7"`); None when absent or `*`."""
    if value is None or value.strip() in ("", "*"):
        return None
    text = value.strip().removeprefix("W/").strip('"')
    return int(text)  # ValueError: the route answers 422


async def update_flashhead(
    state: AdminState, update: dict[str, Any], who: dict[str, Any], expected_version: int | None = None
) -> tuple[list[CommitReply], int, list[int]]:
    """Prepare, then commit `update` on every engine this API server manages (see the module docstring).

    Returns every worker's status after the commit, the new settings version, and the engines' dp ranks.
    """
    ranks = state.engine_ranks()
    txn = Transaction(
        id=uuid.uuid4().hex, holder=state.identity, lease_s=lease_seconds(state), expected_version=expected_version
    )
    entry = {k: v for k, v in who.items() if v is not None}
    entry.update(transaction=txn.id, update=update, engines=ranks)
    prepared: list[int] = []
    replies: list[PrepareReply] = []
    try:
        for index, _ in enumerate(ranks):
            engine_replies = parse_replies(
                FLASHHEAD_PREPARE,
                PrepareReply,
                await state.call_unbounded(FLASHHEAD_PREPARE, update, txn.model_dump(), engine=index),
            )
            if any(r.granted for r in engine_replies):
                prepared.append(index)
            replies.extend(engine_replies)
            if not all(r.granted for r in engine_replies):
                error = _refusal(update, replies, expected_version)
                await _abort(
                    state,
                    txn,
                    prepared,
                    {
                        **entry,
                        "time": _now(),
                        "status_code": error.status_code,
                        "result": "rejected",
                        "reason": error.message,
                        "before": _before(replies),
                    },
                )
                raise error
    except AdminAPIError as exc:
        if exc.status_code >= 500 and prepared:  # an engine failed mid-way: release what we hold
            await _abort(state, txn, prepared, None)
        raise
    new_version = max(r.version for r in replies) + 1
    commit_txn = txn.model_copy(update={"new_version": new_version})
    record = {**entry, "time": _now(), "status_code": 200, "result": "applied", "before": _before(replies)}
    statuses: list[CommitReply] = []
    for index, _ in enumerate(ranks):
        try:
            statuses.extend(
                parse_replies(
                    FLASHHEAD_COMMIT,
                    CommitReply,
                    await state.call_unbounded(FLASHHEAD_COMMIT, update, commit_txn.model_dump(), record, engine=index),
                )
            )
        except AdminAPIError as exc:
            logger.error(
                "FlashHead update %s was accepted by every engine but committing it on dp rank %d "
                "failed; the engines may now differ: %s",
                update,
                ranks[index],
                exc.message,
            )
            exc.extra.update(note=PARTIAL_APPLY_NOTE, engines=ranks, committed_engines=[ranks[i] for i in range(index)])
            raise
    logger.info(
        "FlashHead update applied on %d worker(s) of dp ranks %s as settings version %d: %s",
        len(statuses),
        ranks,
        new_version,
        update,
    )
    return statuses, new_version, ranks


def _refusal(update: dict[str, Any], replies: list[PrepareReply], expected_version: int | None) -> AdminAPIError:
    version = max((r.version for r in replies), default=0)
    busy = [r for r in replies if r.conflict == "busy"]
    if busy:
        return update_in_progress_error(update, holder=busy[0].holder, version=version)
    stale = [r for r in replies if r.conflict == "version"]
    if stale and expected_version is not None:
        return version_conflict_error(update, expected_version, stale[0].version)
    failing = [{"dp_rank": r.dp_rank, "rank": r.rank, "errors": list(r.errors)} for r in replies if r.errors]
    if failing and all(_unavailable(e) for f in failing for e in f["errors"]):
        return flashhead_unavailable_error(update, failing, version)
    return invalid_update_error(update, failing, version)


def _unavailable(error: str) -> bool:
    text = error.lower()
    return "not available" in text or "no flashhead" in text or "assets" in text


async def _abort(state: AdminState, txn: Transaction, prepared: list[int], entry: dict[str, Any] | None) -> None:
    """Release the leases `txn` holds; the first engine also records the rejection (`entry`)."""
    targets = prepared or [0]
    for position, index in enumerate(targets):
        try:
            await state.call_unbounded(
                FLASHHEAD_ABORT, txn.model_dump(), entry if position == 0 else None, engine=index
            )
        except AdminAPIError as exc:  # the lease lapses by itself
            logger.warning("Releasing the lease of update %s on engine %d failed: %s", txn.id, index, exc.message)


def _before(replies: list[PrepareReply]) -> list[dict[str, Any]]:
    return [{"dp_rank": r.dp_rank, "rank": r.rank, **r.before.model_dump()} for r in replies]


def _now() -> str:
    from my_pkg.endpoints.audit import now_iso

    return now_iso()


# ---- reading the audit ------------------------------------------------------------------------------


async def engine_audit(state: AdminState) -> list[dict[str, Any]]:
    """Every engine's mutation entries, one per transaction (the engines that kept it merged), oldest first."""
    replies = parse_replies(AUDIT, AuditReply, await state.call_unbounded(AUDIT))
    merged: dict[str, dict[str, Any]] = {}
    for reply in replies:
        for entry in reply.entries:
            record = entry.model_dump(mode="json", exclude_none=True)
            key = record.get("transaction") or f"{record['time']}-{reply.dp_rank}"
            kept = merged.setdefault(key, {**record, "kept_by": []})
            kept["kept_by"].append(reply.dp_rank)
    return sorted(merged.values(), key=lambda e: e["time"])


def as_entries(records: list[dict[str, Any]]) -> list[AuditEntry]:
    return [AuditEntry.model_validate(r) for r in records]


__all__ = ["engine_audit", "mutation", "parse_if_match", "update_flashhead"]
