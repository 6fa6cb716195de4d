"""One client of the plugin's admin API, shared by the end-to-end tests, the benchmarks and the demo."""

from __future__ import annotations

from typing import Any

import httpx

from my_pkg.endpoints.config import ROUTE_PREFIX

FLASHHEAD = f"{ROUTE_PREFIX}/flashhead"


def bearer(token: str) -> dict[str, str]:
    """The `Authorization` header of a bearer token."""
    return {"Authorization": f"Bearer {token}"}


class AdminClient:
    """The admin routes of one server, authenticated with `token`.

    `get(route)` and `put(route, body)` return the raw response (a route is a path under
    `/plugins/my_pkg/`, or a full path); `flashhead()` and `update(...)` return the first
    worker's FlashHead entry and raise on anything but 200.
    """

    def __init__(self, base_url: str, token: str, *, timeout: float = 60.0) -> None:
        self.http = httpx.Client(base_url=base_url, headers=bearer(token), timeout=timeout)

    @staticmethod
    def path(route: str) -> str:
        return route if route.startswith("/") else f"{ROUTE_PREFIX}/{route}"

    def get(self, route: str, **kwargs: Any) -> httpx.Response:
        return self.http.get(self.path(route), **kwargs)

    def put(self, route: str, body: Any, **kwargs: Any) -> httpx.Response:
        return self.http.put(self.path(route), json=body, **kwargs)

    def flashhead(self) -> dict[str, Any]:
        response = self.get(FLASHHEAD)
        response.raise_for_status()
        return response.json()["workers"][0]

    def update(self, **settings: Any) -> dict[str, Any]:
        response = self.put(FLASHHEAD, settings)
        if response.status_code != 200:
            raise RuntimeError(f"PUT {FLASHHEAD} {settings} -> {response.status_code}: {response.text}")
        return response.json()["workers"][0]

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
