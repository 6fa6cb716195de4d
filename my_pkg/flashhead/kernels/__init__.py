"""Kernel backends of FlashHead and their registry.

A backend is a module with one required function, stage 2's::

    candidate_logits(hidden [B,H], weight [V',H], members [C,cap] int64, probes [B,P] int64, *,
                     token_cluster [V'] int64 | None = None, extra_ids [B,N] int64 | None = None)
        -> (token_ids [B, P*cap (+ N)] int64, logits [B, P*cap (+ N)] in weight dtype)

``token_ids[b]`` are ``members[probes[b]]`` flattened, then ``extra_ids[b]`` when given (a sampled
row's rescored tail tokens), and ``logits[b, j]`` is ``weight[token_ids[b, j]] . hidden[b]``.
``token_cluster`` (each head row's cluster id, ``C`` for rows in no cluster; given on CPU) lets a
backend score a batch cluster by cluster instead of row by row; a backend may ignore it.  ``members``
pads a cluster by repeating its first member, and an empty cluster (a vocabulary shard under tensor
parallelism holds none of its members) by token 0.  Registered here:

* ``torch`` (:mod:`.torch_ref`): pure torch, every device; the CPU path and the reference;
* ``triton`` (:mod:`.triton_kernels`): CUDA, imported only when chosen and Triton imports.

and two optional ones, which default to the torch backend's (:mod:`.torch_ref`) when a module does not
define them::

    stage1_scores(hidden [B,H], centroids [C,H] or hidden-major) -> [B, C] centroid scores
    token_logits(hidden [B,H], weight [V',H], ids [B,N] int64) -> [B, N] exact logits of any ids

A head resolves its backend's functions once (:func:`load_ops`) and calls them through :class:`KernelOps`.

``FlashHead(backend="auto")`` takes the first backend registered for the weight's device type whose
``available()`` is true, else ``torch``.  Adding a backend: see ``README.md`` next to this file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "Backend",
    "KernelOps",
    "register_backend",
    "backend_names",
    "resolve_backend",
    "load_backend",
    "load_ops",
    "triton_available",
]


def triton_available() -> bool:
    """True when Triton can be imported (it is never imported at package import time)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Triton install raises more than ImportError
        return False
    return True


@dataclass(frozen=True)
class Backend:
    """A registered backend: the module that implements it, when it can run, where ``auto`` picks it."""

    name: str
    module: str
    available: Callable[[], bool]
    auto_devices: tuple[str, ...]


_BACKENDS: dict[str, Backend] = {}


def register_backend(
    name: str, module: str, *, available: Callable[[], bool] = lambda: True, auto_devices: tuple[str, ...] = ()
) -> None:
    """Register ``module`` (imported lazily) as backend ``name``; ``auto`` picks it for ``auto_devices``."""
    if name == "auto":
        raise ValueError("'auto' is not a backend name")
    _BACKENDS[name] = Backend(name, module, available, tuple(auto_devices))


def backend_names() -> tuple[str, ...]:
    """Every value ``FlashHead(backend=...)`` takes: ``auto`` and the registered names."""
    return ("auto", *_BACKENDS)


def resolve_backend(name: str, device_type: str) -> str:
    """The backend ``name`` stands for on ``device_type``; ``ValueError`` when unknown or unavailable."""
    if name == "auto":
        for backend in _BACKENDS.values():
            if device_type in backend.auto_devices and backend.available():
                return backend.name
        return "torch"
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"backend must be one of {', '.join(map(repr, backend_names()))}, got {name!r}")
    if not backend.available():
        raise ValueError(f"backend {name!r} requested but it cannot run here (its imports are missing)")
    return name


def load_backend(name: str) -> ModuleType:
    """The module of a registered backend (imported on first use)."""
    return importlib.import_module(_BACKENDS[name].module)


@dataclass(frozen=True)
class KernelOps:
    """One backend's functions, resolved once per head: the backend's own, or the torch backend's where the
    backend does not define an optional one."""

    name: str
    stage1_scores: Callable[..., torch.Tensor]
    candidate_logits: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    token_logits: Callable[..., torch.Tensor]


def load_ops(name: str, cpu_plan: Any = None) -> KernelOps:
    """The functions of registered backend ``name`` (a resolved name, not ``auto``); ``cpu_plan`` (a
    :class:`~.torch_ref.CpuPlan`, the torch backend only) replaces its default plan."""
    module, torch_backend = load_backend(name), load_backend("torch")
    ops = KernelOps(
        name=name,
        stage1_scores=getattr(module, "stage1_scores", torch_backend.stage1_scores),
        candidate_logits=module.candidate_logits,
        token_logits=getattr(module, "token_logits", torch_backend.token_logits),
    )
    if cpu_plan is None:
        return ops
    if name != "torch":
        raise ValueError(f"cpu_plan is an option of the torch backend, not of {name!r}")
    return replace(
        ops,
        candidate_logits=partial(ops.candidate_logits, plan=cpu_plan),
        token_logits=partial(ops.token_logits, plan=cpu_plan),
    )


register_backend("torch", f"{__name__}.torch_ref")
register_backend("triton", f"{__name__}.triton_kernels", available=triton_available, auto_devices=("cuda",))
