"""The error catalog of the admin API: `AdminAPIError` and one constructor, with its hint, per error.

Every error leaves the plugin as a JSON body in vLLM's style::

    {"error": {"message": str, "type": str, "code": int, "hint": str | None,
               ...extra fields...}}

Every error answer of the plugin is built by a function of this module, or of
`rpc_failures` for a failed worker RPC. An error whose text comes from the
workers or from a bug (``internal=True``) is shown in full to admin callers
only; any other caller gets the type, a generic message and the request id,
and the details go to the server log. The 422 hint is generated from the
contract's `FlashHeadUpdate`.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse

from my_pkg import PLUGIN_NAME, __version__
from my_pkg.contract import CONFIG_SECTIONS, UPDATE_FIELDS, FlashHeadUpdate
from my_pkg.endpoints.config import (
    ENV_ADMIN_TOKEN,
    ENV_ALLOW_ANONYMOUS_READS,
    ENV_READ_TOKEN,
    ROUTE_PREFIX,
)

MAX_MESSAGE_CHARS = 2000


class AdminAPIError(Exception):
    """An error answer of the admin API (never escapes as a 500)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        hint: str | None = None,
        headers: dict[str, str] | None = None,
        internal: bool = False,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status_code = int(status_code)
        self.message = truncate(message)
        self.type = type or _default_type(self.status_code)
        self.hint = hint
        self.headers = dict(headers or {})
        #: The message or extra fields carry worker text or a bug's: admin callers only.
        self.internal = internal
        self.extra = extra

    def public(self, request_id: str) -> AdminAPIError:
        """This error as a caller without the admin role sees it: no worker internals, the request id instead."""
        if not self.internal:
            return self
        return AdminAPIError(
            self.status_code,
            f"The {PLUGIN_NAME} admin plugin could not answer ({self.type}); details are in the server log "
            f"under request id {request_id}.",
            type=self.type,
            hint=self.hint,
            headers=self.headers,
            request_id=request_id,
        )

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "code": self.status_code,
            "hint": self.hint,
        }
        error.update(self.extra)
        return {"error": error}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers or None)


def _default_type(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase.replace(" ", "")
    except ValueError:
        return "Error"


def truncate(text: str) -> str:
    """`text` cut to `MAX_MESSAGE_CHARS`, with an ellipsis when it was longer."""
    text = str(text)
    if len(text) > MAX_MESSAGE_CHARS:
        return text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


# ---- the plugin's state ---------------------------------------------------------------------------


def no_engine_error() -> AdminAPIError:
    return AdminAPIError(
        503,
        "This server has no engine (e.g. the CPU-only render server), so the "
        "my_pkg admin routes cannot reach any worker.",
        type="engine_unavailable",
        hint="Use the admin routes on a vLLM server that runs a model.",
    )


def not_initialised_error() -> AdminAPIError:
    return AdminAPIError(
        503,
        "The my_pkg admin plugin is not initialised yet (init_state has not run).",
        type="engine_unavailable",
        hint="Retry once the server has finished starting up.",
    )


def unexpected_reply_error(method: str, detail: str) -> AdminAPIError:
    return AdminAPIError(
        503,
        f"Unexpected reply from worker RPC {method}: {detail}",
        type="unexpected_reply",
        hint=(
            "The engine half and the endpoint half of my_pkg probably differ in "
            "version; install the same version everywhere and restart."
        ),
        method=method,
        internal=True,
    )


def plugin_error(exc: BaseException) -> AdminAPIError:
    """A bug of the plugin: never a 500, and its text for admin callers only."""
    return AdminAPIError(
        503,
        f"The {PLUGIN_NAME} admin plugin failed: {type(exc).__name__}: {exc}",
        type="plugin_error",
        hint="See the server log for the stack trace.",
        internal=True,
    )


def version_mismatch_error(bad: list[dict[str, Any]]) -> AdminAPIError:
    return AdminAPIError(
        503,
        f"Version mismatch between the halves of {PLUGIN_NAME}: the API "
        f"server runs {__version__}, "
        + ", ".join(f"rank {b['rank']} runs {b['plugin']} {b['version']}" for b in bad)
        + ".",
        type="version_mismatch",
        hint=(
            f"Install {PLUGIN_NAME}=={__version__} (one version) in the "
            "API server's and the workers' environments, then restart."
        ),
        cause="version_mismatch",
        endpoint_version=__version__,
        workers=bad,
    )


# ---- requests -------------------------------------------------------------------------------------

WWW_AUTHENTICATE = 'Bearer realm="my_pkg"'


def method_not_allowed_error(method: str, path: str, allowed: list[str]) -> AdminAPIError:
    return AdminAPIError(
        405,
        f"Method {method} is not allowed on {path}; allowed: {', '.join(allowed)}.",
        type="method_not_allowed",
        headers={"Allow": ", ".join(allowed)},
    )


def unknown_section_error(section: str) -> AdminAPIError:
    return AdminAPIError(
        404,
        f"Unknown config section {section!r}.",
        type="not_found_error",
        hint="Use one of: " + ", ".join(CONFIG_SECTIONS) + ".",
        valid_sections=list(CONFIG_SECTIONS),
    )


def body_too_large_error(limit: int) -> AdminAPIError:
    return AdminAPIError(
        413,
        f"The request body is larger than {limit} bytes.",
        type="request_too_large",
        hint='An update is a small JSON object, e.g. {"n_probes": 8}.',
        limit_bytes=limit,
    )


def _field_in_words(schema: dict[str, Any]) -> str:
    """A field's JSON schema in a few words: `int, 1 to 9`, `bool`, `int, 0 to 9, or null`."""
    options = schema.get("anyOf", [schema])
    words = []
    for option in options:
        kind = option.get("type")
        if kind == "null":
            continue
        text = {"boolean": "bool", "integer": "int", "number": "number", "string": "string"}.get(kind, str(kind))
        if "minimum" in option and "maximum" in option:
            text += f", {option['minimum']} to {option['maximum']}"
        elif "minimum" in option:
            text += f", >= {option['minimum']}"
        words.append(text)
    if any(option.get("type") == "null" for option in options):
        words.append("or null")
    return ", ".join(words)


def _update_hint() -> str:
    """The 422 hint, generated from the contract's `FlashHeadUpdate` so it cannot drift from the schema."""
    fields = FlashHeadUpdate.model_json_schema()["properties"]
    described = ", ".join(f"'{name}' ({_field_in_words(fields[name])})" for name in UPDATE_FIELDS)
    return f"Send a JSON object with at least one of {described}; no other fields."


UPDATE_HINT = _update_hint()


def request_validation_error(details: list[dict[str, Any]]) -> AdminAPIError:
    def describe(d: dict[str, Any]) -> str:
        if d["type"] == "json_invalid":
            return "the request body is not valid JSON"
        where = d["loc"][1:] if d["loc"][:1] == ["body"] else d["loc"]
        return f"{'.'.join(where) or 'body'}: {d['msg']}"

    summary = "; ".join(describe(d) for d in details)
    return AdminAPIError(
        422,
        f"Invalid request: {summary}" if summary else "Invalid request.",
        type="invalid_request_error",
        hint=UPDATE_HINT,
        errors=details,
    )


def bad_if_match_error(value: str) -> AdminAPIError:
    return AdminAPIError(
        422,
        f"If-Match must be a settings version (an integer, optionally quoted), not {value[:40]!r}.",
        type="invalid_request_error",
        hint=f"Use the settings_version of GET {ROUTE_PREFIX}/flashhead.",
    )


# ---- authentication -------------------------------------------------------------------------------


def unauthenticated_error(presented: bool) -> AdminAPIError:
    return AdminAPIError(
        401,
        "Invalid bearer token." if presented else "Missing or invalid bearer token.",
        type="authentication_error",
        hint=(
            "Send 'Authorization: Bearer <token>' with the value of "
            f"{ENV_ADMIN_TOKEN}, {ENV_READ_TOKEN} (read routes only) or one "
            "of the server's API keys (read routes only)."
        ),
        headers={"WWW-Authenticate": WWW_AUTHENTICATE},
    )


def read_role_error(role: str, has_admin: bool) -> AdminAPIError:
    return AdminAPIError(
        403,
        "This route needs the admin role; the token sent has the read role.",
        type="permission_error",
        hint=(
            f"Send the value of {ENV_ADMIN_TOKEN}. {ENV_READ_TOKEN} and the "
            "server's API keys (shared with inference clients) grant read "
            "routes only."
            if has_admin
            else f"No admin token is configured: set {ENV_ADMIN_TOKEN} in the API server's environment and restart."
        ),
        required_role="admin",
        role=role,
    )


def no_token_configured_error(mutating: bool) -> AdminAPIError:
    """Deny by default: no token configured, and anonymous reads not opted into."""
    return AdminAPIError(
        403,
        f"The {PLUGIN_NAME} admin routes are closed because no token is configured"
        + (" (mutating routes need the admin role)." if mutating else "."),
        type="permission_error",
        hint=(
            f"Set {ENV_ADMIN_TOKEN} (a random value of 32 characters or more) in the API server's environment, "
            "restart, and send 'Authorization: Bearer <token>'"
            + (
                "."
                if mutating
                else f"; or set {ENV_ALLOW_ANONYMOUS_READS}=1 to open the read routes to anyone "
                "who can reach the server."
            )
        ),
        required_role="admin" if mutating else "read",
    )


def admin_role_error(role: str | None) -> AdminAPIError:
    return AdminAPIError(
        403,
        "This route needs the admin role.",
        type="permission_error",
        hint=f"Send the value of {ENV_ADMIN_TOKEN} (set it in the API server's environment).",
        required_role="admin",
        role=role,
    )


# ---- updates --------------------------------------------------------------------------------------


def update_in_progress_error(
    update: dict[str, Any], *, holder: str | None = None, version: int | None = None
) -> AdminAPIError:
    return AdminAPIError(
        409,
        "Another FlashHead update is still in progress"
        + (f" (held by {holder})" if holder else "")
        + "; nothing was applied.",
        type="update_in_progress",
        hint=f"Retry later; GET {ROUTE_PREFIX}/flashhead shows the settings in force.",
        update=update,
        holder=holder,
        settings_version=version,
    )


def version_conflict_error(
    update: dict[str, Any], expected: str, etag: str, held: list[dict[str, Any]]
) -> AdminAPIError:
    versions = sorted({h["settings_version"] for h in held})
    return AdminAPIError(
        409,
        f"The settings are at {etag} (versions {versions}), not {expected} (If-Match); nothing was applied.",
        type="version_conflict",
        hint=f"Read GET {ROUTE_PREFIX}/flashhead again and retry with its ETag.",
        update=update,
        settings_version=max(versions, default=0),
        etag=etag,
        engine_settings=held,
    )


def update_deadline_error(update: dict[str, Any], seconds: float, transaction: str) -> AdminAPIError:
    return AdminAPIError(
        503,
        f"Preparing the update took longer than {seconds:g} s, half of its lease; nothing was applied.",
        type="update_deadline",
        hint="An engine is slow to answer between two steps; retry the PUT.",
        update=update,
        transaction=transaction,
    )


def flashhead_unavailable_error(update: dict[str, Any], failing: list[dict[str, Any]], version: int) -> AdminAPIError:
    return AdminAPIError(
        409,
        "FlashHead is not available on this model; nothing was applied.",
        type="flashhead_unavailable",
        hint=(
            f"FlashHead needs a model with FlashHead assets; see the 'reason' field of GET {ROUTE_PREFIX}/flashhead."
        ),
        update=update,
        errors=failing,
        settings_version=version,
    )


def invalid_update_error(update: dict[str, Any], failing: list[dict[str, Any]], version: int) -> AdminAPIError:
    # The body is valid (the API checked it); what a worker refuses conflicts with the model it serves.
    return AdminAPIError(
        409,
        f"FlashHead update rejected by {len(failing)} worker(s); nothing was applied.",
        type="invalid_update",
        hint="Fix the values reported per rank and retry.",
        update=update,
        errors=failing,
        settings_version=version,
    )
