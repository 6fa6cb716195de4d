"""The audit a worker keeps: what an API server may send it with a commit or a rejection, and its entries.

`AuditInput` comes from an API server (`extra="forbid"`, bounded strings); `AuditEntry` is what a worker
keeps and answers (`extra="allow"`, like every reply).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from my_pkg.contract.replies import RankedReply
from my_pkg.contract.update import update_errors

_Short = Annotated[str, Field(max_length=200)]


class AuditInput(BaseModel):
    """What an API server may send a worker to keep with a commit or a rejection: who asked, for what, and
    why it was refused. The worker adds the time, the outcome, the transaction and its version itself."""

    model_config = ConfigDict(extra="forbid")

    request_id: _Short | None = None
    api_server: _Short | None = None
    role: _Short | None = None
    token_source: _Short | None = None
    token_fingerprint: _Short | None = None
    client: _Short | None = None
    method: _Short | None = None
    path: _Short | None = None
    engines: list[int] | None = Field(default=None, max_length=4096)
    update: dict[str, Any] | None = None
    status_code: int | None = Field(default=None, ge=100, le=599)
    error_type: _Short | None = None
    reason: Annotated[str, Field(max_length=2000)] | None = None

    @model_validator(mode="after")
    def _update_is_an_update(self) -> AuditInput:
        if self.update is not None and update_errors(self.update):
            raise ValueError("update: not a FlashHead update")
        return self


class AuditEntry(BaseModel):
    """One audit record: a mutation (applied, partial, rejected, failed, pending) or refusals of one caller,
    counted."""

    model_config = ConfigDict(extra="allow")

    time: str = Field(description="When it happened (UTC, ISO 8601); for refusals, the latest one.")
    result: str = Field(description="applied, partial, rejected, failed, pending or refused.")
    status_code: int
    request_id: str | None = None
    api_server: str | None = Field(default=None, description="The API server that answered the request.")
    role: str | None = None
    token_source: str | None = None
    token_fingerprint: str | None = Field(
        default=None, description="HMAC of the token with a per-process key: equal within one process only."
    )
    client: str | None = None
    method: str | None = None
    path: str | None = None
    transaction: str | None = None
    settings_version: int | None = None
    engines: list[int] | None = Field(default=None, description="Data-parallel ranks the mutation covered.")
    update: dict[str, Any] | None = None
    settings: dict[str, Any] | None = Field(
        default=None, description="The whole settings the update committed (the update over the settings in force)."
    )
    before: list[dict[str, Any]] | None = None
    error_type: str | None = None
    reason: str | None = None
    committed_engines: list[int] | None = Field(
        default=None, description="Data-parallel ranks whose engines committed the update (partial, failed)."
    )
    outcomes: list[dict[str, Any]] | None = Field(
        default=None,
        description="Per engine: `dp_rank` and `outcome` (committed, aborted, failed, refused, not_reached).",
    )
    answered_status_code: int | None = Field(
        default=None,
        description="What the caller was told, where it differs from the outcome: 504 for an update that applied "
        "after its caller stopped waiting.",
    )
    count: int = Field(default=1, description="Refusals: how many were collapsed into this entry.")
    first_time: str | None = Field(default=None, description="Refusals: when the first one happened.")


class AuditReply(RankedReply):
    entries: list[AuditEntry] = Field(default_factory=list)
