"""my_pkg.devtools stays out of the wheel: pyproject's package discovery finds every other my_pkg package."""

from __future__ import annotations

from pathlib import Path

import pytest
from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parents[3]


def test_the_wheel_leaves_devtools_out():
    tomllib = pytest.importorskip("tomllib")  # the standard library's from Python 3.11
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_namespace_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ())))
    assert not {name for name in packages if name.split(".")[:2] == ["my_pkg", "devtools"]}
    on_disk = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "my_pkg").rglob("__init__.py")
        if "devtools" not in path.relative_to(ROOT).parts
    }
    assert on_disk and on_disk <= packages, on_disk - packages
