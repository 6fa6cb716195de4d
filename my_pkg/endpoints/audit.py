"""Audit of the admin API: who changed what, who was refused, and how often authentication failed.

Records kept apart so that abuse of one cannot wipe another:

* **mutations** live in the engines (`my_pkg.engine.admin_ledger`): each worker writes the update it applied
  and, collapsed with a count, the ones it rejected, so every API server reads the same history;
* **the log** is the durable record: every transaction's outcome (applied, rejected, partial, failed,
  pending), from whichever API server ran it, is one JSON line on the `...endpoints.audit` logger, with
  its transaction id and the outcome on every engine;
* **this API server's mutations** the engines did not record as such (pending when the wait expired,
  failed or partial) are kept here, in a ring of their own, and folded into the engines' entry of their
  transaction when read;
* **refusals** (401, 403, 422 on a mutating route; 409 of an update already running here) collapse per
  caller, route and reason into one entry with a count, in a bounded table: a flood of refused calls
  costs one entry, never the mutations. Unauthenticated refusals have a table of their own, one entry per
  route and reason: a caller that chooses its token and address at will cannot evict anything.

Failed authentication is also counted on vLLM's `/metrics` (`my_pkg_admin_auth_failures_total{reason}`)
and logged at most once a minute per reason and client. Tokens never appear: only where they came from
and an HMAC of them under a key made when the process starts (so the fingerprint of a weak token cannot
be checked offline, and it is comparable within one API server only).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from collections import OrderedDict, deque
from datetime import datetime, timezone
from typing import Any

from prometheus_client import Counter
from starlette.requests import Request

from my_pkg import env
from my_pkg.endpoints.config import LOGGER_NAME, STATE_ATTR

audit_logger = logging.getLogger(f"{LOGGER_NAME}.audit")

ENV_AUDIT_SIZE = "MY_PKG_AUDIT_SIZE"
DEFAULT_AUDIT_SIZE: int = env.VARIABLES[ENV_AUDIT_SIZE].default
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: How much of a caller's own X-Request-Id the audit keeps (vLLM echoes it whole).
MAX_KEPT_REQUEST_ID = 200
#: Seconds between two log lines of failed authentication for one reason and client.
AUTH_LOG_INTERVAL_S = 60.0

_FINGERPRINT_KEY = secrets.token_bytes(32)

#: Failed authentication by reason (missing/invalid token, no token configured, read role on a mutation,
#: admin-only route). In vLLM's multi-API-server mode each process counts its own and /metrics sums them.
AUTH_FAILURES = Counter(
    "my_pkg_admin_auth_failures",
    "Requests to the my_pkg admin routes refused by authentication, by reason.",
    ["reason"],
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def fingerprint(token: str) -> str:
    """HMAC-SHA256 of `token` under this process's key, 16 hex digits: never a plain hash."""
    return hmac.new(_FINGERPRINT_KEY, token.encode("utf-8"), hashlib.sha256).hexdigest()[:16]


def request_id(request: Request) -> str:
    """This request's id, stable per request.

    With vLLM's `--enable-request-id-headers` its middleware writes the `X-Request-Id` answer header (the
    plugin then writes none, so one goes out): the id is the caller's header, raw, as vLLM echoes it.
    Otherwise the plugin writes the header itself: the caller's when it is a sane token, else a new one.
    """
    existing = getattr(request.state, "my_pkg_request_id", None)
    if existing:
        return existing
    given = request.headers.get(REQUEST_ID_HEADER, "")
    state = getattr(request.app.state, STATE_ATTR, None)
    if getattr(state, "request_id_headers", False) is True:
        # vLLM echoes the caller's id raw; without one it makes its own at the response, out of reach:
        # the audit then has this one (documented: send X-Request-Id to correlate).
        value = given[:MAX_KEPT_REQUEST_ID] if given else uuid.uuid4().hex
    else:
        value = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    request.state.my_pkg_request_id = value
    return value


def writes_request_id_header(request: Request) -> bool:
    """False when vLLM's own middleware writes `X-Request-Id` (one header, not two)."""
    state = getattr(request.app.state, STATE_ATTR, None)
    return getattr(state, "request_id_headers", False) is not True


def caller(request: Request) -> dict[str, Any]:
    """Who sent `request`, as authentication recorded it, and which API server answered."""
    client = request.client
    state = getattr(request.app.state, STATE_ATTR, None)
    return {
        "request_id": request_id(request),
        "api_server": getattr(state, "identity", None),
        "role": getattr(request.state, "my_pkg_role", None),
        "token_source": getattr(request.state, "my_pkg_token_source", None),
        "token_fingerprint": getattr(request.state, "my_pkg_token_fingerprint", None),
        "client": f"{client.host}:{client.port}" if client else None,
        "method": request.method,
        "path": request.url.path,
    }


def _log(entry: dict[str, Any]) -> None:
    audit_logger.info("%s", json.dumps(entry, default=str, sort_keys=True))


class AuditLog:
    """This API server's share of the audit: its own mutation outcomes, and refusals collapsed with a count."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size if size is not None else env.MY_PKG_AUDIT_SIZE
        self._mutations: deque[dict[str, Any]] = deque(maxlen=self.size)
        self._refusals: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._unauthenticated: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._auth_logged: dict[tuple[str, str | None], tuple[float, int]] = {}

    def record(
        self, who: dict[str, Any], status_code: int, result: str, *, keep: bool = True, **details: Any
    ) -> dict[str, Any]:
        """A mutation's outcome, logged as one JSON line; kept here too unless the engines keep it (`keep`)."""
        entry = {"time": now_iso(), **who, "status_code": status_code, "result": result, **details}
        entry = {k: v for k, v in entry.items() if v is not None}
        if keep:
            self._mutations.append(entry)
        _log(entry)
        return entry

    def refuse(self, who: dict[str, Any], status_code: int, reason: str) -> dict[str, Any]:
        """A refused mutation: counted into the entry of the same caller, route and reason."""
        client_host = (who.get("client") or "").rsplit(":", 1)[0]
        if who.get("role") is None:
            # Not authenticated: one entry per reason, never per presented token or address (an unauthenticated
            # caller chooses both, and must not be able to evict the other entries), in a table of its own.
            table = self._unauthenticated
            key: tuple[Any, ...] = (who.get("method"), who.get("path"), status_code, reason)
        else:
            table = self._refusals
            key = (who.get("token_fingerprint") or client_host, who.get("method"), who.get("path"), status_code, reason)
        entry = table.pop(key, None)
        if entry is None:
            entry = {
                "time": now_iso(),
                **who,
                "status_code": status_code,
                "result": "refused",
                "reason": reason,
                "count": 0,
                "first_time": now_iso(),
            }
            while len(table) >= self.size:
                table.popitem(last=False)
        entry["count"] += 1
        entry.update(time=now_iso(), request_id=who.get("request_id"), client=who.get("client"))
        if who.get("role") is None:
            entry.pop("token_fingerprint", None)  # the latest bogus token's says nothing about the others
        table[key] = entry  # most recent last
        if entry["count"] == 1 or entry["count"] % 100 == 0:  # the log shows the flood without one line per call
            _log(entry)
        return entry

    def auth_failed(self, reason: str, client: str | None, path: str) -> None:
        """Count a failed authentication and log it, at most once a minute per reason and client host."""
        AUTH_FAILURES.labels(reason=reason).inc()
        key = (reason, client)
        now = time.monotonic()
        last, suppressed = self._auth_logged.get(key, (-AUTH_LOG_INTERVAL_S, 0))
        if now - last < AUTH_LOG_INTERVAL_S:
            self._auth_logged[key] = (last, suppressed + 1)
            return
        if len(self._auth_logged) > 4096:
            self._auth_logged.clear()
        self._auth_logged[key] = (now, 0)
        audit_logger.warning(
            "my_pkg admin authentication failed (%s) from %s on %s%s",
            reason,
            client or "unknown client",
            path,
            f"; {suppressed} more from there in the last {AUTH_LOG_INTERVAL_S:g} s" if suppressed else "",
        )

    def mutations(self) -> list[dict[str, Any]]:
        return list(self._mutations)

    def refusals(self) -> list[dict[str, Any]]:
        """Authenticated callers' refusals, then the unauthenticated ones (per reason), least recent first."""
        return [*self._refusals.values(), *self._unauthenticated.values()]


def audit_of(request: Request) -> AuditLog | None:
    log = getattr(getattr(request.app.state, STATE_ATTR, None), "audit", None)
    return log if isinstance(log, AuditLog) else None


def record_refusal(request: Request, status_code: int, reason: str) -> None:
    """Record a mutation refused to `request`'s caller in the app's audit log (if the plugin is set up)."""
    log = audit_of(request)
    if log is not None:
        log.refuse(caller(request), status_code, reason)
