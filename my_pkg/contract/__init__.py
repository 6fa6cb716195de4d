"""The contract between the two halves of my_pkg: worker methods, their replies, the update, the config sections.

The engine half (`my_pkg.engine.rpc`) builds every reply with the models below and sends
`model_dump(mode="json")`; the endpoint half (`my_pkg.endpoints`) validates every reply with the same
model, and the unit tests' fake engine builds its replies from them too, so the halves cannot drift.
This package imports pydantic only (no vLLM, no torch): both halves and the tests can import it anywhere.
Import its names from here; each module holds one concern:

* `methods`: the worker method names and `WORKER_METHODS_CONTRACT`, the registry of their arguments and replies;
* `replies`: the base of every reply (undeclared keys kept, `extra="allow"`) and a worker's identity;
* `reasons`: the codes of why FlashHead is not active and why a row is served dense, one line each;
* `status`: what changes while a worker runs (FlashHead state, counters, step costs, memory);
* `update`: the update body (`extra="forbid"`, strict types), `UPDATE_FIELDS` and the settings it changes;
* `transaction`: the lease and version of a two-phase update, and the replies of its phases;
* `audit`: what an API server sends a worker to keep, and the entries a worker keeps.
"""

from __future__ import annotations

from my_pkg.contract.audit import AuditEntry, AuditInput, AuditReply
from my_pkg.contract.methods import (
    AUDIT,
    CONFIG,
    CONFIG_SECTIONS,
    FLASHHEAD_ABORT,
    FLASHHEAD_APPLY,
    FLASHHEAD_COMMIT,
    FLASHHEAD_PREPARE,
    FLASHHEAD_STATUS,
    FLASHHEAD_VALIDATE,
    PING,
    RPC_PREFIX,
    STATUS,
    WORKER_INFO,
    WORKER_METHOD_NAMES,
    WORKER_METHOD_REPLIES,
    WORKER_METHODS_CONTRACT,
    WorkerMethod,
)
from my_pkg.contract.reasons import (
    DENSE_ROW_REASONS,
    REASON_CODES,
    SPEC_REASON_CODES,
    DenseReason,
    DenseRowReason,
    ReasonCode,
    SpecReasonCode,
    StepDenseReason,
)
from my_pkg.contract.replies import (
    KVCacheInfo,
    ModelInfo,
    PingReply,
    RankedReply,
    WorkerConfig,
    WorkerIdentity,
    WorkerReply,
)
from my_pkg.contract.status import (
    CompactCounters,
    FlashHeadCounters,
    FlashHeadState,
    FlashHeadStatus,
    MemoryInfo,
    RecentRows,
    SampledEstimate,
    ServedWay,
    SpecPart,
    SpecState,
    StepCostsReport,
    TopPCounters,
    WorkerStatus,
)
from my_pkg.contract.transaction import (
    MAX_LEASE_S,
    MAX_SETTINGS_VERSION,
    TRANSACTION_ID_PATTERN,
    CommitReply,
    LeaseReply,
    PrepareReply,
    SettingsVersion,
    Transaction,
)
from my_pkg.contract.update import (
    MAX_UPDATE_INT,
    NULLABLE_FIELDS,
    UPDATE_FIELDS,
    FlashHeadUpdate,
    ProbeCount,
    RowCount,
    SettingsValues,
    ValidationReply,
    update_errors,
)

__all__ = [
    "AUDIT",
    "CONFIG",
    "CONFIG_SECTIONS",
    "DENSE_ROW_REASONS",
    "FLASHHEAD_ABORT",
    "FLASHHEAD_APPLY",
    "FLASHHEAD_COMMIT",
    "FLASHHEAD_PREPARE",
    "FLASHHEAD_STATUS",
    "FLASHHEAD_VALIDATE",
    "MAX_LEASE_S",
    "MAX_SETTINGS_VERSION",
    "MAX_UPDATE_INT",
    "PING",
    "REASON_CODES",
    "RPC_PREFIX",
    "SPEC_REASON_CODES",
    "STATUS",
    "TRANSACTION_ID_PATTERN",
    "NULLABLE_FIELDS",
    "UPDATE_FIELDS",
    "WORKER_INFO",
    "WORKER_METHOD_NAMES",
    "WORKER_METHOD_REPLIES",
    "WORKER_METHODS_CONTRACT",
    "WorkerMethod",
    "AuditEntry",
    "AuditInput",
    "AuditReply",
    "CommitReply",
    "DenseReason",
    "DenseRowReason",
    "CompactCounters",
    "FlashHeadCounters",
    "FlashHeadState",
    "FlashHeadStatus",
    "FlashHeadUpdate",
    "KVCacheInfo",
    "LeaseReply",
    "MemoryInfo",
    "ModelInfo",
    "PingReply",
    "PrepareReply",
    "ProbeCount",
    "RankedReply",
    "ReasonCode",
    "RecentRows",
    "RowCount",
    "SampledEstimate",
    "ServedWay",
    "SettingsValues",
    "SettingsVersion",
    "SpecPart",
    "SpecReasonCode",
    "SpecState",
    "StepCostsReport",
    "StepDenseReason",
    "TopPCounters",
    "Transaction",
    "ValidationReply",
    "WorkerConfig",
    "WorkerIdentity",
    "WorkerReply",
    "WorkerStatus",
    "update_errors",
]
