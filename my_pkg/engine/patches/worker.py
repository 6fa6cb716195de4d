"""Attach the `my_pkg_*` worker methods to vLLM's `WorkerBase` (every worker type, every rank)."""

from __future__ import annotations

from my_pkg.engine.rpc import WORKER_METHODS

TARGET = "vllm.v1.worker.worker_base.WorkerBase"


def apply() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for name, method in WORKER_METHODS.items():
        existing = WorkerBase.__dict__.get(name)
        if existing is not None and existing is not method:
            raise RuntimeError(f"{TARGET}.{name} is already defined by someone else")
    for name, method in WORKER_METHODS.items():
        setattr(WorkerBase, name, method)
