"""Does a vLLM release still have every vLLM symbol the engine half touches? Checked statically.

Run it as ``python -m my_pkg.devtools.compat [--vllm-version X | --wheel FILE | --installed]`` (``check.main``).
Four modules, each one step:

- ``manifest``: ``ENGINE_SYMBOLS``, collected from ``my_pkg/engine`` with ``ast`` (imports derived,
  ``VLLM_SYMBOLS`` declared);
- ``sources``: ``SourceTree``, the ``.py`` files of a wheel (``fetch_wheel``), a directory or the installed vLLM;
- ``resolver``: ``Resolver``, a dotted name looked up in those sources as Python would at run time;
- ``check``: ``check_symbols`` (one ``SymbolCheck`` per symbol), the report and the command line.

The package is a developer tool run from a source checkout: it is not in the wheel, and the plugin never
imports it.
"""

from my_pkg.devtools.compat.check import DEFAULT_VLLM_VERSION, SymbolCheck, check_symbols, main
from my_pkg.devtools.compat.manifest import (
    ENGINE_DIR,
    ENGINE_SYMBOLS,
    KINDS,
    VllmSymbol,
    declared_symbols,
    derived_symbols,
    engine_symbols,
    unused_declarations,
)
from my_pkg.devtools.compat.sources import CompatError, SourceTree, fetch_wheel

__all__ = [
    "KINDS",
    "VllmSymbol",
    "SymbolCheck",
    "SourceTree",
    "CompatError",
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
