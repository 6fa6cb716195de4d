"""The worker methods: the names passed to `collective_rpc`, and the registry of each one's reply model.

`WORKER_METHOD_REPLIES` pairs every name with its reply model; `WORKER_METHOD_NAMES` is derived from it.
"""

from __future__ import annotations

from typing import Final

from my_pkg.contract.audit import AuditReply
from my_pkg.contract.replies import PingReply, RankedReply, WorkerConfig, WorkerIdentity
from my_pkg.contract.status import FlashHeadStatus, WorkerStatus
from my_pkg.contract.transaction import CommitReply, LeaseReply, PrepareReply
from my_pkg.contract.update import ValidationReply

# Plain `str` constants: vLLM's msgpack encoder refuses `str` subclasses such as enum members.

#: Prefix of every worker method of the engine half.
RPC_PREFIX: Final = "my_pkg_"
#: `() -> PingReply`: the engine half is loaded; its version.
PING: Final = "my_pkg_ping"
#: `() -> WorkerIdentity`: what cannot change while the engine lives.
WORKER_INFO: Final = "my_pkg_worker_info"
#: `(section) -> WorkerConfig`, `section` in `CONFIG_SECTIONS`.
CONFIG: Final = "my_pkg_config"
#: `() -> WorkerStatus`: everything that changes while the engine runs (memory, FlashHead state and counters).
STATUS: Final = "my_pkg_status"
#: `() -> FlashHeadStatus`: the FlashHead part of `STATUS`, flat (also handy from `LLM.collective_rpc`).
FLASHHEAD_STATUS: Final = "my_pkg_flashhead_status"
#: `(update: dict) -> ValidationReply`: what `update` would break on this worker; changes nothing.
FLASHHEAD_VALIDATE: Final = "my_pkg_flashhead_validate"
#: `(update: dict) -> CommitReply`: validate and apply `update` on this worker alone, as one settings version
#: (for `LLM.collective_rpc`; refused while an API server's update holds the worker's lease).
FLASHHEAD_APPLY: Final = "my_pkg_flashhead_apply"
#: `(update: dict, txn: dict) -> PrepareReply`: phase 1 of an update: validate it and take the worker's lease
#: (`txn` is a `Transaction`); changes no setting.
FLASHHEAD_PREPARE: Final = "my_pkg_flashhead_prepare"
#: `(update: dict, txn: dict, entry: dict) -> CommitReply`: phase 2: apply the prepared update, set the version,
#: keep the audit `entry`, release the lease.
FLASHHEAD_COMMIT: Final = "my_pkg_flashhead_commit"
#: `(txn: dict, entry: dict | None) -> LeaseReply`: release the lease of `txn` without applying; keep `entry`.
FLASHHEAD_ABORT: Final = "my_pkg_flashhead_abort"
#: `() -> AuditReply`: the audit entries this worker keeps (rank 0 of each engine keeps them).
AUDIT: Final = "my_pkg_audit"

#: Sections of `GET /plugins/my_pkg/config/{section}`; each is the worker's `<section>_config`.
CONFIG_SECTIONS: Final = ("scheduler", "model", "cache", "parallel")


#: Every worker method of the engine half (the name `collective_rpc` takes) and the model of its reply: the
#: engine half builds each reply with it, the endpoint half parses each reply with it (`parse_replies` refuses
#: another), and a test calls every worker method and validates its reply with it.
WORKER_METHOD_REPLIES: Final[dict[str, type[RankedReply]]] = {
    PING: PingReply,
    WORKER_INFO: WorkerIdentity,
    CONFIG: WorkerConfig,
    STATUS: WorkerStatus,
    FLASHHEAD_STATUS: FlashHeadStatus,
    FLASHHEAD_VALIDATE: ValidationReply,
    FLASHHEAD_APPLY: CommitReply,
    FLASHHEAD_PREPARE: PrepareReply,
    FLASHHEAD_COMMIT: CommitReply,
    FLASHHEAD_ABORT: LeaseReply,
    AUDIT: AuditReply,
}
WORKER_METHOD_NAMES: Final = tuple(WORKER_METHOD_REPLIES)
