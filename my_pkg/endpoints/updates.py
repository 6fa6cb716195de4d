"""Mutations of the admin API: the `@mutation` decorator and the FlashHead update transaction.

`@mutation(key, what)` is how a mutating route is declared (the route class refuses one without it). It
gives the route, in one place:

* **serialisation**: one mutation per key at a time in this API server (a second answers 409 at once),
  run as a task that is never cancelled, so a caller who gives up (timeout, gone) cannot leave it half
  done; across API servers the engines' leases serialise (see `my_pkg.engine.admin_state`);
* **auditing**: refusals go to this server's audit log; the transaction writes its own outcome (one JSON
  line per applied, rejected, partial or failed update, with the outcome on every engine); the engines
  keep what they applied or rejected;
* **snapshot invalidation**: whatever the outcome, the status snapshot is marked stale here and on the
  sibling API servers of the node, and refreshed in the background.

`update_flashhead` is the transaction (one truth for every API server, the engines):

1. **prepare** the engines one by one in ascending data-parallel rank: each worker validates the update
   and takes its lease for this transaction, or answers why not (invalid here, busy). Taking the engines in
   one order means that of two concurrent updates, from any API servers, one wins and the other is
   refused with 409, holding nothing;
2. on any refusal, **abort** on the engines already prepared (the first records the rejection);
   `If-Match` is checked here, against what every engine holds, under the leases (compare-and-set);
3. **commit** the *whole* settings (the highest-version engine's settings with the update over them) with
   one version above every engine's, engine by engine. A worker commits only under the transaction's lease,
   at the version it prepared on, to a higher version. When a commit fails, the failed engine and those
   after it are aborted at once: the update is in force on the engines before it only, the 503 says what
   each engine holds, and the next update from any API server brings every engine to the same settings
   and version (it commits whole settings everywhere).

Bounds: the lease is `max(30 s, 3 x the wait)`, the wait for the PUT `MY_PKG_RPC_TIMEOUT x engines` (both
grow with data parallelism); preparing must end within half the lease, or nothing is committed.
"""

from __future__ import annotations

import functools
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from my_pkg.contract import (
    AUDIT,
    FLASHHEAD_ABORT,
    FLASHHEAD_COMMIT,
    FLASHHEAD_PREPARE,
    MAX_LEASE_S,
    AuditEntry,
    AuditInput,
    AuditReply,
    CommitReply,
    PrepareReply,
    SettingsValues,
    Transaction,
)
from my_pkg.endpoints.audit import caller, record_refusal
from my_pkg.endpoints.client import (
    UPDATE_KEY,
    AdminState,
    StatusSnapshot,
    consistent,
    etag_of,
    held_settings,
    parse_replies,
)
from my_pkg.endpoints.config import ROUTE_PREFIX, logger
from my_pkg.endpoints.errors import (
    NOTHING_APPLIED_NOTE,
    PARTIAL_APPLY_NOTE,
    PENDING_NOTE,
    AdminAPIError,
    flashhead_unavailable_error,
    invalid_update_error,
    unexpected_reply_error,
    update_deadline_error,
    update_in_progress_error,
    version_conflict_error,
)
from my_pkg.endpoints.route_class import MUTATION_MARK

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
#: Seconds a worker's lease lasts at least; longer when the API server waits longer for the workers.
MIN_LEASE_S = 30.0
#: Marks an error whose outcome the transaction already wrote to the audit.
AUDITED = "_my_pkg_audited"
#: The API server's clock for the transaction's deadline.
clock = time.monotonic


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


# ---- the FlashHead update ---------------------------------------------------------------------------


def update_wait_s(state: AdminState) -> float:
    """How long a PUT waits for its transaction: `MY_PKG_RPC_TIMEOUT` per engine (2 RPCs per engine)."""
    return state.rpc_timeout * max(1, len(state.engine_ranks()))


def lease_seconds(state: AdminState) -> float:
    """The lease a transaction asks for: three times the wait, at least `MIN_LEASE_S`, at most `MAX_LEASE_S`."""
    return min(MAX_LEASE_S, max(MIN_LEASE_S, 3 * update_wait_s(state)))


@dataclass(frozen=True)
class IfMatch:
    """A parsed `If-Match`: an ETag of GET /flashhead (`"7.<digest>"`) or a bare settings version (`"7"`)."""

    raw: str
    version: int
    digest: str | None

    def holds(self, held: list[dict[str, Any]]) -> bool:
        """What the engines hold is what the caller read: the same ETag, or (bare version) every worker at
        that version with the same settings."""
        if self.digest is not None:
            return etag_of(held) == f'"{self.version}.{self.digest}"'
        return consistent(held) and all(h["settings_version"] == self.version for h in held)


def parse_if_match(value: str | None) -> IfMatch | None:
    """The `If-Match` header (`"7.<digest>"`, `7`, `"7"`, weak or not); None when absent or `*`."""
    if value is None or value.strip() in ("", "*"):
        return None
    text = value.strip().removeprefix("W/").strip('"')
    version, _, digest = text.partition(".")
    return IfMatch(value.strip(), int(version), digest or None)  # ValueError: the route answers 422


@dataclass(frozen=True)
class UpdateResult:
    """A committed update: every worker's status after it, and what every engine now holds."""

    transaction: str
    statuses: list[CommitReply]
    settings_version: int
    settings: dict[str, Any]
    engines: list[int]
    held: list[dict[str, Any]]


def _audit_input(who: dict[str, Any], update: dict[str, Any], ranks: list[int]) -> dict[str, Any]:
    fields = set(AuditInput.model_fields)
    given = {k: v for k, v in who.items() if k in fields and v is not None}
    return AuditInput.model_validate({**given, "update": update, "engines": ranks}).model_dump(exclude_none=True)


async def update_flashhead(
    state: AdminState, update: dict[str, Any], who: dict[str, Any], expected: IfMatch | None = None
) -> UpdateResult:
    """Prepare, then commit `update` on every engine this API server manages (see the module docstring)."""
    ranks = state.engine_ranks()
    lease_s = lease_seconds(state)
    txn = Transaction(id=uuid.uuid4().hex, holder=state.identity[:200], lease_s=lease_s)
    who["transaction"] = txn.id
    entry = _audit_input(who, update, ranks)
    outcome = _Outcome(state, who, txn.id, update, ranks)
    started = clock()
    prepared: list[int] = []  # engines that granted the lease
    reached: list[int] = []  # engines asked (a lost reply may hide a granted lease)
    replies: list[PrepareReply] = []
    try:
        for index, _ in enumerate(ranks):
            reached.append(index)
            engine_replies = parse_replies(
                FLASHHEAD_PREPARE,
                PrepareReply,
                await state.call_unbounded(FLASHHEAD_PREPARE, update, txn.model_dump(), engine=index),
            )
            if any(r.granted for r in engine_replies):
                prepared.append(index)
            replies.extend(engine_replies)
            if not all(r.granted for r in engine_replies):
                raise _refusal(update, replies)
        held = _held(replies)
        if expected is not None and not expected.holds(held):
            raise version_conflict_error(update, expected.raw, etag_of(held), held)
        if clock() - started > lease_s / 2:
            raise update_deadline_error(update, lease_s / 2, txn.id)
    except AdminAPIError as exc:
        rejected = exc.status_code < 500
        refusal = {**entry, "status_code": exc.status_code, "error_type": exc.type, "reason": exc.message}
        # A refusal releases what was granted (the first engine records it); a failure releases every engine
        # asked, since the failed call may have taken the lease before its reply was lost.
        await _abort(state, txn, prepared if rejected else reached, refusal if rejected else None)
        held = _held(replies)
        if held:  # what the engines asked so far hold
            exc.extra.setdefault("engine_settings", held)
        exc.extra.setdefault("transaction", txn.id)
        outcome.write(exc, "rejected" if rejected else "failed", [], held=held)
        raise
    base = max(replies, key=lambda r: r.version)  # the first worker of the highest version: the settings in force
    settings = base.before.whole(update)
    new_version = max(r.version for r in replies) + 1
    commit_txn = txn.model_copy(update={"new_version": new_version})
    statuses: list[CommitReply] = []
    for index, _ in enumerate(ranks):
        try:
            statuses.extend(
                parse_replies(
                    FLASHHEAD_COMMIT,
                    CommitReply,
                    await state.call_unbounded(
                        FLASHHEAD_COMMIT, settings, commit_txn.model_dump(), entry, engine=index
                    ),
                )
            )
        except AdminAPIError as exc:
            # Release the failed engine and every engine after it at once: a retry must not wait for leases.
            await _abort(state, txn, list(range(index, len(ranks))), None)
            committed = [ranks[i] for i in range(index)]
            held = _held_after(statuses, [r for r in replies if r.dp_rank not in committed])
            logger.error(
                "FlashHead update %s (transaction %s) failed to commit on dp rank %d; committed on dp ranks %s: %s",
                update,
                txn.id,
                ranks[index],
                committed,
                exc.message,
            )
            exc.extra.update(
                note=PARTIAL_APPLY_NOTE if committed else NOTHING_APPLIED_NOTE,
                transaction=txn.id,
                engines=ranks,
                committed_engines=committed,
                engine_settings=held,
                consistent=consistent(held),
            )
            outcome.write(exc, "partial" if committed else "failed", committed, held=held, settings=settings)
            raise
    held = _held_after(statuses, [])
    if any(s.settings_version != new_version for s in statuses):
        raise unexpected_reply_error(FLASHHEAD_COMMIT, f"a worker did not take settings version {new_version}")
    outcome.applied(new_version, settings, held)
    logger.info(
        "FlashHead update applied on %d worker(s) of dp ranks %s as settings version %d (transaction %s): %s",
        len(statuses),
        ranks,
        new_version,
        txn.id,
        settings,
    )
    return UpdateResult(txn.id, statuses, new_version, settings, ranks, held)


def _held(replies: list[PrepareReply]) -> list[dict[str, Any]]:
    return held_settings((r.dp_rank, r.rank, r.version, r.before) for r in replies)


def _held_after(statuses: list[CommitReply], others: list[PrepareReply]) -> list[dict[str, Any]]:
    """What every worker holds after the commits: the committed ones' replies, the others' prepare replies."""
    return held_settings(
        [(s.dp_rank, s.rank, s.settings_version, SettingsValues.of_state(s)) for s in statuses]
        + [(r.dp_rank, r.rank, r.version, r.before) for r in others]
    )


class _Outcome:
    """Writes the transaction's outcome to the audit: one JSON line, with the outcome on every engine."""

    def __init__(self, state: AdminState, who: dict[str, Any], txn_id: str, update: dict[str, Any], ranks: list[int]):
        self.state, self.who, self.txn_id, self.update, self.ranks = state, who, txn_id, update, ranks

    def _outcomes(
        self, default: str, committed: list[int], held: list[dict[str, Any]], failed: int | None = None
    ) -> list[dict[str, Any]]:
        versions = {h["dp_rank"]: h["settings_version"] for h in held}
        return [
            {
                "dp_rank": r,
                "outcome": "committed" if r in committed else "failed" if r == failed else default,
                "settings_version": versions.get(r),
            }
            for r in self.ranks
        ]

    def applied(self, version: int, settings: dict[str, Any], held: list[dict[str, Any]]) -> None:
        self.state.audit.record(
            self.who,
            200,
            "applied",
            keep=False,  # the engines keep it
            transaction=self.txn_id,
            update=self.update,
            settings=settings,
            settings_version=version,
            engines=self.ranks,
            committed_engines=self.ranks,
            outcomes=self._outcomes("committed", self.ranks, held),
        )

    def write(
        self,
        exc: AdminAPIError,
        result: str,
        committed: list[int],
        *,
        held: list[dict[str, Any]],
        settings: dict[str, Any] | None = None,
    ) -> None:
        failed = self.ranks[len(committed)] if result == "partial" or (result == "failed" and settings) else None
        self.state.audit.record(
            self.who,
            exc.status_code,
            result,
            keep=result != "rejected",  # the first engine keeps a rejection
            transaction=self.txn_id,
            update=self.update,
            settings=settings,
            engines=self.ranks,
            committed_engines=committed,
            outcomes=self._outcomes("aborted", committed, held, failed),
            error_type=exc.type,
            reason=exc.message,
        )
        setattr(exc, AUDITED, True)


def _refusal(update: dict[str, Any], replies: list[PrepareReply]) -> AdminAPIError:
    version = max((r.version for r in replies), default=0)
    busy = [r for r in replies if r.conflict == "busy"]
    if busy:
        return update_in_progress_error(update, holder=busy[0].holder, version=version)
    failing = [{"dp_rank": r.dp_rank, "rank": r.rank, "errors": list(r.errors)} for r in replies if r.errors]
    if failing and all(_unavailable(e) for f in failing for e in f["errors"]):
        return flashhead_unavailable_error(update, failing, version)
    return invalid_update_error(update, failing, version)


def _unavailable(error: str) -> bool:
    text = error.lower()
    return "not available" in text or "no flashhead" in text or "assets" in text


async def _abort(state: AdminState, txn: Transaction, targets: list[int], entry: dict[str, Any] | None) -> None:
    """Release the leases `txn` holds on the engines at `targets`; the first (engine 0 when none) records the
    rejection (`entry`)."""
    targets = targets or ([0] if entry is not None else [])
    for position, index in enumerate(targets):
        try:
            await state.call_unbounded(
                FLASHHEAD_ABORT, txn.model_dump(), entry if position == 0 else None, engine=index
            )
        except AdminAPIError as exc:  # the lease lapses by itself
            logger.warning("Releasing the lease of update %s on engine %d failed: %s", txn.id, index, exc.message)


def catch_up(state: AdminState, snapshot: StatusSnapshot) -> None:
    """Bring a restarted or newly joined engine to the settings in force, in the background.

    Called when a status snapshot shows other workers than the one before (a new process) and the workers do
    not hold the same settings and version. It runs the update transaction with the whole settings of the
    highest-version worker, conditional on the snapshot's ETag, so it changes nothing if anything moved since
    (another update, another API server's catch-up); it is audited like any update (role `system`). Nothing
    runs while this API server's own update does: that one converges the engines anyway.
    """
    held = snapshot.held()
    if consistent(held) or state.in_flight.running(UPDATE_KEY) or not snapshot.workers:
        return
    base = max(snapshot.workers, key=lambda w: w.settings_version)
    settings = SettingsValues.of_state(base.flashhead).whole()
    expected = parse_if_match(etag_of(held))
    who = {"api_server": state.identity, "role": "system", "token_source": "catch-up", "method": "PUT"}
    who["path"] = f"{ROUTE_PREFIX}/flashhead"

    async def run() -> None:
        try:
            result = await update_flashhead(state, settings, who, expected)
            logger.info("After the workers changed, every engine is at settings version %d.", result.settings_version)
        except AdminAPIError as exc:
            logger.info("Catching up the engines after the workers changed did not apply: %s", exc.message)
        finally:
            state.invalidate_status()

    state.in_flight.start(UPDATE_KEY, run)


# ---- reading the audit ------------------------------------------------------------------------------


async def engine_audit(state: AdminState) -> list[dict[str, Any]]:
    """Every engine's entries: an applied update once per transaction (`kept_by`: the engines that committed
    it), rejections as each engine counted them; oldest first."""
    replies = parse_replies(AUDIT, AuditReply, await state.call_unbounded(AUDIT))
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for reply in replies:
        for position, entry in enumerate(reply.entries):
            record = entry.model_dump(mode="json", exclude_none=True)
            before = [{"dp_rank": reply.dp_rank, **b} for b in record.pop("before", [])]
            if record.get("result") == "applied" and record.get("transaction"):
                key: tuple[Any, ...] = ("applied", record["transaction"])
            else:
                key = ("engine", reply.dp_rank, reply.rank, position)
            kept = merged.setdefault(key, {**record, "kept_by": [], "before": []})
            kept["kept_by"].append(reply.dp_rank)
            kept["before"].extend(before)  # each engine's settings before it applied the update
    return sorted(merged.values(), key=lambda e: e["time"])


def merged_audit(engine_entries: list[dict[str, Any]], local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engines' entries with this API server's outcomes: an outcome of a transaction the engines kept
    (partial, failed) is folded into that entry, and so is a 504 its caller got before it applied
    (`answered_status_code`); the others are listed as they are. Oldest first."""
    by_txn = {e["transaction"]: e for e in engine_entries if e.get("result") == "applied" and e.get("transaction")}
    rest = []
    for entry in local:
        kept = by_txn.get(entry.get("transaction") or "")
        if kept is not None and entry.get("result") in ("partial", "failed"):
            outcome = ("result", "status_code", "committed_engines", "outcomes", "reason")
            kept.update({k: entry[k] for k in outcome if k in entry})
        elif kept is not None and entry.get("result") == "pending":
            kept["answered_status_code"] = entry["status_code"]
        else:
            rest.append(entry)
    return sorted([*engine_entries, *rest], key=lambda e: e["time"])


def as_entries(records: list[dict[str, Any]]) -> list[AuditEntry]:
    return [AuditEntry.model_validate(r) for r in records]


__all__ = [
    "IfMatch",
    "UpdateResult",
    "catch_up",
    "engine_audit",
    "merged_audit",
    "mutation",
    "parse_if_match",
    "update_flashhead",
]
