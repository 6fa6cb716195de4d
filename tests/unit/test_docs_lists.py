"""The lists the docs keep by hand or paste are the code's: the admin routes (README and admin-api.md) and the
architectures FlashHead registers (flashhead-serving.md, pasted between markers)."""

from __future__ import annotations

import re
from pathlib import Path

from my_pkg.endpoints.routes import router
from my_pkg.engine.patches.model_registry import BASE_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]
ROUTE_ROW = re.compile(r"^\| (GET|PUT|POST|PATCH|DELETE) \| `(/plugins/my_pkg/[^`]*)` \|", re.M)


def _routes() -> set[tuple[str, str]]:
    return {(method, route.path) for route in router.routes for method in route.methods}


def test_the_route_tables_list_every_route_of_the_router():
    assert ("PUT", "/plugins/my_pkg/flashhead") in _routes()
    for page in ("README.md", "docs/admin-api.md"):
        listed = ROUTE_ROW.findall((ROOT / page).read_text())
        assert len(listed) == len(set(listed)), page
        assert set(listed) == _routes(), page


def test_the_architecture_list_is_the_registrys():
    text = (ROOT / "docs" / "flashhead-serving.md").read_text()
    found = re.search(r"BASE_ARCHITECTURES -->\n(.*?)\n<!-- end BASE_ARCHITECTURES -->", text, re.S)
    expected = ", ".join(f"`{name}`" for name in BASE_ARCHITECTURES)
    assert found is not None and found.group(1) == expected, f"paste into flashhead-serving.md:\n{expected}"
