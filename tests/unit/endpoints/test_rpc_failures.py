"""`rpc_failures.classify_rpc_error`: a failed worker RPC, raised as its type or arriving only as text across
the engine core's process boundary, is the API error it means."""

from __future__ import annotations

import pytest

from my_pkg.endpoints.errors import AdminAPIError
from my_pkg.endpoints.rpc_failures import classify_rpc_error

METHOD = "my_pkg_status"


def engine_core_text(error: str) -> str:
    """What vLLM's multiprocess engine core sends back when a worker raises `error`."""
    return (
        f"Call to collective_rpc method failed: Worker failed with error '{error}', please check the stack "
        "trace above for the root cause"
    )


class EngineDeadError(Exception):
    """Stands in for vLLM's, which is matched by its name."""


def _caused_by(cause: BaseException) -> BaseException:
    try:
        raise RuntimeError("the client's wrapper") from cause
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "status_code", "error_type"),
    [
        (TimeoutError(), 504, "timeout_error"),
        (Exception(f"RPC call to {METHOD} timed out."), 504, "timeout_error"),
        (_caused_by(TimeoutError()), 504, "timeout_error"),
        (NotImplementedError(f"Method '{METHOD}' is not implemented."), 503, "engine_plugin_missing"),
        (Exception(engine_core_text(f"Method '{METHOD}' is not implemented.")), 503, "engine_plugin_missing"),
        (Exception(engine_core_text(f"'Worker' object has no attribute '{METHOD}'")), 503, "engine_plugin_missing"),
        (EngineDeadError("EngineCore encountered an issue"), 503, "engine_dead"),
        (Exception(engine_core_text("boom")), 503, "worker_error"),
    ],
)
def test_a_failure_is_the_error_it_means(exc, status_code, error_type):
    error = classify_rpc_error(exc, METHOD, 5.0)
    assert (error.status_code, error.type, error.extra["method"]) == (status_code, error_type, METHOD)


def test_a_workers_text_is_for_admin_callers_only():
    error = classify_rpc_error(Exception(engine_core_text("secret detail")), METHOD, 5.0)
    assert error.internal and "secret detail" in error.message
    assert "secret detail" not in error.public("req-1").message


def test_an_api_error_passes_through():
    error = AdminAPIError(409, "already an answer")
    assert classify_rpc_error(error, METHOD, 5.0) is error
