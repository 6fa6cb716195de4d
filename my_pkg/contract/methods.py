"""The worker methods: the names passed to `collective_rpc`, and the registry of each one's arguments and reply.

`WORKER_METHODS_CONTRACT` pairs every name with its `WorkerMethod` (argument names, reply model);
`WORKER_METHOD_REPLIES` and `WORKER_METHOD_NAMES` are derived from it. A test holds every worker method of the
engine half (`my_pkg.engine.rpc`) to its entry: the same names, the same arguments in the same order.
"""

from __future__ import annotations

from typing import Final, NamedTuple

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
#: `(settings: dict, txn: dict, entry: dict | None) -> CommitReply`: phase 2: bring the worker to the whole
#: `settings`, set the version, keep the audit `entry`, release the lease.
FLASHHEAD_COMMIT: Final = "my_pkg_flashhead_commit"
#: `(txn: dict, entry: dict | None) -> LeaseReply`: release the lease of `txn` without applying; keep `entry`.
FLASHHEAD_ABORT: Final = "my_pkg_flashhead_abort"
#: `() -> AuditReply`: the audit entries this worker keeps (rank 0 of each engine keeps them).
AUDIT: Final = "my_pkg_audit"

#: Sections of `GET /plugins/my_pkg/config/{section}`; each is the worker's `<section>_config`.
CONFIG_SECTIONS: Final = ("scheduler", "model", "cache", "parallel")


class WorkerMethod(NamedTuple):
    """One worker method: the names of its arguments after the worker (in call order; trailing ones may be
    optional), and the model of its reply."""

    arguments: tuple[str, ...]
    reply: type[RankedReply]


#: Every worker method of the engine half (the name `collective_rpc` takes), its arguments and the model of its
#: reply: the engine half builds each reply with it, the endpoint half parses each reply with it (`parse_replies`
#: refuses another), and tests hold the worker methods' signatures and replies to it.
WORKER_METHODS_CONTRACT: Final[dict[str, WorkerMethod]] = {
    PING: WorkerMethod((), PingReply),
    WORKER_INFO: WorkerMethod((), WorkerIdentity),
    CONFIG: WorkerMethod(("section",), WorkerConfig),
    STATUS: WorkerMethod((), WorkerStatus),
    FLASHHEAD_STATUS: WorkerMethod((), FlashHeadStatus),
    FLASHHEAD_VALIDATE: WorkerMethod(("update",), ValidationReply),
    FLASHHEAD_APPLY: WorkerMethod(("update",), CommitReply),
    FLASHHEAD_PREPARE: WorkerMethod(("update", "txn"), PrepareReply),
    FLASHHEAD_COMMIT: WorkerMethod(("settings", "txn", "entry"), CommitReply),
    FLASHHEAD_ABORT: WorkerMethod(("txn", "entry"), LeaseReply),
    AUDIT: WorkerMethod((), AuditReply),
}
WORKER_METHOD_REPLIES: Final = {name: method.reply for name, method in WORKER_METHODS_CONTRACT.items()}
WORKER_METHOD_NAMES: Final = tuple(WORKER_METHODS_CONTRACT)
