"""The FlashHead update transaction (one truth for every API server, the engines), declared on its route with
`@mutation` (`my_pkg.endpoints.mutation`), and the catch-up that runs it after an engine restarts.

`update_flashhead`:

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

import time
import uuid
from dataclasses import dataclass
from typing import Any

from my_pkg.contract import (
    FLASHHEAD_ABORT,
    FLASHHEAD_COMMIT,
    FLASHHEAD_PREPARE,
    MAX_LEASE_S,
    AuditInput,
    CommitReply,
    PrepareReply,
    SettingsValues,
    Transaction,
)
from my_pkg.endpoints.admin_state import (
    UPDATE_KEY,
    AdminState,
    StatusSnapshot,
    consistent,
    etag_of,
    held_settings,
)
from my_pkg.endpoints.client import parse_replies
from my_pkg.endpoints.config import ROUTE_PREFIX, logger
from my_pkg.endpoints.errors import (
    AdminAPIError,
    flashhead_unavailable_error,
    invalid_update_error,
    unexpected_reply_error,
    update_deadline_error,
    update_in_progress_error,
    version_conflict_error,
)
from my_pkg.endpoints.mutation import AUDITED

#: Seconds a worker's lease lasts at least; longer when the API server waits longer for the workers.
MIN_LEASE_S = 30.0
#: The API server's clock for the transaction's deadline.
clock = time.monotonic
#: The `note` of a 503 whose commit failed: on an engine after the first (partial), or on the first.
PARTIAL_APPLY_NOTE = (
    "Committing the update failed on an engine: it is in force on committed_engines only, and every other "
    "engine's lease was released (engine_settings says what each holds). The next PUT, from any API server, "
    "brings every engine to the same settings: retry it."
)
NOTHING_APPLIED_NOTE = (
    "Committing the update failed on the first engine: nothing was applied and every lease was released. Retry the PUT."
)


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


__all__ = [
    "IfMatch",
    "UpdateResult",
    "catch_up",
    "lease_seconds",
    "parse_if_match",
    "update_flashhead",
    "update_wait_s",
]
