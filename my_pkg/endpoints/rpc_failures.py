"""Worker RPC failures as API errors: which failure it is, and the error it answers.

How a worker RPC failure reaches the API server (vLLM v1, multiprocess
engine core): the engine core runs ``collective_rpc`` as a utility call and,
when it raises, sends back only ``"Call to collective_rpc method failed:
<str(exc)>"``; the client turns that into a plain ``Exception``.  The original
type is therefore lost and is recovered from the text:

* a worker raising ``X`` -> ``Exception("... Worker failed with error 'X' ...")``
  (the multiprocess executor wraps it in ``RuntimeError`` first);
* an unknown worker method -> the worker raises ``NotImplementedError("Method
  'name' is not implemented.")``, which arrives as text in the same way;
* an executor timeout -> ``TimeoutError("RPC call to name timed out.")``,
  again as text.

In-process clients (and tests) may raise the original types, so both the
type (walking ``__cause__``/``__context__``) and the text are checked.
`classify_rpc_error` is the one entry point: 503 when the engine half is
missing, the engine is dead or a worker raised (its text for admin callers
only), 504 on a timeout.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from my_pkg.endpoints.config import ENV_RPC_TIMEOUT, diagnose_engine_half
from my_pkg.endpoints.errors import AdminAPIError, truncate

# vLLM's run_method raises NotImplementedError for an unknown name on some
# executors; the CPU/GPU worker wrapper's attribute lookup raises AttributeError
# on others. Either way only the text reaches the API server.
_NOT_IMPLEMENTED_RE = re.compile(r"Method '([^']*)' is not implemented|object has no attribute '(my_pkg_[A-Za-z_]*)'")
_TIMEOUT_RE = re.compile(r"RPC call to \S+ timed out")


def _exception_chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


def is_engine_half_missing(exc: BaseException) -> bool:
    """True when the failure means the worker does not know the method."""
    for e in _exception_chain(exc):
        if isinstance(e, NotImplementedError):
            return True
        if isinstance(e, AttributeError) and "'my_pkg_" in str(e):
            return True
        if _NOT_IMPLEMENTED_RE.search(str(e)):
            return True
    return False


def is_timeout(exc: BaseException) -> bool:
    for e in _exception_chain(exc):
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            return True
        if _TIMEOUT_RE.search(str(e)):
            return True
    return False


def _is_engine_dead(exc: BaseException) -> bool:
    # vllm.v1.engine.exceptions.EngineDeadError, matched by name so that this
    # module does not import vLLM.
    return any(type(e).__name__ == "EngineDeadError" for e in _exception_chain(exc))


def engine_half_missing_error(method: str, detail: str | None = None) -> AdminAPIError:
    cause, message, hint = diagnose_engine_half()
    return AdminAPIError(
        503,
        message,
        type="engine_plugin_missing",
        hint=hint,
        cause=cause,
        method=method,
        detail=truncate(detail) if detail else None,
        internal=bool(detail),
    )


def engine_dead_error(detail: str = "vLLM reports it as errored", **extra: Any) -> AdminAPIError:
    return AdminAPIError(
        503,
        f"The engine is not running ({detail}).",
        type="engine_dead",
        hint="See the server log for the root cause; restart the server.",
        **extra,
    )


def rpc_timeout_error(what: str, timeout_s: float, **extra: Any) -> AdminAPIError:
    return AdminAPIError(
        504,
        f"{what} did not complete within {timeout_s:g} s.",
        type="timeout_error",
        hint=(
            "The workers may be busy or stalled; the call is still pending in the "
            "engine and its late reply will be dropped. Check the server log; raise "
            f"{ENV_RPC_TIMEOUT} if the workers are merely slow."
        ),
        **extra,
    )


def classify_rpc_error(exc: BaseException, method: str, timeout_s: float) -> AdminAPIError:
    """Turn a failure of ``collective_rpc(method)`` into an API error."""
    if isinstance(exc, AdminAPIError):
        return exc
    if is_timeout(exc):
        return rpc_timeout_error(f"Worker RPC {method}", timeout_s, method=method)
    if is_engine_half_missing(exc):
        return engine_half_missing_error(method, _describe(exc))
    if _is_engine_dead(exc):
        return engine_dead_error(_describe(exc), method=method)
    return AdminAPIError(
        503,
        f"Worker RPC {method} failed: {_describe(exc)}",
        type="worker_error",
        hint="See the server log for the worker's stack trace.",
        method=method,
        internal=True,
    )
