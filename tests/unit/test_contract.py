"""`my_pkg.contract` is the contract's public API: every public name its modules define is exported from it."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

from my_pkg import contract


def _defined(module_name: str) -> set[str]:
    """The public top-level names a module defines (classes, functions, assignments), not those it imports."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def test_the_package_exports_every_public_name_of_its_modules():
    modules = [info.name for info in pkgutil.iter_modules(contract.__path__)]
    assert modules
    defined = set().union(*(_defined(f"my_pkg.contract.{name}") for name in modules))
    assert defined == set(contract.__all__)
    assert all(hasattr(contract, name) for name in contract.__all__)


def test_null_is_a_value_of_the_nullable_update_fields_only():
    schema = contract.FlashHeadUpdate.model_json_schema()["properties"]
    assert contract.NULLABLE_FIELDS == ("dense_batch_threshold",)
    for name in contract.UPDATE_FIELDS:
        admits_null = any(branch.get("type") == "null" for branch in schema[name].get("anyOf", []))
        refusal = contract.update_errors({name: None})
        assert admits_null == (name in contract.NULLABLE_FIELDS) == (refusal == []), (name, refusal)


def test_whole_settings_keep_null_only_where_it_is_a_value():
    held = contract.SettingsValues(enabled=True, n_probes=4)
    assert held.whole({"dense_batch_threshold": None}) == {
        "enabled": True,
        "n_probes": 4,
        "dense_batch_threshold": None,
    }
