"""Response models of the admin API (shown in OpenAPI).

The per-worker entries are the contract's worker replies (`my_pkg.contract`), so the API
shows exactly what the engine half sends; the models here only wrap them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from my_pkg.contract import (
    AuditEntry,
    CommitReply,
    FlashHeadStatus,
    MemoryInfo,
    PingReply,
    SettingsValues,
    TopPCounters,
    WorkerConfig,
    WorkerIdentity,
)


def _snapshot_age() -> Any:
    return Field(
        description="Seconds since the workers' status this answer comes from was requested: at most "
        "MY_PKG_STATUS_MAX_AGE, plus the time the workers took to answer.",
        ge=0,
    )


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
class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    plugin: str
    version: str = Field(description="Version of the endpoint half (API server).")
    num_workers: int
    snapshot_age_s: float = _snapshot_age()
    workers: list[PingReply]


# -------------------------------------------------------------------- workers
class WorkerInfo(WorkerIdentity):
    """A worker's identity (fetched once) with its memory and sort-free top-p counters (from the status snapshot)."""

    memory: MemoryInfo = Field(default_factory=MemoryInfo)
    top_p: TopPCounters = Field(default_factory=TopPCounters)


class WorkersResponse(BaseModel):
    num_workers: int
    snapshot_age_s: float = _snapshot_age()
    workers: list[WorkerInfo]


# --------------------------------------------------------------------- config
class ConfigResponse(BaseModel):
    section: str
    num_workers: int
    workers: list[WorkerConfig]


# ------------------------------------------------------------------ flashhead
class EngineSettings(BaseModel):
    """What one worker holds: its settings version and settings."""

    dp_rank: int
    rank: int
    settings_version: int
    settings: SettingsValues


class FlashHeadStatusResponse(BaseModel):
    num_workers: int
    settings_version: int = Field(
        description="Updates committed on the engines: the version every worker holds when `consistent`, else the "
        "highest."
    )
    consistent: bool = Field(
        description="Every worker of every engine holds the same settings version and settings. False after an "
        "update failed half-way or an engine restarted with its defaults; the next successful PUT makes it true."
    )
    etag: str = Field(
        description="The ETag header: covers every worker's version and settings. Send it as If-Match to update "
        "only these settings."
    )
    engine_settings: list[EngineSettings] = Field(description="Per worker: its settings version and settings.")
    snapshot_age_s: float = _snapshot_age()
    workers: list[FlashHeadStatus]


class FlashHeadUpdateResponse(BaseModel):
    applied: dict[str, Any] = Field(description="The update as sent (the fields given).")
    settings: dict[str, Any] = Field(
        description="The whole settings now in force on every worker of the engines listed: the update over the "
        "settings that were in force."
    )
    settings_version: int = Field(description="The settings version every worker now holds (one per 200).")
    transaction: str = Field(description="The update's transaction id (in the audit).")
    etag: str = Field(description="The ETag of GET /flashhead after this update (also the ETag header).")
    engine_settings: list[EngineSettings] = Field(description="Per worker: the version and settings it reported.")
    engines: list[int] = Field(description="Data-parallel ranks of the engines the update covered.")
    other_nodes_untouched: bool = Field(
        description="True under hybrid or external DP load balancing: this API server manages only its node's "
        "engines, and the other nodes' were not updated (send the PUT to each node's API server)."
    )
    num_workers: int
    workers: list[CommitReply]


# ---------------------------------------------------------------------- audit
class AuditResponse(BaseModel):
    size: int = Field(description="How many entries each record keeps (MY_PKG_AUDIT_SIZE).")
    api_server: str = Field(description="The API server that answered (refusals are its own).")
    mutations: list[AuditEntry] = Field(
        description="Oldest first: updates applied or rejected, as the engines recorded them (the same from "
        "every API server), and this API server's updates that never reached them (pending, failed)."
    )
    refusals: list[AuditEntry] = Field(
        description="Refused mutations seen by this API server, one entry per caller, route and reason with a "
        "count; least recent first."
    )
