"""Response models of the admin API (shown in OpenAPI).

The per-worker entries are the contract's worker replies (`my_pkg.contract`), so the API
shows exactly what the engine half sends; the models here only wrap them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from my_pkg.contract import FlashHeadStatus, MemoryInfo, PingReply, WorkerConfig, WorkerIdentity



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
    """A worker's identity (fetched once) with its memory (from the status snapshot)."""

    memory: MemoryInfo = Field(default_factory=MemoryInfo)


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
class FlashHeadStatusResponse(BaseModel):
    num_workers: int
    snapshot_age_s: float = _snapshot_age()
    workers: list[FlashHeadStatus]


class FlashHeadUpdateResponse(BaseModel):
    applied: dict[str, Any] = Field(description="The update applied on all workers.")
    num_workers: int
    workers: list[FlashHeadStatus]


# ---------------------------------------------------------------------- audit
class AuditResponse(BaseModel):
    size: int = Field(description="How many entries the ring keeps (MY_PKG_AUDIT_SIZE).")
    num_entries: int
    entries: list[dict[str, Any]] = Field(
        description="Oldest first: time, request_id, role, token_source, token_sha256_prefix, "
        "client, method, path, status_code, result, and update/before/after/reason where known."
    )
