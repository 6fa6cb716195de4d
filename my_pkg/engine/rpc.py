"""Worker methods reached through `engine_client.collective_rpc("my_pkg_...")`.

Each function here is attached to vLLM's `WorkerBase` by
`patches/worker.py`, so `self` is the worker (CPU, GPU or any other type) and
every rank answers. Names, arguments and replies are those of `my_pkg.contract`:
each reply is built as its contract model and leaves as `model_dump(mode="json")`,
made plain JSON data again on the way out (no worker object, tensor, config object
or `str` subclass ever leaves the worker).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from my_pkg import PLUGIN_NAME, __version__
from my_pkg.contract import (
    CONFIG_SECTIONS,
    AuditInput,
    AuditReply,
    CommitReply,
    FlashHeadState,
    FlashHeadStatus,
    FlashHeadUpdate,
    LeaseReply,
    MemoryInfo,
    PingReply,
    PrepareReply,
    SettingsValues,
    TopPCounters,
    Transaction,
    ValidationReply,
    WorkerConfig,
    WorkerIdentity,
    WorkerStatus,
    update_errors,
)
from my_pkg.engine.admin_ledger import AdminLedger, ledger_of
from my_pkg.engine.jsonable import plain, redacted_section
from my_pkg.engine.patches import top_p_sampler
from my_pkg.engine.vllm_uses import attributes

#: What these methods read on the vLLM worker they are attached to, and on its runner and configs
#: (`my_pkg.devtools.compat` checks them; `import vllm` and `vllm.__version__` it derives).
VLLM_SYMBOLS = (
    *attributes(
        "vllm.v1.worker.worker_base:WorkerBase",
        "rank",
        "local_rank",
        "device",
        "model_runner",
        "model_config",
        "cache_config",
        "parallel_config",
        "scheduler_config",  # my_pkg_config reads f"{section}_config" for each of CONFIG_SECTIONS
    ),
    *attributes("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "kv_caches"),
    *attributes("vllm.config:ParallelConfig", "world_size"),
    *attributes("vllm.config:ModelConfig", "model", "dtype", "served_model_name", "max_model_len"),
    *attributes("vllm.config:CacheConfig", "block_size", "num_gpu_blocks"),
)


def _rank(worker: Any) -> int:
    return int(getattr(worker, "rank", 0) or 0)


def _reply(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


def my_pkg_ping(self: Any) -> dict[str, Any]:
    """Cheapest proof that the engine half is loaded in this worker."""
    return _reply(PingReply(plugin=PLUGIN_NAME, version=__version__, rank=_rank(self), pid=os.getpid()))


def _process_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _kv_cache_bytes(worker: Any) -> int | None:
    runner = getattr(worker, "model_runner", None)
    caches = getattr(runner, "kv_caches", None)
    if not caches:
        return None
    total = 0
    for cache in caches:
        tensors = cache if isinstance(cache, (list, tuple)) else [cache]
        for tensor in tensors:
            if hasattr(tensor, "untyped_storage"):
                total += tensor.numel() * tensor.element_size()
    return total


def _device_memory(device: Any) -> tuple[int | None, int | None]:
    import torch

    if device is None or getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None, None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def _memory(worker: Any) -> MemoryInfo:
    allocated, reserved = _device_memory(getattr(worker, "device", None))
    return MemoryInfo(
        device_allocated_bytes=allocated,
        device_reserved_bytes=reserved,
        process_rss_bytes=_process_rss_bytes(),
        kv_cache_bytes=_kv_cache_bytes(worker),
    )


def my_pkg_worker_info(self: Any) -> dict[str, Any]:
    """Identity, versions, model and KV-cache shape of this worker: nothing that changes while it runs."""
    import torch

    try:
        import vllm

        vllm_version = getattr(vllm, "__version__", None)
    except ImportError:  # pragma: no cover - the method only runs inside vLLM
        vllm_version = None
    model_config = getattr(self, "model_config", None)
    cache_config = getattr(self, "cache_config", None)
    parallel_config = getattr(self, "parallel_config", None)
    device = getattr(self, "device", None)
    num_blocks = getattr(cache_config, "num_gpu_blocks", None)
    return _reply(
        WorkerIdentity.model_validate(
            {
                "rank": _rank(self),
                "local_rank": int(getattr(self, "local_rank", 0) or 0),
                "world_size": int(getattr(parallel_config, "world_size", 1) or 1),
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
                "device": str(device) if device is not None else None,
                "plugin_version": __version__,
                "torch_version": str(torch.__version__),
                "vllm_version": vllm_version,
                "model": {
                    "name": str(getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")),
                    "path": str(getattr(model_config, "model", "")),
                    "dtype": str(getattr(model_config, "dtype", "")).removeprefix("torch."),
                    "max_model_len": getattr(model_config, "max_model_len", None),
                },
                "kv_cache": {
                    "block_size": getattr(cache_config, "block_size", None),
                    "num_blocks": int(num_blocks) if num_blocks is not None else None,
                },
            }
        )
    )


def my_pkg_config(self: Any, section: str) -> dict[str, Any]:
    """One vLLM config section of this worker as JSON-safe data, by the section's allowlist (`jsonable`)."""
    if section not in CONFIG_SECTIONS:
        raise ValueError(f"unknown config section {section!r}; valid: {', '.join(CONFIG_SECTIONS)}")
    config = getattr(self, f"{section}_config", None)
    return _reply(WorkerConfig(rank=_rank(self), section=section, config=redacted_section(config, section)))


def _controller(worker: Any):
    from my_pkg.engine.patches.runner_hooks import find_controller

    return find_controller(worker)


def _no_controller_reason() -> tuple[str, str]:
    """Why this worker has no FlashHead controller: `(code, message)`."""
    from my_pkg.engine.patches import no_controller_status

    status = no_controller_status()
    return status.reason_code, status.reason


def _flashhead_state(worker: Any) -> FlashHeadState:
    """The controller's `status()` (a `FlashHeadState`), or why this worker has none."""
    from my_pkg.engine.patches import no_controller_status

    controller = _controller(worker)
    return controller.status() if controller is not None else no_controller_status()


def my_pkg_status(self: Any) -> dict[str, Any]:
    """Everything about this worker that changes while it runs: memory, FlashHead state and counters, the sort-free
    top-p's counters."""
    return _reply(
        WorkerStatus(
            rank=_rank(self),
            pid=os.getpid(),
            memory=_memory(self),
            settings_version=_ledger(self).version,
            flashhead=_flashhead_state(self),
            top_p=TopPCounters.model_validate(top_p_sampler.counters()),
        )
    )


def my_pkg_flashhead_status(self: Any) -> dict[str, Any]:
    """FlashHead state and counters of this worker."""
    state = _flashhead_state(self).model_dump()
    return _reply(FlashHeadStatus.model_validate({**state, "rank": _rank(self), "pid": os.getpid()}))


def _update_errors(worker: Any, update: Any) -> list[str]:
    """The contract's checks of `update`, then this worker's own (FlashHead available, cluster count)."""
    errors = update_errors(update)
    if errors:
        return errors
    controller = _controller(worker)
    if controller is None:
        return [_no_controller_reason()[1]]
    return controller.validate(FlashHeadUpdate.model_validate(update))


def my_pkg_flashhead_validate(self: Any, update: dict[str, Any]) -> dict[str, Any]:
    """Errors `update` would cause on this worker (empty when it can be applied); changes nothing."""
    return _reply(ValidationReply(rank=_rank(self), errors=_update_errors(self, update)))


def _ledger(worker: Any) -> AdminLedger:
    from my_pkg import env

    return ledger_of(worker, env.MY_PKG_AUDIT_SIZE)


def _transaction(txn: Any) -> Transaction:
    """`txn` checked against the contract (bounded lease and version, nothing undeclared); ValueError if not."""
    try:
        return Transaction.model_validate(txn)
    except ValidationError as exc:
        raise ValueError(f"invalid transaction: {exc.error_count()} error(s), first: {_first_error(exc)}") from None


def _audit_input(entry: Any) -> dict[str, Any] | None:
    """`entry` checked against the contract's `AuditInput` (what a caller may say); ValueError if not."""
    if entry is None:
        return None
    try:
        return AuditInput.model_validate(entry).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise ValueError(f"invalid audit entry: {exc.error_count()} error(s), first: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False, include_input=False)[0]
    return f"{'.'.join(str(part) for part in first['loc']) or 'value'}: {first['msg']}"


def _settings_now(worker: Any) -> SettingsValues:
    return SettingsValues.of_state(_flashhead_state(worker))


def _apply_settings(worker: Any, settings: dict[str, Any]) -> None:
    """Bring this worker to `settings` (validated again: nothing may have changed since the prepare). Only the
    fields that differ are applied, so a commit that changes nothing costs nothing (no re-timing)."""
    controller = _controller(worker)
    if controller is None:
        raise RuntimeError("FlashHead is not available on this worker")
    errors = _update_errors(worker, settings)
    if errors:
        raise ValueError("; ".join(errors))
    now = _settings_now(worker).model_dump()
    changed = {name: value for name, value in settings.items() if now.get(name) != value}
    if changed:
        controller.apply(FlashHeadUpdate.model_validate(changed))


def _commit_reply(worker: Any, ledger: AdminLedger) -> dict[str, Any]:
    status = my_pkg_flashhead_status(worker)
    return _reply(CommitReply.model_validate({**status, "settings_version": ledger.version}))


def my_pkg_flashhead_apply(self: Any, update: dict[str, Any]) -> dict[str, Any]:
    """Apply `update` on this worker alone, as one settings version; it takes effect from the next decode step.

    For `LLM.collective_rpc` (one process, nothing to serialise against but the API servers): refused while
    an API server's update holds this worker's lease.
    """
    ledger = _ledger(self)
    txn = Transaction(id=f"local-{os.getpid()}-{ledger.version}", holder=f"local pid {os.getpid()}", lease_s=1.0)
    conflict = ledger.conflict(txn)
    if conflict is not None:
        raise RuntimeError(f"another update holds this worker's lease ({conflict[1]})")
    _apply_settings(self, _settings_now(self).whole(update) if not update_errors(update) else update)
    ledger.applied_locally()
    return _commit_reply(self, ledger)


def my_pkg_flashhead_prepare(self: Any, update: dict[str, Any], txn: dict[str, Any]) -> dict[str, Any]:
    """Phase 1: validate `update` and take this worker's lease for `txn`; changes no setting."""
    transaction = _transaction(txn)
    ledger = _ledger(self)
    conflict = ledger.conflict(transaction)
    errors = [] if conflict is not None else _update_errors(self, update)
    granted = conflict is None and not errors
    if granted:
        ledger.take(transaction)
    return _reply(
        PrepareReply(
            rank=_rank(self),
            granted=granted,
            version=ledger.version,
            errors=errors,
            conflict=conflict[0] if conflict else None,
            holder=conflict[1] if conflict else None,
            before=_settings_now(self),
        )
    )


def my_pkg_flashhead_commit(
    self: Any, settings: dict[str, Any], txn: dict[str, Any], entry: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Phase 2: bring this worker to the whole `settings`, set the transaction's version, keep `entry` in the
    audit, release the lease. Refused unless `txn` still holds the lease, the version is the one it prepared on
    and the new version is higher. Committing the same transaction again answers the same (changes nothing)."""
    transaction = _transaction(txn)
    given = _audit_input(entry)
    ledger = _ledger(self)
    if ledger.last_commit is not None and ledger.last_commit[0] == transaction.id:
        return ledger.last_commit[1]
    refusal = ledger.commit_refusal(transaction)
    if refusal is not None:
        raise RuntimeError(f"{refusal}; not applied here")
    before = {"rank": _rank(self), **_settings_now(self).model_dump()}
    _apply_settings(self, settings)
    ledger.committed(transaction, settings, given if _rank(self) == 0 else None, before)  # rank 0 keeps the audit
    reply = _commit_reply(self, ledger)
    ledger.last_commit = (transaction.id, reply)
    return reply


def my_pkg_flashhead_abort(self: Any, txn: dict[str, Any], entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """Release the lease of `txn` without applying anything; keep `entry` (a rejected update) in the audit."""
    transaction = _transaction(txn)
    given = _audit_input(entry)
    ledger = _ledger(self)
    released = ledger.release(transaction.id)
    if given is not None and _rank(self) == 0:
        ledger.keep_rejected(given, transaction.id)
    return _reply(LeaseReply(rank=_rank(self), released=released, version=ledger.version))


def my_pkg_audit(self: Any) -> dict[str, Any]:
    """The audit entries this worker keeps, oldest first (rank 0 of each engine keeps them; others send none)."""
    entries = _ledger(self).entries() if _rank(self) == 0 else []
    return _reply(AuditReply(rank=_rank(self), entries=entries))


def _returns_plain_data(method: Callable[..., Any]) -> Callable[..., Any]:
    """Every result leaves the worker as plain JSON data.

    vLLM's engine core serialises RPC results with msgpack and refuses unknown
    types (a `str` subclass such as `torch.__version__` included); such a refusal
    happens on the engine's output thread, so it must never reach it.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return plain(method(self, *args, **kwargs))

    return wrapper


WORKER_METHODS = {
    fn.__name__: _returns_plain_data(fn)
    for fn in (
        my_pkg_ping,
        my_pkg_worker_info,
        my_pkg_config,
        my_pkg_status,
        my_pkg_flashhead_status,
        my_pkg_flashhead_validate,
        my_pkg_flashhead_apply,
        my_pkg_flashhead_prepare,
        my_pkg_flashhead_commit,
        my_pkg_flashhead_abort,
        my_pkg_audit,
    )
}
