"""The contract between the two halves of my_pkg: worker methods, their replies, the update, the config sections.

The engine half (`my_pkg.engine.rpc`) builds every reply with the models below and sends
`model_dump(mode="json")`; the endpoint half (`my_pkg.endpoints`) validates every reply with the same
model, and the unit tests' fake engine builds its replies from them too, so the halves cannot drift.
This module imports pydantic only (no vLLM, no torch): both halves and the tests can import it anywhere.

Extra keys: replies keep keys the models do not declare (`extra="allow"`) and pass them through to the
admin API untyped. A worker's FlashHead status dict is produced by the controller
(`my_pkg.engine.flashhead_control`), whose keys are its own contract; a key the controller adds later
must neither make the worker's method raise nor make the endpoint half answer 503, so unknown keys are
kept rather than refused (`forbid`) or silently dropped (`ignore`). A declared field with the wrong type
is refused on both sides. `tests/unit/engine/test_rpc.py` fails when the controller's status has a key
the contract does not declare, so a new key gets typed here in the same change.

The update body is the opposite: `extra="forbid"` and strict types, because it comes from a client.
`FlashHeadUpdate` is the one place where its fields are validated: the API validates the body with it
and each worker validates the update it receives with it again before the model-dependent checks
(FlashHead available, `n_probes` no more than the number of clusters).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

# ---- worker methods: the names passed to `collective_rpc` -------------------------------------------
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
#: `(update: dict) -> FlashHeadStatus`: apply an update every worker validated.
FLASHHEAD_APPLY: Final = "my_pkg_flashhead_apply"

WORKER_METHOD_NAMES: Final = (PING, WORKER_INFO, CONFIG, STATUS, FLASHHEAD_STATUS, FLASHHEAD_VALIDATE,
                              FLASHHEAD_APPLY)

#: Sections of `GET /plugins/my_pkg/config/{section}`; each is the worker's `<section>_config`.
CONFIG_SECTIONS: Final = ("scheduler", "model", "cache", "parallel")

#: Fields of `FlashHeadUpdate`, in the order the API documents them.
UPDATE_FIELDS: Final = ("enabled", "n_probes", "dense_batch_threshold")


# ---- replies ---------------------------------------------------------------------------------------

class WorkerReply(BaseModel):
    """Base of every reply: undeclared keys are kept (see the module docstring)."""

    model_config = ConfigDict(extra="allow")


class RankedReply(WorkerReply):
    """The reply of one worker: its rank within its engine, and the engine's data-parallel rank."""

    rank: int = Field(description="Rank of the worker within its engine.")
    dp_rank: int = Field(
        default=0, description="Data-parallel rank of the worker's engine (set by the API server; 0 without DP)."
    )


class PingReply(RankedReply):
    plugin: str
    version: str
    pid: int


class MemoryInfo(WorkerReply):
    device_allocated_bytes: int | None = None
    device_reserved_bytes: int | None = None
    process_rss_bytes: int | None = None
    kv_cache_bytes: int | None = None


class ModelInfo(WorkerReply):
    name: str | None = None
    path: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None


class KVCacheInfo(WorkerReply):
    block_size: int | None = None
    num_blocks: int | None = None


class WorkerIdentity(RankedReply):
    """Who and what a worker is; none of it changes while the engine lives."""

    local_rank: int | None = None
    world_size: int | None = None
    pid: int
    hostname: str | None = None
    device: str | None = None
    plugin_version: str | None = None
    torch_version: str | None = None
    vllm_version: str | None = None
    model: ModelInfo = Field(default_factory=ModelInfo)
    kv_cache: KVCacheInfo = Field(default_factory=KVCacheInfo)


class WorkerConfig(RankedReply):
    section: str
    config: dict[str, Any] | None = Field(description="The section as JSON data; null when the worker has none.")


class FlashHeadCounters(WorkerReply):
    """Counters since the worker started; they only grow."""

    steps: int = 0
    rows_flashhead: int = 0
    rows_dense: dict[str, int] = Field(default_factory=dict, description="Rows served dense, by reason.")
    fallbacks: int = 0
    head_seconds: float = 0.0
    fidelity_rows: int = 0
    fidelity_agreed: int = 0


class FlashHeadState(WorkerReply):
    """The FlashHead controller's status of one worker (its `status()` dict)."""

    available: bool
    active: bool
    reason: str | None = None
    reason_code: str | None = None
    enabled: bool
    num_clusters: int | None = None
    cluster_size: int | None = None
    vocab_size: int | None = None
    n_probes: int | None = None
    dense_batch_threshold: int | None = None
    probe_sampling: bool | None = None
    sampled_n_probes: int | None = None
    sampled_rank: int | None = None
    pinned_token_ids: list[int] | None = None
    fidelity_every: int | None = None
    backend: str | None = None
    extra_memory_bytes: int | None = None
    counters: FlashHeadCounters = Field(default_factory=FlashHeadCounters)


class FlashHeadStatus(FlashHeadState, RankedReply):
    """`FlashHeadState` of one worker with its rank and process: reply of `FLASHHEAD_STATUS` and `FLASHHEAD_APPLY`."""

    pid: int | None = None


class WorkerStatus(RankedReply):
    """Reply of `STATUS`: everything about a worker that changes while the engine runs."""

    pid: int
    memory: MemoryInfo = Field(default_factory=MemoryInfo)
    flashhead: FlashHeadState

    def flashhead_status(self) -> FlashHeadStatus:
        """The FlashHead part, flat, as `FLASHHEAD_STATUS` answers it."""
        return FlashHeadStatus.model_validate(
            {**self.flashhead.model_dump(), "rank": self.rank, "dp_rank": self.dp_rank, "pid": self.pid}
        )


class ValidationReply(RankedReply):
    errors: list[str] = Field(default_factory=list, description="Empty when the update can be applied.")


# ---- the update ------------------------------------------------------------------------------------

def _absent_not_null(schema: dict[str, Any]) -> None:
    """JSON schema of an optional update field: it may be left out, but `null` is not a value of it."""
    branches = [branch for branch in schema.pop("anyOf", []) if branch.get("type") != "null"]
    if len(branches) == 1:
        schema.update(branches[0])
    schema.pop("default", None)


def _integral(value: Any) -> Any:
    """A float with no fractional part is the integer it spells (JSON Schema's `integer` allows `8.0`)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


ProbeCount = Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)]
RowCount = Annotated[StrictInt, Field(ge=0), BeforeValidator(_integral)]


class FlashHeadUpdate(BaseModel):
    """Body of `PUT /plugins/my_pkg/flashhead` and argument of the worker methods: at least one field.

    A field left out keeps its value. `null` is a value of `dense_batch_threshold` only (no per-step
    switch to the dense head); the other fields refuse it.
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"minProperties": 1, "examples": [{"n_probes": 8}, {"enabled": False}]},
    )

    enabled: StrictBool | None = Field(
        default=None, description="Turn FlashHead on or off.", json_schema_extra=_absent_not_null
    )
    n_probes: ProbeCount | None = Field(
        default=None, description="Clusters probed per token (>= 1, at most the number of clusters).",
        json_schema_extra=_absent_not_null,
    )
    dense_batch_threshold: RowCount | None = Field(
        default=None,
        description="Decode steps with more rows than this use the dense head (>= 0); null: never (the default, "
                    "so a request's text does not depend on the server's load).",
    )

    @model_validator(mode="after")
    def _given_fields_valid(self) -> FlashHeadUpdate:
        nulls = [name for name in ("enabled", "n_probes") if name in self.model_fields_set and getattr(self, name) is None]
        if nulls:
            raise ValueError(f"{', '.join(repr(n) for n in nulls)} must not be null (leave the field out to keep it)")
        if not self.to_update():
            raise ValueError(f"at least one of {', '.join(repr(f) for f in UPDATE_FIELDS)} must be given")
        return self

    def to_update(self) -> dict[str, Any]:
        """The fields that were given, as the workers receive them."""
        return {name: getattr(self, name) for name in UPDATE_FIELDS if name in self.model_fields_set}


def update_errors(update: Any) -> list[str]:
    """Why `update` is not a valid `FlashHeadUpdate`, one message per problem; empty when it is."""
    try:
        FlashHeadUpdate.model_validate(update)
    except ValidationError as exc:
        return [
            f"{'.'.join(str(part) for part in error['loc']) or 'update'}: {error['msg']}"
            for error in exc.errors(include_url=False, include_input=False)
        ]
    return []


__all__ = [
    "CONFIG", "CONFIG_SECTIONS", "FLASHHEAD_APPLY", "FLASHHEAD_STATUS", "FLASHHEAD_VALIDATE", "PING",
    "RPC_PREFIX", "STATUS", "UPDATE_FIELDS", "WORKER_INFO", "WORKER_METHOD_NAMES",
    "FlashHeadCounters", "FlashHeadState", "FlashHeadStatus", "FlashHeadUpdate", "KVCacheInfo", "MemoryInfo",
    "ModelInfo", "PingReply", "RankedReply", "ValidationReply", "WorkerConfig", "WorkerIdentity", "WorkerReply",
    "WorkerStatus", "update_errors",
]
