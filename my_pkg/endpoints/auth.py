"""Bearer-token authentication of the admin routes: deny by default.

vLLM's ``--api-key`` middleware only guards ``/v1``, ``/v2``, ``/inference``
and ``/cohere``; ``/plugins/*`` is open unless the plugin guards it itself.
The route class (`route_class.AdminRoute`) calls :func:`authenticate` before
anything reads the request body; :func:`require_admin_auth` is also a
dependency of the plugin's ``APIRouter`` (it shows the bearer scheme in the
OpenAPI document and guards a route served some other way).

Two roles, least privilege:

- *admin* (every route, mutations included): ``MY_PKG_ADMIN_TOKEN``;
- *read* (GET/HEAD routes only): ``MY_PKG_READ_TOKEN`` and the server's API
  keys, taken the way vLLM takes them (``--api-key`` values, or
  ``VLLM_API_KEY`` when no ``--api-key`` was given). Those keys are shared
  with every inference client, so they never grant mutations.

With no token configured at all, every route but ``/health`` answers 403 with
the fix, unless ``MY_PKG_ALLOW_ANONYMOUS_READS=1`` opens the read routes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from argparse import Namespace
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import Request

from my_pkg import env
from my_pkg.endpoints.audit import audit_of, caller, fingerprint
from my_pkg.endpoints.config import (
    ENV_ADMIN_TOKEN,
    ENV_READ_TOKEN,
    ENV_VLLM_API_KEY,
    ROUTE_PREFIX,
    STATE_ATTR,
    anonymous_reads_allowed,
    logger,
)
from my_pkg.endpoints.errors import (
    AdminAPIError,
    admin_role_error,
    no_token_configured_error,
    read_role_error,
    unauthenticated_error,
)

#: Methods that never change anything; every other method is "mutating".
SAFE_METHODS = frozenset({"GET", "HEAD"})

#: The one route open without a token when none is configured (liveness probes).
OPEN_PATH = f"{ROUTE_PREFIX}/health"
#: An admin token shorter than this draws a start-up warning.
MIN_ADMIN_TOKEN_CHARS = 32

ADMIN = "admin"
READ = "read"

#: Parses `Authorization: Bearer <token>` and shows the scheme in the OpenAPI document; never answers
#: by itself (`auto_error=False`), so :func:`require_admin_auth` decides 401 and 403 in its own format.
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="my_pkg_bearer",
    description=(
        "MY_PKG_ADMIN_TOKEN (admin role: every route), or MY_PKG_READ_TOKEN or one of the server's "
        "API keys (read role: GET routes)."
    ),
)
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class TokenSet:
    """Hashes of the accepted tokens, the role each grants, and where they came from."""

    digests: tuple[bytes, ...]
    sources: tuple[str, ...]
    roles: tuple[str, ...]  # per digest
    token_sources: tuple[str, ...]  # per digest: where that token came from
    #: Start-up problems of the configuration (weak admin token, admin token shared with another role).
    warnings: tuple[str, ...] = field(default=())

    @property
    def configured(self) -> bool:
        return bool(self.digests)

    @property
    def has_admin(self) -> bool:
        return any(self._role(i) == ADMIN for i in range(len(self.digests)))

    def _role(self, index: int) -> str:
        return self.roles[index]

    def identify(self, presented: str) -> tuple[str, str] | None:
        """``(role, source)`` of the token ``presented`` (admin over read), or None; constant time.

        All tokens are compared (no early exit) over fixed-size hashes, so the
        time taken does not depend on which token matched or on how much of a
        token was right.
        """
        candidate = _digest(presented)
        matches = [secrets.compare_digest(candidate, digest) for digest in self.digests]
        found = None
        for role in (ADMIN, READ):
            for index, match in enumerate(matches):
                if match and found is None and self._role(index) == role:
                    found = (role, self.token_sources[index])
        return found


def _api_keys(args: Namespace | Any | None) -> list[str]:
    keys = getattr(args, "api_key", None) if args is not None else None
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or []) if isinstance(k, str) and k]


def resolve_tokens(args: Namespace | Any | None = None) -> TokenSet:
    """Tokens accepted on the admin routes and their roles, from the environment and ``args``."""
    tokens: list[tuple[str, str, str]] = []  # (token, role, source)
    sources: list[str] = []

    for name, role in ((ENV_ADMIN_TOKEN, ADMIN), (ENV_READ_TOKEN, READ)):
        value = env.read(name)
        if value:
            tokens.append((value, role, name))
            sources.append(name)

    # Same precedence as vLLM's own middleware: --api-key wins over the env.
    keys = _api_keys(args)
    if keys:
        tokens.extend((key, READ, "--api-key") for key in keys)
        sources.append("--api-key")
    else:
        env_key = os.environ.get(ENV_VLLM_API_KEY, "")
        if env_key:
            tokens.append((env_key, READ, ENV_VLLM_API_KEY))
            sources.append(ENV_VLLM_API_KEY)

    unique = _dedupe(tokens)
    return TokenSet(
        tuple(_digest(token) for token, _, _ in unique),
        tuple(sources),
        tuple(role for _, role, _ in unique),
        tuple(source for _, _, source in unique),
        _weaknesses(tokens),
    )


def _weaknesses(tokens: list[tuple[str, str, str]]) -> tuple[str, ...]:
    """What makes the admin token weak: too short, or equal to a token of the read role (which then admits
    every holder of that token as admin, since admin wins)."""
    found = []
    for token, role, source in tokens:
        if role != ADMIN:
            continue
        if len(token) < MIN_ADMIN_TOKEN_CHARS:
            found.append(
                f"{source} is shorter than {MIN_ADMIN_TOKEN_CHARS} characters; use a random value "
                f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)."
            )
        shared = sorted(
            {other_source for other, other_role, other_source in tokens if other_role != ADMIN and other == token}
        )
        if shared:
            found.append(
                f"{source} equals {' and '.join(shared)}: every holder of that token has the admin "
                "role. Give the admin role a token of its own."
            )
    return tuple(found)


def warn_about(tokens: TokenSet) -> None:
    for warning in tokens.warnings:
        logger.warning("my_pkg admin token: %s", warning)


def _dedupe(items: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """First occurrence of each token wins (admin tokens come first)."""
    seen: dict[str, tuple[str, str, str]] = {}
    for item in items:
        seen.setdefault(item[0], item)
    return list(seen.values())


def _tokens_for_request(request: Request) -> TokenSet:
    state = request.app.state
    handler = getattr(state, STATE_ATTR, None)
    tokens = getattr(handler, "tokens", None)
    if isinstance(tokens, TokenSet):
        return tokens
    # init_state has not run (yet): fall back to the environment and to the
    # args vLLM stores on app.state in build_app.
    return resolve_tokens(getattr(state, "args", None))


async def require_admin_auth(request: Request, credentials: BearerCredentials) -> None:
    """Router-level dependency: authenticate every request of the plugin (once; see :func:`authenticate`)."""
    if getattr(request.state, "my_pkg_authenticated", False):
        return
    _check(request, credentials.credentials if credentials is not None else None)
    request.state.my_pkg_authenticated = True


def _check(request: Request, presented: str | None) -> None:
    """Decide 401/403 or let through, recording who the caller is on ``request.state``.

    * tokens configured -> a matching ``Authorization: Bearer`` is required (401 otherwise), and only the
      admin role may use a mutating method (403);
    * no token configured -> 403 everywhere but ``/health``, unless anonymous reads are opted into.
    """
    tokens = _tokens_for_request(request)
    mutating = request.method.upper() not in SAFE_METHODS
    if tokens.configured:
        identity = tokens.identify(presented) if presented is not None else None
        if identity is None:
            reason = "invalid_token" if presented is not None else "missing_token"
            # No fingerprint of a token that matched nothing: the caller chooses it, so it identifies nobody.
            raise _refused(request, unauthenticated_error(presented is not None), reason, mutating)
        role, source = identity
        request.state.my_pkg_role = role
        request.state.my_pkg_token_source = source
        request.state.my_pkg_token_fingerprint = fingerprint(presented)
        if mutating and role != ADMIN:
            raise _refused(request, read_role_error(role, tokens.has_admin), "read_role", mutating)
        return
    if _route_path(request).rstrip("/") == OPEN_PATH or (not mutating and anonymous_reads_allowed()):
        return
    raise _refused(request, no_token_configured_error(mutating), "no_token_configured", mutating)


def _route_path(request: Request) -> str:
    """The path the router matched: without `--root-path` when the request carries it (as vLLM's own middleware
    and Starlette's routing read it)."""
    path = request.url.path
    root = request.scope.get("root_path") or ""
    return path[len(root) :] if root and path.startswith(root) else path


def _refused(request: Request, error: AdminAPIError, reason: str, mutating: bool) -> AdminAPIError:
    """Count and log the failure; a refused mutation also goes to the audit's refusals."""
    audit = audit_of(request)
    if audit is not None:
        client = request.client.host if request.client else None
        audit.auth_failed(reason, client, request.url.path)
        if mutating:
            audit.refuse(caller(request), error.status_code, error.message)
    return error


async def authenticate(request: Request) -> None:
    """Authenticate ``request`` from its headers alone (the body is not read yet); at most once per request."""
    await require_admin_auth(request, await bearer_scheme(request))


async def require_admin_role(request: Request) -> None:
    """Route dependency for admin-only reads (the audit log): 403 for any other caller."""
    role = getattr(request.state, "my_pkg_role", None)
    if role != ADMIN:
        raise _refused(request, admin_role_error(role), "admin_only", False)
