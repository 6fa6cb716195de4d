"""What a worker keeps for the admin API: its settings version, the update lease, and its audit entries.

This is the one truth every API server shares. vLLM may run several API-server processes (`vllm serve
--data-parallel-size N` or `--api-server-count N`), each with its own memory; only the engine is common to
them, so anything that must hold across them lives here, in each worker:

* the **settings version**: how many updates were committed, as the API server numbered them. Every
  status reply carries it; a worker only ever moves it up (it refuses a commit that would not).
* the **lease**: an update is two-phase. `prepare` validates it and takes the worker's lease for one
  transaction, noting the version it saw; `commit` applies the whole settings only while the transaction
  still holds the lease and the version is still the one it saw, sets the new version and releases the
  lease; `abort` releases it. A lease lapses after the seconds the API server asked for (at most
  `MAX_LEASE_S`), so a crashed API server cannot wedge updates; a lapsed lease that nobody took is still
  the transaction's, one that another transaction took is not, and its late commit is refused.
* the **audit entries**, written by the worker itself: the updates it applied (a ring of its own), and the
  rejections, collapsed per caller and reason with a count (a table of its own, so no flood of
  rejections can evict an applied update).

Nothing here imports vLLM or the FlashHead controller: `my_pkg.engine.rpc` calls it around the
controller's `validate`, `apply` and `status`.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from my_pkg import env
from my_pkg.contract import MAX_LEASE_S, AuditEntry, AuditInput, Transaction

#: Attribute of the worker object holding its `AdminLedger`.
WORKER_ATTR = "_my_pkg_admin_ledger"
DEFAULT_AUDIT_SIZE: int = env.VARIABLES["MY_PKG_AUDIT_SIZE"].default


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class Lease:
    transaction: str
    holder: str
    expires_at: float  # time.monotonic() of this worker process
    version: int  # the worker's settings version when the lease was taken

    def lapsed(self, now: float) -> bool:
        return now >= self.expires_at


@dataclass
class AdminLedger:
    """One worker's settings version, update lease and audit entries (oldest first)."""

    audit_size: int = DEFAULT_AUDIT_SIZE
    version: int = 0
    lease: Lease | None = None
    applied: deque[dict[str, Any]] = field(default_factory=deque)
    rejected: OrderedDict[tuple[Any, ...], dict[str, Any]] = field(default_factory=OrderedDict)
    #: The last transaction this worker committed and the reply it gave (a repeated commit gets it again).
    last_commit: tuple[str, dict[str, Any]] | None = None
    clock: Any = time.monotonic

    def __post_init__(self) -> None:
        self.audit_size = max(1, int(self.audit_size))
        self.applied = deque(self.applied, maxlen=self.audit_size)

    # ---- the lease ------------------------------------------------------------------------------

    def holder_other_than(self, txn: Transaction) -> Lease | None:
        """The live lease of another transaction, if any (a lapsed one no longer counts)."""
        lease = self.lease
        if lease is None or lease.transaction == txn.id or lease.lapsed(self.clock()):
            return None
        return lease

    def conflict(self, txn: Transaction) -> tuple[str, str | None] | None:
        """Why `txn` cannot take the lease now: ("busy", holder) or ("version", None); None when it can."""
        other = self.holder_other_than(txn)
        if other is not None:
            return "busy", other.holder
        if txn.expected_version is not None and txn.expected_version != self.version:
            return "version", None
        return None

    def take(self, txn: Transaction) -> None:
        lease_s = min(float(txn.lease_s), MAX_LEASE_S)
        self.lease = Lease(txn.id, txn.holder, self.clock() + lease_s, self.version)

    def release(self, txn_id: str) -> bool:
        if self.lease is not None and self.lease.transaction == txn_id:
            self.lease = None
            return True
        return False

    def commit_refusal(self, txn: Transaction) -> str | None:
        """Why `txn` may not commit here (None when it may): it must hold the lease (a lapsed one nobody took
        counts), the version must still be the one it prepared on, and the new version must be higher."""
        lease = self.lease
        if lease is None or lease.transaction != txn.id:
            holder = f"; {lease.holder} holds it now" if lease is not None else ""
            return f"update {txn.id} does not hold this worker's lease (released, aborted, or lapsed and taken){holder}"
        if self.version != lease.version:
            return f"the settings version moved from {lease.version} to {self.version} since update {txn.id} prepared"
        if txn.new_version is None or txn.new_version <= self.version:
            return f"the new settings version {txn.new_version} is not above this worker's {self.version}"
        return None

    # ---- version and audit ----------------------------------------------------------------------

    def committed(
        self,
        txn: Transaction,
        settings: dict[str, Any],
        entry: dict[str, Any] | None,
        before: dict[str, Any] | None = None,
    ) -> None:
        """Record the commit of `txn` (checked by `commit_refusal`): its version, its audit entry (with this
        worker's settings `before` it), the lease released."""
        assert txn.new_version is not None
        self.version = txn.new_version
        self.release(txn.id)
        if entry is not None:
            self.keep_applied(entry, txn.id, settings, before)

    def applied_locally(self) -> None:
        """An update applied without a transaction (`my_pkg_flashhead_apply`): one version up."""
        self.version += 1

    def keep_applied(
        self, entry: dict[str, Any], txn_id: str, settings: dict[str, Any], before: dict[str, Any] | None = None
    ) -> None:
        given = AuditInput.model_validate(entry).model_dump(exclude_none=True)
        record = {
            "before": [before] if before is not None else None,
            **given,
            "time": now_iso(),
            "result": "applied",
            "status_code": 200,
            "transaction": txn_id,
            "settings": settings,
            "settings_version": self.version,
        }
        self.applied.append(AuditEntry.model_validate(record).model_dump(mode="json", exclude_none=True))

    def keep_rejected(self, entry: dict[str, Any], txn_id: str) -> None:
        """A rejected update, counted into the entry of the same caller and reason (bounded table)."""
        given = AuditInput.model_validate(entry).model_dump(exclude_none=True)
        key = (
            given.get("api_server"),
            given.get("token_fingerprint") or given.get("role"),
            given.get("status_code"),
            given.get("error_type") or given.get("reason"),
        )
        kept = self.rejected.pop(key, None)
        if kept is None:
            while len(self.rejected) >= self.audit_size:
                self.rejected.popitem(last=False)
            kept = {"first_time": now_iso(), "count": 0}
        kept.update(
            given,
            time=now_iso(),
            result="rejected",
            status_code=given.get("status_code") or 409,
            transaction=txn_id,
            settings_version=self.version,
            count=kept["count"] + 1,
        )
        self.rejected[key] = AuditEntry.model_validate(kept).model_dump(mode="json", exclude_none=True)

    def entries(self) -> list[dict[str, Any]]:
        """Applied and rejected entries, oldest first."""
        return sorted([*self.applied, *self.rejected.values()], key=lambda e: e["time"])


def ledger_of(worker: Any, audit_size: int = DEFAULT_AUDIT_SIZE) -> AdminLedger:
    """The worker's ledger, made on first use (one per worker object, so per worker process)."""
    ledger = getattr(worker, WORKER_ATTR, None)
    if not isinstance(ledger, AdminLedger):
        ledger = AdminLedger(audit_size=audit_size)
        setattr(worker, WORKER_ATTR, ledger)
    return ledger


__all__ = ["AdminLedger", "Lease", "ledger_of"]
