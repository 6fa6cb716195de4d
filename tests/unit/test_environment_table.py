"""Every MY_PKG_* variable the package reads is in one table, read through it, and documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from my_pkg import env

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bMY_PKG_[A-Z0-9_]*[A-Z0-9]\b")


def test_the_package_reads_only_variables_of_the_table():
    used = {name for path in (ROOT / "my_pkg").rglob("*.py") for name in NAME.findall(path.read_text())}
    assert used == set(env.VARIABLES), used ^ set(env.VARIABLES)


def test_only_the_table_reads_the_environment_for_my_pkg_variables():
    readers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "my_pkg").rglob("*.py")
        if path.name != "env.py" and re.search(r"os\.(environ|getenv)[^\n]*MY_PKG_", path.read_text())
    ]
    assert readers == []


def test_configuration_page_has_the_generated_table():
    page = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- env-table:start -->\n(.*?)\n<!-- env-table:end -->", page, re.S)
    assert block is not None
    assert block.group(1) == env.markdown_table(), "regenerate it with `python -m my_pkg.env`"


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("MY_PKG_DISABLE", "yes", True),
        ("MY_PKG_DISABLE", "maybe", False),
        ("MY_PKG_FLASHHEAD_N_PROBES", "12", 12),
        ("MY_PKG_FLASHHEAD_N_PROBES", "0", None),
        ("MY_PKG_FLASHHEAD_BACKEND", " Triton ", "triton"),
        ("MY_PKG_FLASHHEAD_BACKEND", "cuda", "auto"),
        ("MY_PKG_RPC_TIMEOUT", "2.5", 2.5),
        ("MY_PKG_RPC_TIMEOUT", "nan", 10.0),
        ("MY_PKG_RPC_TIMEOUT", "0", 10.0),
        ("MY_PKG_STATUS_MAX_AGE", "0", 0.0),
        ("MY_PKG_ADMIN_TOKEN", "  ", None),
        ("MY_PKG_ADMIN_TOKEN", " t0ken ", "t0ken"),
    ],
)
def test_values_are_parsed_and_invalid_ones_fall_back(monkeypatch, name, raw, expected):
    monkeypatch.setenv(name, raw)
    assert getattr(env, name) == expected


def test_a_registered_kernel_backend_is_a_choice_of_the_backend_variable(monkeypatch):
    from my_pkg.flashhead import kernels

    monkeypatch.setattr(kernels, "_BACKENDS", dict(kernels._BACKENDS))  # the registration is undone afterwards
    monkeypatch.setenv("MY_PKG_FLASHHEAD_BACKEND", "npu")
    assert env.MY_PKG_FLASHHEAD_BACKEND == "auto"  # not registered: falls back
    kernels.register_backend("npu", "my_pkg.flashhead.kernels.torch_ref", auto_devices=("npu",))
    assert env.MY_PKG_FLASHHEAD_BACKEND == "npu"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        env.MY_PKG_NOT_A_VARIABLE  # noqa: B018
