"""Bearer-token authentication of the admin routes.

vLLM's ``--api-key`` middleware only guards ``/v1``, ``/v2``, ``/inference``
and ``/cohere``; ``/plugins/*`` is open unless the plugin guards it itself.
:func:`require_admin_auth` is installed as a dependency of the plugin's
``APIRouter`` so that every route of the router runs it before its handler.

Two roles, least privilege:

- *admin* (every route, mutations included): ``MY_PKG_ADMIN_TOKEN``;
- *read* (GET/HEAD routes only): ``MY_PKG_READ_TOKEN`` and the server's API
  keys, taken the way vLLM takes them (``--api-key`` values, or
  ``VLLM_API_KEY`` when no ``--api-key`` was given). Those keys are shared
  with every inference client, so they never grant mutations.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from argparse import Namespace
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import Request

from my_pkg import env
from my_pkg.endpoints.audit import record_refusal
from my_pkg.endpoints.config import (
    ENV_ADMIN_TOKEN,
    ENV_READ_TOKEN,
    ENV_VLLM_API_KEY,
    STATE_ATTR,
)
from my_pkg.endpoints.errors import AdminAPIError

#: Methods that never change anything; every other method is "mutating".
SAFE_METHODS = frozenset({"GET", "HEAD"})

WWW_AUTHENTICATE = 'Bearer realm="my_pkg"'

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
    roles: tuple[str, ...] = ()  # per digest; empty means every token is admin (older callers)
    token_sources: tuple[str, ...] = ()  # per digest: where that token came from

    @property
    def configured(self) -> bool:
        return bool(self.digests)

    @property
    def has_admin(self) -> bool:
        return any(self._role(i) == ADMIN for i in range(len(self.digests)))

    def _role(self, index: int) -> str:
        return self.roles[index] if self.roles else ADMIN

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
                    found = (role, self.token_sources[index] if self.token_sources else "token")
        return found

    def role_of(self, presented: str) -> str | None:
        identity = self.identify(presented)
        return identity[0] if identity else None

    def matches(self, presented: str) -> bool:
        return self.role_of(presented) is not None


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
    )


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
    """Router-level dependency: authenticate every request of the plugin.

    * tokens configured -> a matching ``Authorization: Bearer`` is required
      (401 otherwise);
    * no token configured -> read-only methods pass, everything else gets 403.
    """
    tokens = _tokens_for_request(request)
    mutating = request.method.upper() not in SAFE_METHODS
    if tokens.configured:
        presented = credentials.credentials if credentials is not None else None
        identity = tokens.identify(presented) if presented is not None else None
        role = identity[0] if identity else None
        if identity is None:
            raise AdminAPIError(
                401,
                "Missing or invalid bearer token."
                if presented is None
                else "Invalid bearer token.",
                type="authentication_error",
                hint=(
                    "Send 'Authorization: Bearer <token>' with the value of "
                    f"{ENV_ADMIN_TOKEN}, {ENV_READ_TOKEN} (read routes only) or one "
                    "of the server's API keys (read routes only)."
                ),
                headers={"WWW-Authenticate": WWW_AUTHENTICATE},
            )
        request.state.my_pkg_role = role
        request.state.my_pkg_token_source = identity[1]
        request.state.my_pkg_token_fingerprint = hashlib.sha256(presented.encode("utf-8")).hexdigest()[:8]
        if mutating and role != ADMIN:
            error = AdminAPIError(
                403,
                "This route needs the admin role; the token sent has the read role.",
                type="permission_error",
                hint=(
                    f"Send the value of {ENV_ADMIN_TOKEN}. {ENV_READ_TOKEN} and the "
                    "server's API keys (shared with inference clients) grant read "
                    "routes only."
                    if tokens.has_admin
                    else f"No admin token is configured: set {ENV_ADMIN_TOKEN} in the "
                    "API server's environment and restart."
                ),
                required_role=ADMIN,
                role=role,
            )
            record_refusal(request, error.status_code, error.message)
            raise error
        return
    if mutating:
        raise AdminAPIError(
            403,
            "Mutating admin routes are disabled because no admin token is "
            "configured; this route needs the admin role.",
            type="permission_error",
            hint=(
                f"Set {ENV_ADMIN_TOKEN} in the API server's environment, restart, "
                "and send 'Authorization: Bearer <token>'."
            ),
            required_role=ADMIN,
        )


async def authenticate(request: Request) -> None:
    """:func:`require_admin_auth` outside FastAPI's dependency injection (the route class calls it)."""
    await require_admin_auth(request, await bearer_scheme(request))


async def require_admin_role(request: Request) -> None:
    """Route dependency for admin-only reads (the audit log): 403 for any other caller."""
    if getattr(request.state, "my_pkg_role", None) != ADMIN:
        raise AdminAPIError(
            403,
            "This route needs the admin role.",
            type="permission_error",
            hint=f"Send the value of {ENV_ADMIN_TOKEN} (set it in the API server's environment).",
            required_role=ADMIN,
            role=getattr(request.state, "my_pkg_role", None),
        )
