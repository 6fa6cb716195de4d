"""Audit log of the admin API: who changed what, and who was refused.

Every mutation, and every refused mutation from an authenticated caller,
becomes one entry: a JSON line on the logger ``vllm.my_pkg.endpoints.audit``
and an item of a bounded in-memory ring served at ``GET /plugins/my_pkg/audit``
(admin role). Tokens never appear, only where they came from and the first 8
hex digits of their SHA-256.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request

from my_pkg import env
from my_pkg.endpoints.config import LOGGER_NAME, STATE_ATTR

audit_logger = logging.getLogger(f"{LOGGER_NAME}.audit")

ENV_AUDIT_SIZE = "MY_PKG_AUDIT_SIZE"
DEFAULT_AUDIT_SIZE: int = env.VARIABLES[ENV_AUDIT_SIZE].default
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id(request: Request) -> str:
    """The caller's `X-Request-Id` when it is a sane token, else a new one; stable per request."""
    existing = getattr(request.state, "my_pkg_request_id", None)
    if existing:
        return existing
    given = request.headers.get(REQUEST_ID_HEADER, "")
    value = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
    request.state.my_pkg_request_id = value
    return value


def caller(request: Request) -> dict[str, Any]:
    """Who sent `request`, as the auth dependency recorded it."""
    client = request.client
    return {
        "request_id": request_id(request),
        "role": getattr(request.state, "my_pkg_role", None),
        "token_source": getattr(request.state, "my_pkg_token_source", None),
        "token_sha256_prefix": getattr(request.state, "my_pkg_token_fingerprint", None),
        "client": f"{client.host}:{client.port}" if client else None,
        "method": request.method,
        "path": request.url.path,
    }


def _size_from_env() -> int:
    return env.MY_PKG_AUDIT_SIZE


class AuditLog:
    """A bounded ring of audit entries, newest last."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size if size is not None else _size_from_env()
        self._entries: deque[dict[str, Any]] = deque(maxlen=self.size)

    def record(self, who: dict[str, Any], status_code: int, result: str, **details: Any) -> dict[str, Any]:
        entry = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            **who,
            "status_code": status_code,
            "result": result,
            **details,
        }
        self._entries.append(entry)
        audit_logger.info("%s", json.dumps(entry, default=str, sort_keys=True))
        return entry

    def entries(self) -> list[dict[str, Any]]:
        return list(self._entries)


def record_refusal(request: Request, status_code: int, reason: str) -> None:
    """Record a mutation refused to `request`'s caller in the app's audit log (if the plugin is set up)."""
    log = getattr(getattr(request.app.state, STATE_ATTR, None), "audit", None)
    if isinstance(log, AuditLog):
        log.record(caller(request), status_code, "refused", reason=reason)
