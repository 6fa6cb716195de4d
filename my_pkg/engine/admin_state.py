"""What a worker keeps for the admin API: its settings version, the update lease, and the audit entries.

This is the one truth every API server shares. vLLM may run several API-server processes (`vllm serve
--data-parallel-size N` or `--api-server-count N`), each with its own memory; only the engine is common to
them, so anything that must hold across them lives here, in each worker:

* the **settings version**: how many updates were committed. Every status reply carries it, and an update
  can be made conditional on it (compare-and-set, `If-Match`).
* the **lease**: an update is two-phase. `prepare` validates it and takes the worker's lease for one
  transaction; `commit` applies it, sets the version and releases the lease; `abort` releases it. An API
  server prepares the engines one by one in ascending data-parallel rank, so of two concurrent updates
  the one that takes the lowest engine first wins everywhere and the other finds it busy (nothing
  partial, no deadlock). A lease lapses after the seconds the API server asked for, so a crashed API
  server cannot wedge updates.
* the **audit entries** of mutations, written by the commit (or abort) itself: whichever API server
  reads them gets the same history.

Nothing here imports vLLM or the FlashHead controller: `my_pkg.engine.rpc` calls it around the
controller's `validate`, `apply` and `status`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from my_pkg.contract import AuditEntry, Transaction

#: Attribute of the worker object holding its `AdminLedger`.
WORKER_ATTR = "_my_pkg_admin_ledger"
DEFAULT_AUDIT_SIZE = 256


@dataclass
class Lease:
    transaction: str
    holder: str
    expires_at: float  # time.monotonic() of this worker process

    def lapsed(self, now: float) -> bool:
        return now >= self.expires_at


@dataclass
class AdminLedger:
    """One worker's settings version, update lease and audit entries (mutations only, newest last)."""

    audit_size: int = DEFAULT_AUDIT_SIZE
    version: int = 0
    lease: Lease | None = None
    entries: deque[dict[str, Any]] = field(default_factory=deque)
    clock: Any = time.monotonic

    def __post_init__(self) -> None:
        self.entries = deque(self.entries, maxlen=max(1, int(self.audit_size)))

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
        self.lease = Lease(txn.id, txn.holder, self.clock() + txn.lease_s)

    def release(self, txn_id: str) -> bool:
        if self.lease is not None and self.lease.transaction == txn_id:
            self.lease = None
            return True
        return False

    def may_commit(self, txn: Transaction) -> bool:
        """`txn` holds the lease, or held it and nobody took it since it lapsed."""
        return self.lease is not None and self.lease.transaction == txn.id or self.holder_other_than(txn) is None

    # ---- version and audit ----------------------------------------------------------------------

    def committed(self, txn: Transaction, entry: dict[str, Any] | None) -> None:
        """Record a commit of `txn`: the new version, its audit entry, the lease released."""
        self.version = (
            txn.new_version if txn.new_version is not None and txn.new_version > self.version else self.version + 1
        )
        self.release(txn.id)
        if entry is not None:
            self.keep({**entry, "settings_version": self.version})

    def keep(self, entry: dict[str, Any]) -> None:
        self.entries.append(AuditEntry.model_validate(entry).model_dump(mode="json", exclude_none=True))


def ledger_of(worker: Any, audit_size: int = DEFAULT_AUDIT_SIZE) -> AdminLedger:
    """The worker's ledger, made on first use (one per worker object, so per worker process)."""
    ledger = getattr(worker, WORKER_ATTR, None)
    if not isinstance(ledger, AdminLedger):
        ledger = AdminLedger(audit_size=audit_size)
        setattr(worker, WORKER_ATTR, ledger)
    return ledger


__all__ = ["AdminLedger", "Lease", "ledger_of"]
