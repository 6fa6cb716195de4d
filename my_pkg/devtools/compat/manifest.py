"""The manifest: every vLLM symbol the engine half touches, collected from ``my_pkg/engine`` with ``ast``.

The engine modules are read, never imported (they import vLLM). What a module imports from vLLM, and the
attributes it reads on those imported names, are derived (``derived_symbols``); the rest (attributes read on
vLLM objects the module is handed, methods it wraps, the parameters, base class or decorator a call relies on)
the module declares next to its code in ``VLLM_SYMBOLS`` (``my_pkg.engine.vllm_uses``, ``declared_symbols``).
``engine_symbols`` merges both into one ``VllmSymbol`` per name; ``ENGINE_SYMBOLS`` is that of the real tree,
collected at import. A malformed or conflicting declaration raises ``ValueError``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from my_pkg.engine.vllm_uses import DECLARATION, KINDS, Declared, attributes, symbol

__all__ = [
    "KINDS",
    "VllmSymbol",
    "ENGINE_DIR",
    "ENGINE_SYMBOLS",
    "engine_symbols",
    "derived_symbols",
    "declared_symbols",
    "unused_declarations",
]


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


#: The engine half whose vLLM symbols are checked; ``used_by`` paths are relative to its parent (``my_pkg``).
ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"
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
