"""Every MY_PKG_* variable the package reads is in one table and documented."""

from __future__ import annotations

import re
from pathlib import Path

from my_pkg.env import ENVIRONMENT_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bMY_PKG_[A-Z0-9_]*[A-Z0-9]\b")


def test_the_package_reads_only_variables_of_the_table():
    used = {name for path in (ROOT / "my_pkg").rglob("*.py") for name in NAME.findall(path.read_text())}
    assert used == set(ENVIRONMENT_VARIABLES), (used ^ set(ENVIRONMENT_VARIABLES))


def test_configuration_page_lists_every_variable():
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(MY_PKG_[A-Z0-9_]+)` \|", page, re.M))
    assert documented == set(ENVIRONMENT_VARIABLES), (documented ^ set(ENVIRONMENT_VARIABLES))
