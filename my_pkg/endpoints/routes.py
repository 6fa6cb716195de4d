"""The admin API routes (all under ``/plugins/my_pkg``), on one module-level router.

Authentication is a dependency of the router itself, so it runs for every
route declared on it, whatever the path or method, before the handler and
before the body is validated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from my_pkg import PLUGIN_NAME, __version__
from my_pkg.contract import (
    CONFIG,
    CONFIG_SECTIONS,
    FLASHHEAD_APPLY,
    FLASHHEAD_STATUS,
    FLASHHEAD_VALIDATE,
    PING,
    WORKER_INFO,
    FlashHeadStatus,
    FlashHeadUpdate,
    MemoryInfo,
    PingReply,
    ValidationReply,
    WorkerConfig,
    WorkerIdentity,
)
from my_pkg.endpoints.audit import REQUEST_ID_HEADER, caller, record_refusal, request_id
from my_pkg.endpoints.auth import SAFE_METHODS, authenticate, require_admin_auth, require_admin_role
from my_pkg.endpoints.client import (
    UPDATE_KEY,
    AdminHandler,
    no_engine_error,
    not_initialised_error,
    parse_replies,
)
from my_pkg.endpoints.config import ROUTE_PREFIX, STATE_ATTR, logger
from my_pkg.endpoints.errors import AdminAPIError
from my_pkg.endpoints.metrics import CONTENT_TYPE
from my_pkg.endpoints.metrics import render as render_metrics
from my_pkg.endpoints.models import (
    AuditResponse,
    ConfigResponse,
    ErrorResponse,
    FlashHeadStatusResponse,
    FlashHeadUpdateResponse,
    HealthResponse,
    WorkerInfo,
    WorkersResponse,
)

MAX_REPORTED_VALIDATION_ERRORS = 10


def _error_doc(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


COMMON_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error_doc("Missing or invalid bearer token (a token is configured)."),
    403: _error_doc(
        "Mutating route with a read-role token (MY_PKG_READ_TOKEN or an API key), "
        "or while no admin token is configured."
    ),
    503: _error_doc(
        "No engine, engine half of the plugin not loaded, or a worker failed."
    ),
    504: _error_doc("The workers did not answer within MY_PKG_RPC_TIMEOUT."),
}


class AdminRoute(APIRoute):
    """Route class of the plugin's router: turns every failure of a route
    (auth, validation, worker RPC, unexpected bug) into a JSON error body, so
    that none of our routes answers 500 and the format does not depend on the
    exception handlers the hosting app installs."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette answers a wrong method with the methods of the first route whose path matched;
        # `Allow` must list every method the path has across the router's routes.
        if self.methods and scope["method"] not in self.methods:
            allowed = sorted({m for r in router.routes if getattr(r, "path", None) == self.path
                              for m in getattr(r, "methods", None) or ()})
            error = AdminAPIError(
                405, f"Method {scope['method']} is not allowed on {self.path}; allowed: {', '.join(allowed)}.",
                type="method_not_allowed", headers={"Allow": ", ".join(allowed)},
            )
            await error.to_response()(scope, receive, send)
            return
        await super().handle(scope, receive, send)

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            response = await answer(request)
            response.headers[REQUEST_ID_HEADER] = request_id(request)
            return response

        async def answer(request: Request) -> Response:
            try:
                try:
                    return await inner(request)
                except StarletteHTTPException as exc:
                    if exc.status_code == 400 and request.method.upper() not in SAFE_METHODS:
                        raise _UnreadableBody() from exc  # FastAPI: a body it cannot decode at all
                    raise
            except AdminAPIError as exc:
                return exc.to_response()
            except (RequestValidationError, _UnreadableBody) as exc:
                # FastAPI decodes a JSON body before it runs the dependencies,
                # so a malformed body can fail before the auth check ran:
                # authentication still decides first.
                try:
                    await authenticate(request)
                except AdminAPIError as auth_error:
                    return auth_error.to_response()
                error = validation_error(exc)
                if request.method.upper() not in SAFE_METHODS:
                    record_refusal(request, error.status_code, error.message)
                return error.to_response()
            except (HTTPException, StarletteHTTPException) as exc:
                return AdminAPIError(
                    exc.status_code,
                    str(exc.detail),
                    headers=dict(exc.headers or {}),
                ).to_response()
            except Exception as exc:  # noqa: BLE001 - never a 500
                logger.exception(
                    "Unexpected error in %s %s", request.method, request.url.path
                )
                return AdminAPIError(
                    503,
                    f"The {PLUGIN_NAME} admin plugin failed: {type(exc).__name__}: {exc}",
                    type="plugin_error",
                    hint="See the server log for the stack trace.",
                ).to_response()

        return handler


class _UnreadableBody(Exception):
    """A request body FastAPI could not decode (not UTF-8 or not JSON): the same 422 as invalid JSON."""

    def errors(self) -> list[dict[str, Any]]:
        return [{"loc": ("body",), "msg": "not valid JSON", "type": "json_invalid"}]


def validation_error(exc: RequestValidationError | _UnreadableBody) -> AdminAPIError:
    details = []
    raw = exc.errors()
    for err in list(raw)[:MAX_REPORTED_VALIDATION_ERRORS]:
        loc = [str(p) for p in err.get("loc", ())]
        details.append({"loc": loc, "msg": str(err.get("msg", "")), "type": err.get("type")})

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
        hint=(
            "Send a JSON object with at least one of 'enabled' (bool), "
            "'n_probes' (int >= 1), 'dense_batch_threshold' (int >= 0, or null for never); "
            "no other fields."
        ),
        errors=details,
    )


def get_handler(request: Request) -> AdminHandler:
    """The plugin state stored by ``init_state``; 503 when unusable."""
    handler = getattr(request.app.state, STATE_ATTR, None)
    if not isinstance(handler, AdminHandler):
        raise not_initialised_error()
    if not handler.has_engine:
        raise no_engine_error()
    return handler


Handler = Annotated[AdminHandler, Depends(get_handler)]

router = APIRouter(
    prefix=ROUTE_PREFIX,
    tags=[f"{PLUGIN_NAME} admin"],
    dependencies=[Depends(require_admin_auth)],
    route_class=AdminRoute,
    responses=COMMON_ERROR_RESPONSES,
)


def _age(seconds: float) -> float:
    return round(seconds, 3)


@router.get("/health", summary="Both halves of my_pkg loaded, same version, all workers answering")
async def health(handler: Handler) -> HealthResponse:
    # Liveness: every worker answered the status call within MY_PKG_STATUS_MAX_AGE. A missing engine
    # half surfaces as a 503 "engine_plugin_missing" whose cause/hint come from diagnose_engine_half().
    snapshot = await handler.status()
    pings = await handler.identity(PING, PingReply, snapshot)
    bad = [
        {"rank": p.rank, "plugin": p.plugin, "version": p.version}
        for p in pings
        if p.plugin != PLUGIN_NAME or p.version != __version__
    ]
    if bad:
        raise AdminAPIError(
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
    return HealthResponse(plugin=PLUGIN_NAME, version=__version__, num_workers=len(pings),
                          snapshot_age_s=_age(snapshot.age()), workers=pings)


@router.get("/workers", summary="Per-worker information")
async def workers(handler: Handler) -> WorkersResponse:
    snapshot = await handler.status()
    identities = await handler.identity(WORKER_INFO, WorkerIdentity, snapshot)
    memory = {(s.dp_rank, s.rank): s.memory for s in snapshot.workers}
    infos = [WorkerInfo(**i.model_dump(), memory=memory.get((i.dp_rank, i.rank), MemoryInfo())) for i in identities]
    return WorkersResponse(num_workers=len(infos), snapshot_age_s=_age(snapshot.age()), workers=infos)


@router.get(
    "/config/{section}",
    responses={404: _error_doc("Unknown section (the body lists the valid ones).")},
    summary="One section of the engine configuration, per worker",
)
async def config(section: str, handler: Handler) -> ConfigResponse:
    if section not in CONFIG_SECTIONS:
        raise AdminAPIError(
            404,
            f"Unknown config section {section!r}.",
            type="not_found_error",
            hint="Use one of: " + ", ".join(CONFIG_SECTIONS) + ".",
            valid_sections=list(CONFIG_SECTIONS),
        )
    configs = await handler.static(CONFIG, WorkerConfig, section)
    return ConfigResponse(section=section, num_workers=len(configs), workers=configs)


@router.get("/flashhead", summary="FlashHead status and counters, per worker")
async def flashhead_status(handler: Handler) -> FlashHeadStatusResponse:
    snapshot = await handler.status()
    statuses = [worker.flashhead_status() for worker in snapshot.workers]
    return FlashHeadStatusResponse(num_workers=len(statuses), snapshot_age_s=_age(snapshot.age()),
                                   workers=statuses)


@router.put(
    "/flashhead",
    responses={
        409: _error_doc(
            "The served model cannot take a valid update (e.g. more probes than it has clusters), "
            "FlashHead is not available on it, or another update is still in progress; nothing applied."
        ),
        422: _error_doc("Invalid body (nothing applied)."),
    },
    summary="Change FlashHead settings on all workers, or on none",
)
async def flashhead_update(body: FlashHeadUpdate, request: Request, handler: Handler) -> FlashHeadUpdateResponse:
    handler.check_engine_alive()
    update = body.to_update()
    who = caller(request)
    if handler.in_flight.running(UPDATE_KEY):
        handler.audit.record(who, 409, "refused", reason="another update is in progress", update=update)
        raise AdminAPIError(
            409,
            "Another FlashHead update is still in progress (the workers have not "
            "answered it yet); nothing was applied.",
            type="update_in_progress",
            hint=f"Retry later; GET {ROUTE_PREFIX}/flashhead shows the settings in force.",
            update=update,
        )
    # Validation and application run as one task that is never cancelled, so
    # an update whose wait expires is applied on every worker or on none.
    task = handler.in_flight.start(UPDATE_KEY, lambda: _update(handler, update, who))
    try:
        statuses = await handler.wait(task, "The FlashHead update")
    except AdminAPIError as exc:
        if exc.status_code == 504:
            exc.extra["note"] = (
                "The update is still pending in the engine: it is applied on every "
                "worker (or on none, if one rejects it) once the workers answer. "
                f"Check GET {ROUTE_PREFIX}/flashhead."
            )
            handler.audit.record(who, 504, "pending", update=update)
        raise
    return FlashHeadUpdateResponse(applied=update, num_workers=len(statuses), workers=statuses)


@router.get(
    "/audit",
    dependencies=[Depends(require_admin_role)],
    responses={403: _error_doc("The caller's token does not have the admin role.")},
    summary="Recent mutations and refused mutations (admin role)",
)
async def audit(handler: Handler) -> AuditResponse:
    entries = handler.audit.entries()
    return AuditResponse(size=handler.audit.size, num_entries=len(entries), entries=entries)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format 0.0.4.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
    summary="FlashHead counters in Prometheus text format, labelled by dp_rank and rank",
)
async def metrics(handler: Handler) -> Response:
    return Response(render_metrics(await handler.status()), media_type=CONTENT_TYPE)


def _settings(statuses: list[FlashHeadStatus]) -> list[dict[str, Any]]:
    return [
        {"dp_rank": s.dp_rank, "rank": s.rank, "enabled": s.enabled, "n_probes": s.n_probes,
         "dense_batch_threshold": s.dense_batch_threshold}
        for s in statuses
    ]


async def _update(
    handler: AdminHandler, update: dict[str, Any], who: dict[str, Any]
) -> list[FlashHeadStatus]:
    """Validate ``update`` on every worker, then apply it on every worker; audit the outcome.

    Whatever the outcome, the status snapshot is dropped afterwards: a read
    after the update sees the workers' settings as they are now.
    """
    try:  # the settings before, for the audit log only: never a reason to refuse the update
        before = _settings(parse_replies(FLASHHEAD_STATUS, FlashHeadStatus,
                                         await handler.call_unbounded(FLASHHEAD_STATUS)))
    except AdminAPIError:
        before = None
    try:
        statuses = await _validate_and_apply(handler, update)
    except AdminAPIError as exc:
        handler.audit.record(who, exc.status_code, "refused" if exc.status_code < 500 else "failed",
                             update=update, reason=exc.message, before=before)
        raise
    finally:
        handler.invalidate_status()
    handler.audit.record(who, 200, "applied", update=update, before=before, after=_settings(statuses))
    return statuses


async def _validate_and_apply(handler: AdminHandler, update: dict[str, Any]) -> list[FlashHeadStatus]:
    checks = parse_replies(FLASHHEAD_VALIDATE, ValidationReply,
                           await handler.call_unbounded(FLASHHEAD_VALIDATE, update))
    failing = [{"dp_rank": c.dp_rank, "rank": c.rank, "errors": list(c.errors)} for c in checks if c.errors]
    if failing:
        raise await _rejected(handler, update, failing)
    try:
        statuses = parse_replies(FLASHHEAD_APPLY, FlashHeadStatus,
                                 await handler.call_unbounded(FLASHHEAD_APPLY, update))
    except AdminAPIError as exc:
        logger.error(
            "FlashHead update %s passed validation but applying it failed; "
            "workers may now differ: %s",
            update,
            exc.message,
        )
        exc.extra["note"] = (
            "Validation passed on every worker but applying failed; the "
            f"workers may now differ. Check GET {ROUTE_PREFIX}/flashhead and retry."
        )
        raise
    logger.info("FlashHead update applied on %d worker(s): %s", len(statuses), update)
    return statuses


async def _rejected(
    handler: AdminHandler, update: dict[str, Any], failing: list[dict[str, Any]]
) -> AdminAPIError:
    """The error for an update that some worker refused (nothing applied)."""
    available: bool | None = None
    try:
        available = all(worker.flashhead.available for worker in (await handler.status()).workers)
    except AdminAPIError:
        available = None  # cannot tell; report the plain rejection
    if available is False:
        return AdminAPIError(
            409,
            "FlashHead is not available on this model; nothing was applied.",
            type="flashhead_unavailable",
            hint=(
                "FlashHead needs a model with FlashHead assets; see the 'reason' "
                f"field of GET {ROUTE_PREFIX}/flashhead."
            ),
            update=update,
            errors=failing,
        )
    # The body is valid (the API checked it); what a worker refuses conflicts with the model it serves.
    return AdminAPIError(
        409,
        f"FlashHead update rejected by {len(failing)} worker(s); nothing was applied.",
        type="invalid_update",
        hint="Fix the values reported per rank and retry.",
        update=update,
        errors=failing,
    )


__all__ = ["AdminRoute", "get_handler", "router"]
