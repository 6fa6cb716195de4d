"""Versioned updates: a lease per worker, taken in ascending dp rank, then a commit.

`Transaction` names an update and its lease and is sent with every phase of it; the replies say what
each phase did on one worker. Every worker method that takes a transaction checks it here (bounded
lease, bounded version, nothing undeclared).
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from my_pkg.contract.replies import RankedReply
from my_pkg.contract.status import FlashHeadStatus
from my_pkg.contract.update import SettingsValues

#: The longest lease a worker grants (seconds): a caller cannot wedge updates for longer than this.
MAX_LEASE_S: Final = 600.0
#: The highest settings version a worker takes (15 digits, what `If-Match` accepts).
MAX_SETTINGS_VERSION: Final = 10**15 - 1
#: Transaction ids: what the API server makes (uuid4 hex), or any short token of these characters.
TRANSACTION_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,64}$"

SettingsVersion = Annotated[StrictInt, Field(ge=0, le=MAX_SETTINGS_VERSION)]


class Transaction(BaseModel):
    """Who runs an update and under which lease; sent with every phase of it. Checked by every worker method
    that takes it (bounded lease, bounded version, nothing undeclared)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=TRANSACTION_ID_PATTERN, description="Unique per update; names the lease and the audit.")
    holder: str = Field(max_length=200, description="The API server running it (host, pid, API-server index).")
    lease_s: float = Field(
        gt=0, le=MAX_LEASE_S, description="The lease lapses this many seconds after it was taken (at most 600)."
    )
    expected_version: SettingsVersion | None = Field(
        default=None, description="Compare-and-set: refuse unless the worker's version is this one."
    )
    new_version: SettingsVersion | None = Field(
        default=None,
        description="The version the commit sets: above the worker's (a worker refuses a non-increasing one).",
    )


class PrepareReply(RankedReply):
    """Phase 1 on one worker: `granted` when the update is valid here and the lease is now the transaction's."""

    granted: bool
    version: int = Field(description="The worker's settings version.")
    errors: list[str] = Field(default_factory=list, description="Why the update cannot be applied here.")
    conflict: str | None = Field(
        default=None, description="'busy' (another update holds the lease) or 'version' (compare-and-set failed)."
    )
    holder: str | None = Field(default=None, description="Who holds the lease when busy.")
    before: SettingsValues = Field(default_factory=SettingsValues)


class LeaseReply(RankedReply):
    released: bool
    version: int


class CommitReply(FlashHeadStatus):
    """Phase 2 on one worker: its FlashHead status after the update, and the version it now has."""

    settings_version: int
