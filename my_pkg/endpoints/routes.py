"""The admin API's handlers (all under ``/plugins/my_pkg``), on one module-level router.

The route class (`route_class.AdminRoute`) authenticates every request before its body is read and turns
every failure into a JSON error; `mutation.mutation` gives a mutating route its serialisation, audit and
snapshot invalidation; every error is built in `errors.py`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from starlette.responses import Response

from my_pkg import PLUGIN_NAME, __version__
from my_pkg.contract import (
    CONFIG,
    CONFIG_SECTIONS,
    PING,
    WORKER_INFO,
    FlashHeadUpdate,
    PingReply,
    WorkerConfig,
    WorkerIdentity,
)
from my_pkg.endpoints.admin_state import UPDATE_KEY, AdminState, consistent, etag_of
from my_pkg.endpoints.audit_merge import engine_audit, merged_audit
from my_pkg.endpoints.auth import require_admin_auth, require_admin_role
from my_pkg.endpoints.config import ROUTE_PREFIX, STATE_ATTR
from my_pkg.endpoints.errors import (
    bad_if_match_error,
    no_engine_error,
    not_initialised_error,
    unknown_section_error,
    version_mismatch_error,
)
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
from my_pkg.endpoints.mutation import mutation
from my_pkg.endpoints.route_class import AdminRoute
from my_pkg.endpoints.updates import parse_if_match, update_flashhead, update_wait_s

#: `If-Match`: an ETag of GET /flashhead (`"7.0123456789ab"`) or a bare settings version (`7`, `"7"`), optionally
#: weak (`W/"7"`), or `*` (any).
IF_MATCH_PATTERN = r'^(\*|(W/)?"?[0-9]{1,15}(\.[0-9a-f]{12})?"?)$'


def _error_doc(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


COMMON_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error_doc("Missing or invalid bearer token (a token is configured)."),
    403: _error_doc(
        "Mutating route with a read-role token (MY_PKG_READ_TOKEN or an API key), or no token configured "
        "(every route but /health, unless MY_PKG_ALLOW_ANONYMOUS_READS=1 opens the reads)."
    ),
    503: _error_doc("No engine, engine half of the plugin not loaded, or a worker failed."),
    504: _error_doc("The workers did not answer within MY_PKG_RPC_TIMEOUT."),
}


def get_state(request: Request) -> AdminState:
    """The plugin state stored by ``init_state``; 503 when unusable."""
    state = getattr(request.app.state, STATE_ATTR, None)
    if not isinstance(state, AdminState):
        raise not_initialised_error()
    if not state.has_engine:
        raise no_engine_error()
    return state


State = Annotated[AdminState, Depends(get_state)]

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
async def health(state: State) -> HealthResponse:
    # Liveness: every worker answered the status call within MY_PKG_STATUS_MAX_AGE. A missing engine
    # half surfaces as a 503 "engine_plugin_missing" whose cause/hint come from diagnose_engine_half().
    snapshot = await state.status()
    pings = await state.identity_of(PING, PingReply, snapshot)
    bad = [
        {"rank": p.rank, "plugin": p.plugin, "version": p.version}
        for p in pings
        if p.plugin != PLUGIN_NAME or p.version != __version__
    ]
    if bad:
        raise version_mismatch_error(bad)
    return HealthResponse(
        plugin=PLUGIN_NAME,
        version=__version__,
        num_workers=len(pings),
        snapshot_age_s=_age(snapshot.age()),
        workers=pings,
    )


@router.get("/workers", summary="Per-worker information")
async def workers(state: State) -> WorkersResponse:
    snapshot = await state.status()
    identities = await state.identity_of(WORKER_INFO, WorkerIdentity, snapshot)
    status = {(s.dp_rank, s.rank): s for s in snapshot.workers}
    infos = [
        WorkerInfo(**i.model_dump(), memory=worker.memory, top_p=worker.top_p)
        if (worker := status.get((i.dp_rank, i.rank))) is not None
        else WorkerInfo(**i.model_dump())
        for i in identities
    ]
    return WorkersResponse(num_workers=len(infos), snapshot_age_s=_age(snapshot.age()), workers=infos)


@router.get(
    "/config/{section}",
    responses={404: _error_doc("Unknown section (the body lists the valid ones).")},
    summary="One section of the engine configuration, per worker (secrets and addresses redacted)",
)
async def config(section: str, state: State) -> ConfigResponse:
    if section not in CONFIG_SECTIONS:
        raise unknown_section_error(section)
    configs = await state.static(CONFIG, WorkerConfig, section)
    return ConfigResponse(section=section, num_workers=len(configs), workers=configs)


@router.get("/flashhead", summary="FlashHead status and counters, per worker, and what every engine holds")
async def flashhead_status(state: State, response: Response) -> FlashHeadStatusResponse:
    snapshot = await state.status()
    statuses = [worker.flashhead_status() for worker in snapshot.workers]
    held = snapshot.held()
    etag = etag_of(held)
    response.headers["ETag"] = etag
    return FlashHeadStatusResponse(
        num_workers=len(statuses),
        settings_version=snapshot.settings_version,
        consistent=consistent(held),
        etag=etag,
        engine_settings=held,
        snapshot_age_s=_age(snapshot.age()),
        workers=statuses,
    )


@router.put(
    "/flashhead",
    responses={
        409: _error_doc(
            "The served model cannot take a valid update (e.g. more probes than it has clusters), "
            "FlashHead is not available on it, another update is in progress (from any API server), or "
            "If-Match names other settings than the engines hold; nothing applied. The body has the current "
            "version (and, for If-Match, the ETag and what every engine holds)."
        ),
        413: _error_doc("The body is larger than MY_PKG_ADMIN_MAX_BODY_BYTES (not read)."),
        422: _error_doc("Invalid body (nothing applied)."),
    },
    summary="Change FlashHead settings on all workers of every engine this API server manages, or on none",
)
@mutation(UPDATE_KEY, "The FlashHead update", wait_s=update_wait_s)
async def flashhead_update(
    body: FlashHeadUpdate,
    request: Request,
    state: State,
    response: Response,
    # `str` with a None default: the header may be left out, but its schema has no `null` (a client would send
    # the text "null").
    if_match: Annotated[
        str,
        Header(
            description="Apply only if the engines hold what this ETag of GET /flashhead names (or, a bare "
            "number, every engine is at that settings version with the same settings).",
            pattern=IF_MATCH_PATTERN,
        ),
    ] = None,  # type: ignore[assignment]
) -> FlashHeadUpdateResponse:
    try:
        expected = parse_if_match(if_match)
    except ValueError:
        raise bad_if_match_error(if_match or "") from None
    update = body.to_update()
    result = await update_flashhead(state, update, request.state.my_pkg_caller, expected)
    etag = etag_of(result.held)
    response.headers["ETag"] = etag
    return FlashHeadUpdateResponse(
        applied=update,
        settings=result.settings,
        settings_version=result.settings_version,
        transaction=result.transaction,
        etag=etag,
        engine_settings=result.held,
        engines=result.engines,
        other_nodes_untouched=state.local_engines_only,
        num_workers=len(result.statuses),
        workers=result.statuses,
    )


@router.get(
    "/audit",
    dependencies=[Depends(require_admin_role)],
    responses={403: _error_doc("The caller's token does not have the admin role.")},
    summary="Updates applied or rejected (from the engines), and refused mutations (admin role)",
)
async def audit(state: State) -> AuditResponse:
    mutations = await state.wait(state.in_flight.start("audit", lambda: engine_audit(state)), "The audit read")
    merged = merged_audit(mutations, state.audit.mutations())
    return AuditResponse(
        size=state.audit.size, api_server=state.identity, mutations=merged, refusals=state.audit.refusals()
    )


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
async def metrics(state: State) -> Response:
    return Response(render_metrics(await state.status()), media_type=CONTENT_TYPE)


def mutating_routes() -> list[Any]:
    """The routes of the router that change something (derived, for tests and docs)."""
    return [r for r in router.routes if set(getattr(r, "methods", ()) or ()) - {"GET", "HEAD"}]


__all__ = ["AdminRoute", "get_state", "mutating_routes", "router"]
