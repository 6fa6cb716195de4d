"""Bearer-token authentication of the admin routes.

vLLM's ``--api-key`` middleware only guards ``/v1``, ``/v2``, ``/inference``
and ``/cohere``; ``/plugins/*`` is open unless the plugin guards it itself.
:func:`require_admin_auth` is installed as a dependency of the plugin's
``APIRouter`` so that every route of the router runs it before its handler.

Accepted tokens: ``MY_PKG_ADMIN_TOKEN`` plus the server's API keys, taken the
way vLLM takes them (``--api-key`` values, or ``VLLM_API_KEY`` when no
``--api-key`` was given).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from argparse import Namespace
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from my_pkg.endpoints.config import (
    ENV_ADMIN_TOKEN,
    ENV_VLLM_API_KEY,
    STATE_ATTR,
)
from my_pkg.endpoints.errors import AdminAPIError

#: Methods that never change anything; every other method is "mutating".
SAFE_METHODS = frozenset({"GET", "HEAD"})

WWW_AUTHENTICATE = 'Bearer realm="my_pkg"'


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class TokenSet:
    """Hashes of the accepted tokens plus where they came from."""

    digests: tuple[bytes, ...]
    sources: tuple[str, ...]

    @property
    def configured(self) -> bool:
        return bool(self.digests)

    def matches(self, presented: str) -> bool:
        """Constant-time check of ``presented`` against every token.

        All tokens are compared (no early exit) over fixed-size hashes, so the
        time taken does not depend on which token matched or on how much of a
        token was right.
        """
        candidate = _digest(presented)
        ok = False
        for digest in self.digests:
            ok |= secrets.compare_digest(candidate, digest)
        return ok


def _api_keys(args: Namespace | Any | None) -> list[str]:
    keys = getattr(args, "api_key", None) if args is not None else None
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or []) if isinstance(k, str) and k]


def resolve_tokens(args: Namespace | Any | None = None) -> TokenSet:
    """Tokens accepted on the admin routes, from the environment and ``args``."""
    tokens: list[str] = []
    sources: list[str] = []

    admin = os.environ.get(ENV_ADMIN_TOKEN, "").strip()
    if admin:
        tokens.append(admin)
        sources.append(ENV_ADMIN_TOKEN)

    # Same precedence as vLLM's own middleware: --api-key wins over the env.
    keys = _api_keys(args)
    if keys:
        tokens.extend(keys)
        sources.append("--api-key")
    else:
        env_key = os.environ.get(ENV_VLLM_API_KEY, "")
        if env_key:
            tokens.append(env_key)
            sources.append(ENV_VLLM_API_KEY)

    return TokenSet(tuple(_digest(t) for t in _dedupe(tokens)), tuple(sources))


def _dedupe(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


def _tokens_for_request(request: Request) -> TokenSet:
    state = request.app.state
    handler = getattr(state, STATE_ATTR, None)
    tokens = getattr(handler, "tokens", None)
    if isinstance(tokens, TokenSet):
        return tokens
    # init_state has not run (yet): fall back to the environment and to the
    # args vLLM stores on app.state in build_app.
    return resolve_tokens(getattr(state, "args", None))


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, param = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    param = param.strip()
    return param or None


async def require_admin_auth(request: Request) -> None:
    """Router-level dependency: authenticate every request of the plugin.

    * tokens configured -> a matching ``Authorization: Bearer`` is required
      (401 otherwise);
    * no token configured -> read-only methods pass, everything else gets 403.
    """
    tokens = _tokens_for_request(request)
    if tokens.configured:
        presented = _bearer(request)
        if presented is None or not tokens.matches(presented):
            raise AdminAPIError(
                401,
                "Missing or invalid bearer token."
                if presented is None
                else "Invalid bearer token.",
                type="authentication_error",
                hint=(
                    "Send 'Authorization: Bearer <token>' with the value of "
                    f"{ENV_ADMIN_TOKEN} or one of the server's API keys."
                ),
                headers={"WWW-Authenticate": WWW_AUTHENTICATE},
            )
        return
    if request.method.upper() not in SAFE_METHODS:
        raise AdminAPIError(
            403,
            "Mutating admin routes are disabled because no admin token is "
            "configured.",
            type="permission_error",
            hint=(
                f"Set {ENV_ADMIN_TOKEN} in the API server's environment (or "
                "start vLLM with --api-key / VLLM_API_KEY), restart, and send "
                "'Authorization: Bearer <token>'."
            ),
        )
