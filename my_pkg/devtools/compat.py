"""Does a vLLM release still have every vLLM symbol the engine half touches? Checked statically.

    python -m my_pkg.devtools.compat                          # vLLM 0.33.0, downloaded once and cached
    python -m my_pkg.devtools.compat --vllm-version 0.34.0
    python -m my_pkg.devtools.compat --wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python -m my_pkg.devtools.compat --installed              # the vLLM installed next to this package

``ENGINE_SYMBOLS`` is not kept here: it is collected from the modules under ``my_pkg/engine``, read with
``ast`` and never imported (they import vLLM). What a module imports from vLLM, and the attributes it reads
on those imported names, are derived (``derived_symbols``); the rest (attributes read on vLLM objects the
module is handed, methods it wraps, the parameters, base class or decorator a call relies on) the module
declares next to its code in ``VLLM_SYMBOLS`` (``my_pkg.engine.vllm_uses``, ``declared_symbols``).

The wheel is fetched with ``pip download vllm==X --no-deps --only-binary=:all:`` into a cache
folder and read as a zip: nothing is installed or imported, only its ``.py`` sources are parsed
with ``ast``. Each entry of ``ENGINE_SYMBOLS`` is looked up the way Python would find it at run
time: module-level definitions and imports (re-exports are followed, ``if TYPE_CHECKING`` blocks
are not), lazy ``__getattr__`` maps such as ``vllm.MODULE_ATTRS``, class bodies, ``self.x = ...``
assignments in methods, and base classes. Some entries also pin what a call relies on: leading
parameter names, a base class, a decorator.

Exit status: 0 every symbol found, 1 some missing or changed (listed), 2 the sources could not be read.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from my_pkg.engine.vllm_uses import DECLARATION, KINDS, Declared, attributes, symbol

__all__ = [
    "KINDS",
    "VllmSymbol",
    "SymbolCheck",
    "SourceTree",
    "ENGINE_SYMBOLS",
    "ENGINE_DIR",
    "engine_symbols",
    "derived_symbols",
    "declared_symbols",
    "unused_declarations",
    "DEFAULT_VLLM_VERSION",
    "check_symbols",
    "fetch_wheel",
    "main",
]

DEFAULT_VLLM_VERSION = "0.33.0"
EXIT_OK, EXIT_MISSING, EXIT_NO_SOURCES = 0, 1, 2
_MAX_IMPORT_HOPS = 12


@dataclass(frozen=True)
class VllmSymbol:
    """One vLLM name the engine half relies on.

    ``qualname`` is dotted from ``module`` (``""`` for the module itself); ``kind`` is one of
    ``KINDS`` (an instance attribute, a property and a module-level object are all ``attribute``).
    """

    module: str
    qualname: str
    kind: str
    used_by: str
    params: tuple[str, ...] = ()  # leading parameter (or dataclass field) names a call passes positionally
    subclass_of: str = ""  # "module:Class" a class must derive from
    decorator: str = ""  # a decorator a class must keep, as written (``dataclass(frozen=True)``)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


# ---- the manifest: derived from the engine modules ----------------------------------------------

#: The engine half whose vLLM symbols are checked; ``used_by`` paths are relative to its parent (``my_pkg``).
ENGINE_DIR = Path(__file__).resolve().parents[1] / "engine"
_HELPERS: dict[str, Callable[..., Declared | tuple[Declared, ...]]] = {"symbol": symbol, "attributes": attributes}
#: A dict's methods: read on a module-level dict (``op_registry_oot.get``), they are no vLLM names.
_DICT_METHODS = frozenset(dir(dict))


def _class_shaped(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _target(path: str) -> tuple[str, str]:
    """``vllm.a.b.Cls.attr`` -> (``vllm.a.b``, ``Cls.attr``): the module ends before the first CapWords name."""
    parts = path.split(".")
    cut = next((i for i, part in enumerate(parts) if _class_shaped(part)), len(parts))
    return ".".join(parts[:cut]), ".".join(parts[cut:])


def _source_order(nodes: Iterator[ast.AST]) -> list[ast.AST]:
    return sorted(nodes, key=lambda node: (getattr(node, "lineno", 0), getattr(node, "col_offset", 0)))


def derived_symbols(source: str, used_by: str) -> list[VllmSymbol]:
    """The vLLM names one engine module's source shows: imports, then ``TARGET``, then reads, each in source order.

    - ``from vllm.x import Y [as Z]`` and ``import vllm[.x] [as z]``, in any scope, and
      ``import_module("vllm.x")``; a module-level ``TARGET = "vllm.x.Cls, vllm.y.Other"``.
    - Attributes read on a name so bound: ``Z.attr``, ``getattr(Z, "attr")``/``hasattr``, and
      ``(Z, "attr")`` pairs (what ``require`` and ``setattr`` loops take). Python's own names
      (``__dict__``) and dict methods on a module-level object (``op_registry_oot.get``) are left out.

    Kinds follow the code's shape: an imported CapWords name is a class, an imported name the module
    calls a function, else an attribute; an attribute read is a method when called or paired, else an
    attribute. A ``VLLM_SYMBOLS`` declaration of the same name in the module overrides the kind.
    ``import vllm.a.b`` without ``as`` binds ``vllm`` and is checked as a module only.
    """
    tree = ast.parse(source)
    kinds: dict[tuple[str, str], str] = {}

    def add(module: str, qualname: str, kind: str) -> None:
        if kinds.get((module, qualname), "attribute") == "attribute":  # a call or a pair says more than a read
            kinds[(module, qualname)] = kind

    nodes = _source_order(ast.walk(tree))
    called = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
    called_names = {node.func.id for node in nodes if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    bound: dict[str, set[tuple[str, str]]] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                if alias.name == "*":
                    continue
                local = alias.asname or alias.name
                kind = "class" if _class_shaped(alias.name) else "function" if local in called_names else "attribute"
                add(node.module or "", alias.name, kind)
                bound.setdefault(local, set()).add((node.module or "", alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    add(alias.name, "", "module")
                    if alias.asname or alias.name == "vllm":
                        bound.setdefault(alias.asname or "vllm", set()).add((alias.name, ""))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("import_module", "importlib.import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == "vllm"
        ):
            add(node.args[0].value, "", "module")
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "TARGET" for t in stmt.targets)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
        ):
            for path in (p.strip() for p in stmt.value.value.split(",")):
                if path.split(".")[0] == "vllm":
                    module, qualname = _target(path)
                    parts = qualname.split(".") if qualname else []
                    add(module, qualname, "module" if not parts else "class" if len(parts) == 1 else "attribute")

    def read(owner: ast.expr, attr: str, kind: str) -> None:
        if not isinstance(owner, ast.Name) or owner.id not in bound:
            return
        for module, qualname in sorted(bound[owner.id]):
            python_level = attr.startswith("__") and attr != "__version__"
            if python_level or (attr in _DICT_METHODS and not _class_shaped(qualname.rsplit(".", 1)[-1])):
                continue
            member_kind = kind if kind == "attribute" else "method" if qualname else "function"
            add(module, f"{qualname}.{attr}" if qualname else attr, member_kind)

    for node in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            read(node.value, node.attr, "method" if id(node) in called else "attribute")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                read(node.args[0], node.args[1].value, "attribute")
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[1], ast.Constant):
            if isinstance(node.elts[1].value, str):
                read(node.elts[0], node.elts[1].value, "method")
    return [VllmSymbol(module, qualname, kind, used_by) for (module, qualname), kind in kinds.items()]


def _declaration(tree: ast.Module) -> ast.expr | None:
    for stmt in tree.body:
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == DECLARATION for t in targets):
            return stmt.value
    return None


def declared_symbols(source: str, used_by: str) -> list[VllmSymbol]:
    """The ``VLLM_SYMBOLS`` of one engine module's source (``my_pkg.engine.vllm_uses``), read with ``ast``."""
    value = _declaration(ast.parse(source))
    if value is None:
        return []
    problem = f"{used_by}: {DECLARATION} must be a tuple of symbol(...) and *attributes(...) with literal arguments"
    if not isinstance(value, ast.Tuple):
        raise ValueError(problem)
    declared: list[Declared] = []
    for element in value.elts:
        call = element.value if isinstance(element, ast.Starred) else element
        helper = call.func.id if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) else None
        if helper not in _HELPERS or (helper == "attributes") != isinstance(element, ast.Starred):
            raise ValueError(f"{problem}; found {ast.unparse(element)}")
        assert isinstance(call, ast.Call)
        try:
            args = [ast.literal_eval(arg) for arg in call.args]
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
            made = _HELPERS[helper](*args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{problem}; {ast.unparse(element)}: {exc}") from exc
        declared.extend((made,) if isinstance(made, Declared) else made)
    return [VllmSymbol(d.module, d.qualname, d.kind, used_by, d.params, d.subclass_of, d.decorator) for d in declared]


def unused_declarations(source: str, used_by: str) -> list[str]:
    """Declared names the module's code (its ``VLLM_SYMBOLS`` left out) never mentions.

    A name is used when it is read or written as ``.name``, is a whole string literal ``"name"``
    (``getattr(x, "name")``, ``(Cls, "name")``, a table of field names), is matched by an f-string
    (``f"{section}_config"``), or, for a module-level name (class, function, object), is also a name in the
    code; a module is used when the module imports it or names it in a string.
    """
    tree = ast.parse(source)
    declaration = _declaration(tree)
    skip = {id(node) for node in ast.walk(declaration)} if declaration is not None else set()
    words: set[str] = set()  # `.name`, "name"
    names: set[str] = set()  # names bound or read in the code
    modules: set[str] = set()
    patterns: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
            modules.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.add(node.value)
            modules.update(p.strip() for p in node.value.split(","))
        elif isinstance(node, ast.JoinedStr):
            parts = [re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in node.values]
            if any(isinstance(v, ast.Constant) and v.value for v in node.values):
                patterns.append("".join(parts))
                skip.update(id(v) for v in node.values if isinstance(v, ast.Constant))
    unused = []
    for symbol_ in declared_symbols(source, used_by):
        if symbol_.kind == "module":
            used = symbol_.module in modules
        else:
            word = symbol_.qualname.rsplit(".", 1)[-1]
            used = word in words or any(re.fullmatch(pattern, word) for pattern in patterns)
            module_level = "." not in symbol_.qualname  # a class, a function, an object such as ModelRegistry
            used = used or (module_level and word in names)
        if not used:
            unused.append(symbol_.name)
    return unused


def _merge(old: VllmSymbol, new: VllmSymbol, old_declared: bool, new_declared: bool) -> VllmSymbol:
    """One entry for a name several modules use; a declaration's kind beats a derived one."""
    kind = old.kind
    if new_declared and old_declared and new.kind != old.kind:
        raise ValueError(f"{new.name} is declared a {old.kind} by {old.used_by} and a {new.kind} by {new.used_by}")
    if (new_declared and not old_declared) or (not old_declared and kind == "attribute"):
        kind = new.kind
    constraints = {}
    for field in ("params", "subclass_of", "decorator"):
        mine, theirs = getattr(old, field), getattr(new, field)
        if mine and theirs and mine != theirs:
            raise ValueError(f"{new.name}: {field} {mine!r} ({old.used_by}) and {theirs!r} ({new.used_by}) differ")
        constraints[field] = mine or theirs
    used_by = old.used_by.split(", ")
    used_by += [path for path in new.used_by.split(", ") if path not in used_by]
    return VllmSymbol(old.module, old.qualname, kind, ", ".join(used_by), **constraints)


def engine_symbols(engine_dir: Path = ENGINE_DIR) -> tuple[VllmSymbol, ...]:
    """Every module's derived and declared vLLM names, one entry per name, in file then source order."""
    merged: dict[tuple[str, str], tuple[VllmSymbol, bool]] = {}
    for path in sorted(engine_dir.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        used_by = path.relative_to(engine_dir.parent).as_posix()
        for declared, found in ((False, derived_symbols(source, used_by)), (True, declared_symbols(source, used_by))):
            for new in found:
                key = (new.module, new.qualname)
                if key not in merged:
                    merged[key] = (new, declared)
                else:
                    old, old_declared = merged[key]
                    merged[key] = (_merge(old, new, old_declared, declared), old_declared or declared)
    return tuple(symbol_ for symbol_, _ in merged.values())


#: Every vLLM symbol the engine half (``my_pkg/engine``) touches: what each module imports (derived by
#: ``derived_symbols``) and what it declares in its ``VLLM_SYMBOLS`` (``my_pkg.engine.vllm_uses``).
ENGINE_SYMBOLS: tuple[VllmSymbol, ...] = engine_symbols()


# ---- the sources of one vLLM distribution -------------------------------------------------------


class SourceTree:
    """The ``.py`` files of a vLLM distribution, parsed on demand; never imported.

    ``read(path)`` returns the text of a path such as ``vllm/config/__init__.py``, or None.
    """

    def __init__(self, read: Callable[[str], str | None], origin: str) -> None:
        self._read = read
        self.origin = origin
        self._parsed: dict[str, ast.Module | None] = {}
        self.files_read: set[str] = set()

    @classmethod
    def from_wheel(cls, wheel: str | Path) -> SourceTree:
        try:
            archive = zipfile.ZipFile(wheel)
        except (OSError, zipfile.BadZipFile) as exc:
            raise CompatError(f"cannot open {wheel} as a wheel: {exc}") from exc
        names = set(archive.namelist())

        def read(path: str) -> str | None:
            return archive.read(path).decode("utf-8") if path in names else None

        return cls(read, str(wheel))

    @classmethod
    def from_directory(cls, site: str | Path) -> SourceTree:
        """Sources under ``site`` (the folder that holds the ``vllm`` package)."""
        root = Path(site)

        def read(path: str) -> str | None:
            file = root / path
            return file.read_text(encoding="utf-8") if file.is_file() else None

        return cls(read, str(root / "vllm"))

    @classmethod
    def installed(cls) -> SourceTree:
        """The vLLM importable from this interpreter (located, not imported)."""
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise CompatError("vLLM is not installed in this environment")
        return cls.from_directory(Path(list(spec.submodule_search_locations)[0]).parent)

    def _path(self, module: str) -> tuple[str, bool] | None:
        base = module.replace(".", "/")
        for path, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if path not in self._parsed:
                text = self._read(path)
                if text is not None:
                    self.files_read.add(path)
                self._parsed[path] = ast.parse(text, filename=path) if text is not None else None
            if self._parsed[path] is not None:
                return path, is_package
        return None

    def module(self, module: str) -> ast.Module | None:
        found = self._path(module)
        return self._parsed[found[0]] if found else None

    def is_package(self, module: str) -> bool:
        found = self._path(module)
        return bool(found and found[1])

    def version(self) -> str | None:
        """``vllm.__version__`` when it is a string literal somewhere along its imports."""
        found = _Resolver(self).lookup("vllm", "__version__")
        value = getattr(found, "value", None) if found else None
        return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None


class CompatError(RuntimeError):
    """The vLLM sources could not be obtained."""


# ---- name resolution ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    """What a name resolved to. ``kind``: module, class, function, method, attribute (property
    included), instance (a module-level object made by calling a class), or external (imported
    from outside vLLM: present, not inspected)."""

    kind: str
    module: str
    node: ast.AST | None = None
    value: ast.AST | None = None  # assigned value, for attributes
    instance_of: _Found | None = None


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


class _Resolver:
    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree

    def lookup(self, module: str, qualname: str) -> _Found | None:
        if self.tree.module(module) is None:
            return None
        found: _Found | None = _Found("module", module)
        for part in qualname.split(".") if qualname else ():
            found = self.member(found, part) if found is not None else None
        return found

    def member(self, found: _Found, name: str) -> _Found | None:
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

    def module_member(self, module: str, name: str, hops: int = 0) -> _Found | None:
        tree = self.tree.module(module)
        if tree is None or hops > _MAX_IMPORT_HOPS:
            return None
        annotated: _Found | None = None
        for stmt in _runtime_statements(tree.body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return _Found("class", module, stmt)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return _Found("function", module, stmt)
            if isinstance(stmt, ast.Assign) and any(name in _target_names(t) for t in stmt.targets):
                return self._assigned(module, stmt, stmt.value, hops)
            if isinstance(stmt, ast.AnnAssign) and name in _target_names(stmt.target):
                if stmt.value is not None:
                    return self._assigned(module, stmt, stmt.value, hops)
                annotated = annotated or _Found("attribute", module, stmt)
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
                        return _Found("module" if self.tree.module(target) else "external", target)
        lazy = self._lazy_attribute(module, tree, name, hops)
        if lazy is not None:
            return lazy
        if self.tree.module(f"{module}.{name}") is not None:
            return _Found("module", f"{module}.{name}")
        return annotated

    def _imported(self, source: str, name: str, hops: int) -> _Found | None:
        if source.split(".")[0] != "vllm":
            return _Found("external", source)
        found = self.module_member(source, name, hops + 1)
        if found is None and self.tree.module(f"{source}.{name}") is not None:
            return _Found("module", f"{source}.{name}")
        return found

    def _assigned(self, module: str, stmt: ast.stmt, value: ast.expr, hops: int) -> _Found:
        if isinstance(value, (ast.Name, ast.Attribute)):
            alias = self.expression(module, value, hops + 1)
            if alias is not None:
                return alias
        if isinstance(value, ast.Call):
            made_by = self.expression(module, value.func, hops + 1)
            if made_by is not None and made_by.kind == "class":
                return _Found("instance", module, stmt, value, instance_of=made_by)
        return _Found("attribute", module, stmt, value)

    def _lazy_attribute(self, module: str, tree: ast.Module, name: str, hops: int) -> _Found | None:
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

    def expression(self, module: str, expr: ast.expr, hops: int = 0) -> _Found | None:
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

    def bases(self, cls: _Found) -> Iterator[_Found]:
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            found = self.expression(cls.module, base)
            if found is not None and found.kind == "class":
                yield found

    def class_member(self, cls: _Found, name: str, seen: set[tuple[str, str]]) -> _Found | None:
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        if (cls.module, node.name) in seen:
            return None
        seen.add((cls.module, node.name))
        for stmt in _runtime_statements(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return _Found("attribute" if _is_property(stmt) else "method", cls.module, stmt)
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return _Found("class", cls.module, stmt)
            if isinstance(stmt, ast.Assign) and any(name in _target_names(t) for t in stmt.targets):
                return _Found("attribute", cls.module, stmt, stmt.value)
            if isinstance(stmt, ast.AnnAssign) and name in _target_names(stmt.target):
                return _Found("attribute", cls.module, stmt, stmt.value)
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
                                return _Found("attribute", cls.module, inner)
        for base in self.bases(cls):
            found = self.class_member(base, name, seen)
            if found is not None:
                return found
        return None

    def dataclass_fields(self, cls: _Found, seen: set[tuple[str, str]] | None = None) -> list[str]:
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

    def derives_from(self, cls: _Found, module: str, name: str, seen: set[tuple[str, str]] | None = None) -> bool:
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


# ---- checking -----------------------------------------------------------------------------------

_ACCEPTED_KINDS = {
    "module": {"module"},
    "class": {"class"},
    "function": {"function"},
    "method": {"method"},
    "attribute": {"attribute", "instance"},
}


@dataclass(frozen=True)
class SymbolCheck:
    """``status``: ``ok``, ``missing`` or ``changed`` (found, but not as the engine uses it)."""

    symbol: VllmSymbol
    status: str
    detail: str = ""
    defined_in: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _check_one(resolver: _Resolver, symbol: VllmSymbol) -> SymbolCheck:
    found = resolver.lookup(symbol.module, symbol.qualname)
    if found is None:
        return SymbolCheck(symbol, "missing", "not found")
    where = found.module
    if found.kind == "external":
        return SymbolCheck(symbol, "ok", "re-exported from outside vLLM", where)
    if found.kind not in _ACCEPTED_KINDS[symbol.kind]:
        shown = "property or attribute" if found.kind == "attribute" else found.kind
        return SymbolCheck(symbol, "changed", f"is a {shown} now, the engine uses a {symbol.kind}", where)
    if symbol.params:
        if isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = found.node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args)]
        elif isinstance(found.node, ast.ClassDef):
            names = resolver.dataclass_fields(found)
        else:
            names = []
        if tuple(names[: len(symbol.params)]) != symbol.params:
            return SymbolCheck(
                symbol,
                "changed",
                f"parameters are ({', '.join(names)}), the engine passes ({', '.join(symbol.params)})",
                where,
            )
    if symbol.subclass_of:
        base_module, _, base_name = symbol.subclass_of.partition(":")
        if not resolver.derives_from(found, base_module, base_name):
            return SymbolCheck(symbol, "changed", f"no longer derives from {base_module}.{base_name}", where)
    if symbol.decorator and isinstance(found.node, ast.ClassDef):
        decorators = [ast.unparse(d) for d in found.node.decorator_list]
        if symbol.decorator not in decorators:
            return SymbolCheck(
                symbol, "changed", f"decorators are {decorators or 'none'}, the engine needs @{symbol.decorator}", where
            )
    return SymbolCheck(symbol, "ok", "", where)


def check_symbols(tree: SourceTree, symbols: tuple[VllmSymbol, ...] = ENGINE_SYMBOLS) -> list[SymbolCheck]:
    """One result per symbol, in table order."""
    resolver = _Resolver(tree)
    return [_check_one(resolver, symbol) for symbol in symbols]


# ---- fetching a release -------------------------------------------------------------------------


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "my_pkg" / "vllm-wheels"


def fetch_wheel(version: str, cache_dir: Path) -> Path:
    """The vLLM ``version`` wheel from ``cache_dir``, downloaded there first when missing (no dependencies)."""
    cached = sorted(cache_dir.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as staging:  # a partial download never looks cached
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"vllm=={version}",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
            staging,
        ]
        print(f"downloading the vLLM {version} wheel (no dependencies) into {cache_dir} ...", flush=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(staging).glob(f"vllm-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise CompatError(f"`{' '.join(command[2:])}` failed: {' / '.join(tail) or 'no wheel for this platform'}")
        target = cache_dir / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


# ---- command line -------------------------------------------------------------------------------


def format_table(results: list[SymbolCheck]) -> str:
    header = ("status", "module", "name", "kind", "used by")
    rows = [
        (
            r.status.upper() if not r.ok else "ok",
            r.symbol.module,
            r.symbol.qualname or "(module)",
            r.symbol.kind,
            r.symbol.used_by,
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m my_pkg.devtools.compat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = ap.add_mutually_exclusive_group()
    source.add_argument(
        "--vllm-version", default=None, help=f"release to fetch and check (default {DEFAULT_VLLM_VERSION})"
    )
    source.add_argument("--wheel", type=Path, default=None, help="check this vLLM wheel file")
    source.add_argument("--installed", action="store_true", help="check the vLLM installed in this environment")
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where fetched wheels are kept and reused (default: ~/.cache/my_pkg/vllm-wheels)",
    )
    args = ap.parse_args(argv)
    try:
        if args.installed:
            tree = SourceTree.installed()
        elif args.wheel is not None:
            tree = SourceTree.from_wheel(args.wheel)
        else:
            version = args.vllm_version or DEFAULT_VLLM_VERSION
            tree = SourceTree.from_wheel(fetch_wheel(version, args.cache_dir or default_cache_dir()))
        if tree.module("vllm") is None:
            raise CompatError(f"{tree.origin} holds no vllm package")
    except CompatError as exc:
        print(f"compat: {exc}", file=sys.stderr)
        return EXIT_NO_SOURCES
    results = check_symbols(tree)
    print(f"vLLM {tree.version() or '(unknown version)'} from {tree.origin}\n")
    print(format_table(results))
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(bad)} of {len(results)} engine symbols found as used.")
    if bad:
        print(f"{len(bad)} missing or changed:")
        for r in bad:
            print(
                f"  {r.status}: {r.symbol.name} ({r.symbol.kind}, used by {r.symbol.used_by}): {r.detail}"
                + (f" [looked in {r.defined_in}]" if r.defined_in else "")
            )
        return EXIT_MISSING
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
