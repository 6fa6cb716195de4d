"""Pydantic request/response models of the admin API (shown in OpenAPI).

Models of worker replies accept extra keys (``extra="allow"``) so that a newer
engine half adding fields does not break an older endpoint half; the fields
listed here are type-checked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    model_validator,
)


class _WorkerReply(BaseModel):
    model_config = ConfigDict(extra="allow")


class _RankedReply(_WorkerReply):
    """The reply of one worker: its rank within its engine, and the engine's data-parallel rank."""

    dp_rank: int = Field(default=0, description="Data-parallel rank of the worker's engine.")


# --------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    code: int
    hint: str | None = None


class ErrorResponse(BaseModel):
    """Body of every non-2xx answer of the plugin's routes."""

    error: ErrorInfo


# --------------------------------------------------------------------- health
class PingReply(_RankedReply):
    plugin: str
    version: str
    rank: int
    pid: int | None = None


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    plugin: str
    version: str = Field(description="Version of the endpoint half (API server).")
    num_workers: int
    workers: list[PingReply]


# -------------------------------------------------------------------- workers
class MemoryInfo(_WorkerReply):
    device_allocated_bytes: int | None = None
    device_reserved_bytes: int | None = None
    process_rss_bytes: int | None = None
    kv_cache_bytes: int | None = None


class ModelInfo(_WorkerReply):
    name: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None


class KVCacheInfo(_WorkerReply):
    block_size: int | None = None
    num_blocks: int | None = None


class WorkerInfo(_RankedReply):
    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    pid: int | None = None
    hostname: str | None = None
    device: str | None = None
    plugin_version: str | None = None
    torch_version: str | None = None
    vllm_version: str | None = None
    memory: MemoryInfo = Field(default_factory=MemoryInfo)
    model: ModelInfo = Field(default_factory=ModelInfo)
    kv_cache: KVCacheInfo = Field(default_factory=KVCacheInfo)


class WorkersResponse(BaseModel):
    num_workers: int
    workers: list[WorkerInfo]


# --------------------------------------------------------------------- config
class WorkerConfig(_RankedReply):
    rank: int
    section: str
    config: dict[str, Any]


class ConfigResponse(BaseModel):
    section: str
    num_workers: int
    workers: list[WorkerConfig]


# ------------------------------------------------------------------ flashhead
class FlashHeadCounters(_WorkerReply):
    steps: int = 0
    rows_flashhead: int = 0
    rows_dense: dict[str, int] = Field(default_factory=dict)
    fallbacks: int = 0
    head_seconds: float = 0.0
    fidelity_rows: int = 0
    fidelity_agreed: int = 0


class FlashHeadStatus(_RankedReply):
    rank: int
    pid: int | None = None
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
    pinned_token_ids: list[int] | None = None
    fidelity_every: int | None = None
    backend: str | None = None
    extra_memory_bytes: int | None = None
    counters: FlashHeadCounters = Field(default_factory=FlashHeadCounters)


class FlashHeadStatusResponse(BaseModel):
    num_workers: int
    workers: list[FlashHeadStatus]


class FlashHeadUpdate(BaseModel):
    """Body of ``PUT /plugins/my_pkg/flashhead``; at least one field."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"n_probes": 8}, {"enabled": False}]},
    )

    enabled: StrictBool | None = Field(
        default=None, description="Turn FlashHead on or off."
    )
    n_probes: StrictInt | None = Field(
        default=None, ge=1, description="Clusters probed per token (>= 1)."
    )
    dense_batch_threshold: StrictInt | None = Field(
        default=None,
        ge=0,
        description="Batches with more rows than this use the dense head (>= 0).",
    )

    @model_validator(mode="after")
    def _at_least_one_field(self) -> FlashHeadUpdate:
        if not self.to_update():
            raise ValueError(
                "at least one of 'enabled', 'n_probes', 'dense_batch_threshold' "
                "must be given"
            )
        return self

    def to_update(self) -> dict[str, Any]:
        """The fields that were given (and are not null)."""
        return self.model_dump(exclude_none=True)


class FlashHeadUpdateResponse(BaseModel):
    applied: dict[str, Any] = Field(description="The update applied on all workers.")
    num_workers: int
    workers: list[FlashHeadStatus]


class ValidationReply(_RankedReply):
    rank: int
    errors: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------------- audit
class AuditResponse(BaseModel):
    size: int = Field(description="How many entries the ring keeps (MY_PKG_AUDIT_SIZE).")
    num_entries: int
    entries: list[dict[str, Any]] = Field(
        description="Oldest first: time, request_id, role, token_source, token_sha256_prefix, "
        "client, method, path, status_code, result, and update/before/after/reason where known."
    )
