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
