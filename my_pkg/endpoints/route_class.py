"""The route class of the plugin's router: authentication first, a bounded body, every failure as JSON.

For every request to a route of the plugin, in this order:

1. the request id (`audit.request_id`: vLLM's when its header middleware is on);
2. authentication from the headers alone (`auth.authenticate`): nothing has read the body yet;
3. on a mutating method, the body: 413 when `Content-Length` says it is larger than
   `MY_PKG_ADMIN_MAX_BODY_BYTES`, and the streamed read stops (413) once it passes that limit;
4. FastAPI's own handling (validation, dependencies, the handler);
5. any failure becomes the JSON error body of `errors.py`, never a 500; errors carrying worker or bug
   text are shown in full to the admin role only.

A mutating route must be declared with `mutation.mutation` (auditing, serialisation and snapshot
invalidation come from it): the class refuses to build one that is not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from my_pkg.endpoints.audit import REQUEST_ID_HEADER, record_refusal, request_id, writes_request_id_header
from my_pkg.endpoints.auth import ADMIN, SAFE_METHODS, authenticate
from my_pkg.endpoints.config import logger, max_body_bytes
from my_pkg.endpoints.errors import (
    AdminAPIError,
    body_too_large_error,
    method_not_allowed_error,
    plugin_error,
    request_validation_error,
)

MAX_REPORTED_VALIDATION_ERRORS = 10
#: Attribute `mutation.mutation` sets on the endpoints it wraps.
MUTATION_MARK = "__my_pkg_mutation__"


class AdminRoute(APIRoute):
    """Route class of the plugin's router (see the module docstring)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        if set(self.methods or ()) - SAFE_METHODS and not getattr(endpoint, MUTATION_MARK, False):
            raise TypeError(
                f"{endpoint.__name__}: a mutating admin route must be declared with @mutation "
                "(my_pkg.endpoints.mutation), which audits, serialises and invalidates the snapshot"
            )

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette answers a wrong method with the methods of the first route whose path matched;
        # `Allow` must list every method the path has across the routes of the router serving the request.
        if self.methods and scope["method"] not in self.methods:
            router = scope.get("router")
            routes = getattr(router, "routes", None) or [self]
            allowed = sorted(
                {m for r in routes if getattr(r, "path", None) == self.path for m in getattr(r, "methods", None) or ()}
                | set(self.methods)
            )
            await method_not_allowed_error(scope["method"], self.path, allowed).to_response()(scope, receive, send)
            return
        await super().handle(scope, receive, send)

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            rid = request_id(request)
            try:
                response = await answer(request)
            except AdminAPIError as exc:
                response = _visible(request, exc, rid).to_response()
            if writes_request_id_header(request):
                response.headers[REQUEST_ID_HEADER] = rid
            return response

        async def answer(request: Request) -> Response:
            await authenticate(request)
            if request.method.upper() not in SAFE_METHODS:
                await read_body(request, max_body_bytes())
            try:
                try:
                    return await inner(request)
                except StarletteHTTPException as exc:
                    if exc.status_code == 400 and request.method.upper() not in SAFE_METHODS:
                        raise _UnreadableBody() from exc  # FastAPI: a body it cannot decode at all
                    raise
            except AdminAPIError:
                raise
            except (RequestValidationError, _UnreadableBody) as exc:
                error = validation_error(exc)
                if request.method.upper() not in SAFE_METHODS:
                    record_refusal(request, error.status_code, error.message)
                raise error from exc
            except (HTTPException, StarletteHTTPException) as exc:
                raise AdminAPIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})) from exc
            except Exception as exc:  # noqa: BLE001 - never a 500
                logger.exception(
                    "Unexpected error in %s %s (request id %s)", request.method, request.url.path, request_id(request)
                )
                raise plugin_error(exc) from exc

        return handler


def _visible(request: Request, error: AdminAPIError, rid: str) -> AdminAPIError:
    """`error` as this caller may see it: worker and bug details go to the admin role only (and the log)."""
    if not error.internal or getattr(request.state, "my_pkg_role", None) == ADMIN:
        return error
    logger.warning(
        "%s answered %d to a %s caller (request id %s): %s",
        request.url.path,
        error.status_code,
        getattr(request.state, "my_pkg_role", None) or "anonymous",
        rid,
        error.message,
    )
    return error.public(rid)


async def read_body(request: Request, limit: int) -> None:
    """Read the body into the request (FastAPI reuses it), refusing more than `limit` bytes with 413."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_large = int(declared) > limit
        except ValueError:
            too_large = False  # the server refuses a malformed Content-Length before we get here
        if too_large:
            raise body_too_large_error(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large_error(limit)
        chunks.append(chunk)
    request._body = b"".join(chunks)  # Starlette's cache of the body: what `await request.body()` returns


class _UnreadableBody(Exception):
    """A request body FastAPI could not decode (not UTF-8 or not JSON): the same 422 as invalid JSON."""

    def errors(self) -> list[dict[str, Any]]:
        return [{"loc": ("body",), "msg": "not valid JSON", "type": "json_invalid"}]


def validation_error(exc: RequestValidationError | _UnreadableBody) -> AdminAPIError:
    details = [
        {"loc": [str(p) for p in err.get("loc", ())], "msg": str(err.get("msg", "")), "type": err.get("type")}
        for err in list(exc.errors())[:MAX_REPORTED_VALIDATION_ERRORS]
    ]
    return request_validation_error(details)


__all__ = ["AdminRoute", "MUTATION_MARK", "read_body"]
