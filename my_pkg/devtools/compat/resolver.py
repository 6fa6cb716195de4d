"""Resolving a dotted vLLM name in parsed sources, the way Python would find it at run time; nothing is imported.

``Resolver(sources).lookup(module, qualname)`` returns a ``Found`` (what the name is: a module, class,
function, method, attribute, instance or external re-export, with its ``ast`` node), or None when the name is
not there. It follows module-level definitions and imports (re-exports and ``from x import *``; ``if
TYPE_CHECKING`` blocks are skipped), lazy ``__getattr__`` maps such as ``vllm.MODULE_ATTRS``, class bodies,
``self.x = ...`` assignments in methods, and base classes. Import chains longer than ``_MAX_IMPORT_HOPS``
resolve to None. ``dataclass_fields`` and ``derives_from`` answer what a call's constraints ask of a class.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Found", "ParsedSources", "Resolver"]

_MAX_IMPORT_HOPS = 12


class ParsedSources(Protocol):
    """What the resolver reads: a distribution's modules, parsed (``SourceTree``)."""

    def module(self, module: str) -> ast.Module | None: ...

    def is_package(self, module: str) -> bool: ...


@dataclass(frozen=True)
class Found:
    """What a name resolved to. ``kind``: module, class, function, method, attribute (property
    included), instance (a module-level object made by calling a class), or external (imported
    from outside vLLM: present, not inspected)."""

    kind: str
    module: str
    node: ast.AST | None = None
    value: ast.AST | None = None  # assigned value, for attributes
    instance_of: Found | None = None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at import time, through if/try/with blocks (not ``if TYPE_CHECKING``)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _runtime_statements(stmt.body)
            yield from _runtime_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _runtime_statements(block)
        elif isinstance(stmt, ast.With):
            yield from _runtime_statements(stmt.body)
        else:
            yield stmt


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _target_names(element)


def _is_property(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in func.decorator_list:
        text = ast.unparse(decorator)
        if text.split(".")[-1] in ("property", "cached_property") or text.endswith((".setter", ".getter")):
            return True
    return False


class Resolver:
    """Looks dotted names up in one distribution's parsed sources."""

    def __init__(self, tree: ParsedSources) -> None:
        self.tree = tree

    def lookup(self, module: str, qualname: str) -> Found | None:
        """What ``module``'s ``qualname`` (``""``: the module itself) is, or None when it is not there."""
        if self.tree.module(module) is None:
            return None
        found: Found | None = Found("module", module)
        for part in qualname.split(".") if qualname else ():
            found = self.member(found, part) if found is not None else None
        return found

    def member(self, found: Found, name: str) -> Found | None:
        if found.kind == "module":
            return self.module_member(found.module, name)
        if found.kind == "class":
            return self.class_member(found, name, set())
        if found.kind == "instance" and found.instance_of is not None:
            return self.class_member(found.instance_of, name, set())
        if found.kind == "external":
            return found
        return None

    # -- modules --------------------------------------------------------------------------------

    def _absolute(self, module: str, level: int, name: str | None) -> str:
        if level == 0:
            return name or ""
        parts = module.split(".")
        if not self.tree.is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([name] if name else []))

    def module_member(self, module: str, name: str, hops: int = 0) -> Found | None:
        tree = self.tree.module(module)
        if tree is None or hops > _MAX_IMPORT_HOPS:
            return None
        annotated: Found | None = None
        for stmt in _runtime_statements(tree.body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Found("class", module, stmt)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Found("function", module, stmt)
            if isinstance(stmt, ast.Assign) and any(name in _target_names(t) for t in stmt.targets):
                return self._assigned(module, stmt, stmt.value, hops)
            if isinstance(stmt, ast.AnnAssign) and name in _target_names(stmt.target):
                if stmt.value is not None:
                    return self._assigned(module, stmt, stmt.value, hops)
                annotated = annotated or Found("attribute", module, stmt)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if alias.name == "*":  # `from .communication_op import *` (vllm.distributed)
                        source = self._absolute(module, stmt.level, stmt.module)
                        starred = self.module_member(source, name, hops + 1) if source.startswith("vllm") else None
                        if starred is not None:
                            return starred
                    elif (alias.asname or alias.name) == name:
                        return self._imported(self._absolute(module, stmt.level, stmt.module), alias.name, hops)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name or (alias.asname is None and alias.name.split(".")[0] == name):
                        target = alias.name if alias.asname else name  # `import a.b` binds `a`
                        return Found("module" if self.tree.module(target) else "external", target)
        lazy = self._lazy_attribute(module, tree, name, hops)
        if lazy is not None:
            return lazy
        if self.tree.module(f"{module}.{name}") is not None:
            return Found("module", f"{module}.{name}")
        return annotated

    def _imported(self, source: str, name: str, hops: int) -> Found | None:
        if source.split(".")[0] != "vllm":
            return Found("external", source)
        found = self.module_member(source, name, hops + 1)
        if found is None and self.tree.module(f"{source}.{name}") is not None:
            return Found("module", f"{source}.{name}")
        return found

    def _assigned(self, module: str, stmt: ast.stmt, value: ast.expr, hops: int) -> Found:
        if isinstance(value, (ast.Name, ast.Attribute)):
            alias = self.expression(module, value, hops + 1)
            if alias is not None:
                return alias
        if isinstance(value, ast.Call):
            made_by = self.expression(module, value.func, hops + 1)
            if made_by is not None and made_by.kind == "class":
                return Found("instance", module, stmt, value, instance_of=made_by)
        return Found("attribute", module, stmt, value)

    def _lazy_attribute(self, module: str, tree: ast.Module, name: str, hops: int) -> Found | None:
        """A module ``__getattr__`` backed by a dict literal ``{"Name": ".sub.module:Name"}``."""
        if not any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in _runtime_statements(tree.body)):
            return None
        for stmt in tree.body:
            value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
            if not isinstance(value, ast.Dict):
                continue
            for key, target in zip(value.keys, value.values):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == name
                    and isinstance(target, ast.Constant)
                    and isinstance(target.value, str)
                    and ":" in target.value
                ):
                    source, _, attr = target.value.partition(":")
                    level = len(source) - len(source.lstrip("."))
                    return self._imported(self._absolute(module, level, source.lstrip(".") or source), attr, hops)
        return None

    def expression(self, module: str, expr: ast.expr, hops: int = 0) -> Found | None:
        """What a name or dotted name written in ``module`` refers to."""
        if hops > _MAX_IMPORT_HOPS:
            return None
        if isinstance(expr, ast.Name):
            return self.module_member(module, expr.id, hops)
        if isinstance(expr, ast.Attribute):
            owner = self.expression(module, expr.value, hops + 1)
            return self.member(owner, expr.attr) if owner is not None else None
        if isinstance(expr, ast.Subscript):  # Generic[T], Protocol[...]
            return self.expression(module, expr.value, hops + 1)
        return None

    # -- classes --------------------------------------------------------------------------------

    def bases(self, cls: Found) -> Iterator[Found]:
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            found = self.expression(cls.module, base)
            if found is not None and found.kind == "class":
                yield found

    def class_member(self, cls: Found, name: str, seen: set[tuple[str, str]]) -> Found | None:
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        if (cls.module, node.name) in seen:
            return None
        seen.add((cls.module, node.name))
        for stmt in _runtime_statements(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Found("attribute" if _is_property(stmt) else "method", cls.module, stmt)
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Found("class", cls.module, stmt)
            if isinstance(stmt, ast.Assign) and any(name in _target_names(t) for t in stmt.targets):
                return Found("attribute", cls.module, stmt, stmt.value)
            if isinstance(stmt, ast.AnnAssign) and name in _target_names(stmt.target):
                return Found("attribute", cls.module, stmt, stmt.value)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.args.args:
                owner = stmt.args.args[0].arg  # self (or cls)
                for inner in ast.walk(stmt):
                    targets = (
                        inner.targets
                        if isinstance(inner, ast.Assign)
                        else [inner.target]
                        if isinstance(inner, (ast.AnnAssign, ast.AugAssign))
                        else []
                    )
                    for target in targets:
                        for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                            if (
                                isinstance(element, ast.Attribute)
                                and element.attr == name
                                and isinstance(element.value, ast.Name)
                                and element.value.id == owner
                            ):
                                return Found("attribute", cls.module, inner)
        for base in self.bases(cls):
            found = self.class_member(base, name, seen)
            if found is not None:
                return found
        return None

    def dataclass_fields(self, cls: Found, seen: set[tuple[str, str]] | None = None) -> list[str]:
        """Annotated fields in dataclass order (bases first); ``ClassVar`` left out."""
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        seen = seen if seen is not None else set()
        if (cls.module, node.name) in seen:
            return []
        seen.add((cls.module, node.name))
        fields: list[str] = []
        for base in reversed(list(self.bases(cls))):
            fields += [f for f in self.dataclass_fields(base, seen) if f not in fields]
        for stmt in node.body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and "ClassVar" not in ast.unparse(stmt.annotation)
                and stmt.target.id not in fields
            ):
                fields.append(stmt.target.id)
        return fields

    def derives_from(self, cls: Found, module: str, name: str, seen: set[tuple[str, str]] | None = None) -> bool:
        seen = seen if seen is not None else set()
        assert isinstance(cls.node, ast.ClassDef)
        if (cls.module, cls.node.name) in seen:
            return False
        seen.add((cls.module, cls.node.name))
        for base in self.bases(cls):
            assert isinstance(base.node, ast.ClassDef)
            if (base.module, base.node.name) == (module, name) or self.derives_from(base, module, name, seen):
                return True
        return False
