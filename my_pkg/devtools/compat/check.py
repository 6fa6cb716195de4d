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
import sys
from dataclasses import dataclass
from pathlib import Path

from my_pkg.devtools.compat.manifest import ENGINE_SYMBOLS, VllmSymbol
from my_pkg.devtools.compat.resolver import Resolver
from my_pkg.devtools.compat.sources import CompatError, SourceTree, default_cache_dir, fetch_wheel

__all__ = ["DEFAULT_VLLM_VERSION", "SymbolCheck", "check_symbols", "format_table", "main"]

DEFAULT_VLLM_VERSION = "0.33.0"
EXIT_OK, EXIT_MISSING, EXIT_NO_SOURCES = 0, 1, 2

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


def _check_one(resolver: Resolver, symbol: VllmSymbol) -> SymbolCheck:
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
    resolver = Resolver(tree)
    return [_check_one(resolver, symbol) for symbol in symbols]


# ---- the report and the command line ------------------------------------------------------------


def format_table(results: list[SymbolCheck]) -> str:
    """One aligned row per result: status (upper case when not ok), module, name, kind, used by."""
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
    """The command line: pick the sources, check ``ENGINE_SYMBOLS``, print the report; the exit status."""
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
