"""The base of every worker reply, and what a worker is: its identity and configuration.

Replies keep keys the models do not declare (`extra="allow"`) and pass them through to the admin API
untyped, so that a newer worker's key neither makes the worker's method raise nor makes the endpoint
half answer 503; a declared field with the wrong type is refused on both sides.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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
