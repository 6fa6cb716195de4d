"""my_pkg.devtools.compat: its symbol table follows the engine code, and the static checker finds what is there."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from my_pkg.devtools.compat import ENGINE_SYMBOLS, KINDS, SourceTree, VllmSymbol, check_symbols, fetch_wheel, main

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "my_pkg" / "engine"
TABLE = {(symbol.module, symbol.qualname) for symbol in ENGINE_SYMBOLS}


def _vllm_bindings(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (module, qualified name) for every vLLM import of a file, in any scope."""
    bound: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    bound[alias.asname or alias.name.split(".")[0]] = (alias.name if alias.asname else "vllm", "")
    return bound


def _engine_files() -> list[Path]:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) >= 8, files  # the engine half, patches included
    return files


def test_every_vllm_import_of_the_engine_half_is_in_the_table():
    imported = set()
    for path in _engine_files():
        imported |= set(_vllm_bindings(ast.parse(path.read_text())).values())
    assert ("vllm.v1.worker.worker_base", "WorkerBase") in imported  # the scan sees imports inside functions
    assert imported <= TABLE, sorted(imported - TABLE)


def test_every_attribute_read_on_an_imported_vllm_name_is_in_the_table():
    """`LogitsProcessor.register_oot`, `getattr(vllm, "__version__")`, `(InputBatch, "add_request")` ..."""
    used = set()
    for path in _engine_files():
        tree = ast.parse(path.read_text())
        bound = _vllm_bindings(tree)

        def ref(owner: ast.expr, attr: str, bound: dict = bound) -> None:
            # Python's own: __dict__, __name__ ..., and dict methods on a module-level dict (op_registry_oot.get).
            python_level = (attr.startswith("__") and attr != "__version__") or attr in dir(dict)
            if isinstance(owner, ast.Name) and owner.id in bound and not python_level:
                module, qualname = bound[owner.id]
                used.add((module, f"{qualname}.{attr}" if qualname else attr))

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                ref(node.value, node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                name = node.args[1] if len(node.args) >= 2 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    ref(node.args[0], name.value)
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[1], ast.Constant):
                if isinstance(node.elts[1].value, str):
                    ref(node.elts[0], node.elts[1].value)
    assert ("vllm.v1.worker.gpu_input_batch", "InputBatch.add_request") in used
    assert ("vllm", "__version__") in used
    assert used <= TABLE, sorted(used - TABLE)


def test_request_fields_that_decide_dense_rows_are_in_the_table():
    from my_pkg.engine.flashhead.rows import DENSE_REQUEST_FIELDS

    fields = {q.split(".", 1)[1] for m, q in TABLE if m == "vllm.sampling_params" and q.startswith("SamplingParams.")}
    assert set(DENSE_REQUEST_FIELDS) <= fields, set(DENSE_REQUEST_FIELDS) - fields


def test_every_table_entry_is_used_by_the_files_it_names():
    """An entry is read somewhere: its last name appears as a word in one of its `used_by` files
    (a module entry: its dotted name). Fails on entries left behind when the engine moves on."""
    import re

    from my_pkg.contract import CONFIG_SECTIONS

    read_by_section = {f"{section}_config" for section in CONFIG_SECTIONS}  # getattr(worker, f"{section}_config")
    unused = []
    for symbol in ENGINE_SYMBOLS:
        word = symbol.qualname.rsplit(".", 1)[-1] if symbol.qualname else symbol.module
        if symbol.qualname.startswith("WorkerBase.") and word in read_by_section:
            continue
        texts = [(ROOT / "my_pkg" / path.strip()).read_text() for path in symbol.used_by.split(",")]
        if not any(
            re.search(rf"(?<![\w.]){re.escape(word)}(?!\w)|\.{re.escape(word)}\b|['\"]{re.escape(word)}['\"]", text)
            for text in texts
        ):
            unused.append(symbol.name)
    assert unused == []


def test_table_entries_are_well_formed_and_unique():
    assert len(TABLE) == len(ENGINE_SYMBOLS)
    for symbol in ENGINE_SYMBOLS:
        assert symbol.kind in KINDS and symbol.module.split(".")[0] == "vllm", symbol
        files = [ROOT / "my_pkg" / path.strip() for path in symbol.used_by.split(",")]
        assert symbol.used_by and all(file.is_file() for file in files), symbol


def test_installed_vllm_has_every_engine_symbol():
    tree = SourceTree.installed()
    results = check_symbols(tree)
    assert [r for r in results if not r.ok] == []
    assert len(results) == len(ENGINE_SYMBOLS)
    assert tree.version() and tree.version()[0].isdigit()
    assert "vllm/v1/worker/gpu_input_batch.py" in tree.files_read


# ---- a tiny fake wheel: each lookup rule, and each way a symbol can go missing -----------------------

FAKE_SOURCES = {
    "vllm/__init__.py": (
        "from typing import TYPE_CHECKING\n"
        "from .version import __version__\n"
        "MODULE_ATTRS = {'Registry': '.models:Registry'}\n"
        "if TYPE_CHECKING:\n"
        "    from vllm.layers import Head as OnlyForTypeCheckers\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(name)\n"
    ),
    "vllm/version.py": "__version__: str\n__version__ = version = '9.9.9'\n",
    "vllm/models/__init__.py": "from .registry import Registry\n",
    "vllm/models/registry.py": (
        "from dataclasses import dataclass, field\n"
        "class _Registry:\n"
        "    models: dict = field(default_factory=dict)\n"
        "Registry = _Registry()\n"
        "@dataclass(frozen=True)\n"
        "class Entry:\n"
        "    module_name: str\n"
        "    class_name: str\n"
    ),
    "vllm/layers.py": (
        "from torch import nn\n"
        "class Pluggable(nn.Module):\n"
        "    @classmethod\n"
        "    def register_oot(cls, layer=None):\n"
        "        return layer\n"
        "class Head(Pluggable):\n"
        "    def __init__(self, scale):\n"
        "        self.scale = scale\n"
        "        self.a, self.b = 1, 2\n"
        "    def forward(self, lm_head, hidden_states):\n"
        "        return hidden_states\n"
        "    @property\n"
        "    def num_reqs(self):\n"
        "        return 0\n"
        "class Sub(Head):\n"
        "    pass\n"
    ),
}


def _wheel(path: Path, sources: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in sources.items():
            archive.writestr(name, text)
    return path


def test_fake_wheel_lookup_rules_and_reported_problems(tmp_path):
    s = VllmSymbol
    expected = {
        s("vllm", "__version__", "attribute", "x"): "ok",
        s("vllm", "Registry", "attribute", "x"): "ok",  # lazy MODULE_ATTRS -> re-export -> an instance
        s("vllm", "Registry.models", "attribute", "x"): "ok",  # a field of the instance's class
        s("vllm", "OnlyForTypeCheckers", "class", "x"): "missing",  # imported only under TYPE_CHECKING
        s("vllm.layers", "Head.register_oot", "method", "x"): "ok",  # inherited
        s("vllm.layers", "Head.scale", "attribute", "x"): "ok",  # self.scale = ...
        s("vllm.layers", "Head.b", "attribute", "x"): "ok",  # self.a, self.b = ...
        s("vllm.layers", "Head.forward", "method", "x", params=("self", "lm_head", "hidden_states")): "ok",
        s(
            "vllm.layers", "Head.forward", "method", "x", params=("self", "lm_head", "hidden_states", "embedding_bias")
        ): "changed",
        s("vllm.layers", "Head.num_reqs", "attribute", "x"): "ok",  # a property reads as an attribute
        s("vllm.layers", "Head.num_reqs", "method", "x"): "changed",
        s("vllm.layers", "Head.remove_request", "method", "x"): "missing",
        s("vllm.layers", "Head", "function", "x"): "changed",
        s("vllm.layers", "Sub", "class", "x", subclass_of="vllm.layers:Pluggable"): "ok",
        s("vllm.layers", "Pluggable", "class", "x", subclass_of="vllm.layers:Head"): "changed",
        s(
            "vllm.models.registry",
            "Entry",
            "class",
            "x",
            params=("module_name", "class_name"),
            decorator="dataclass(frozen=True)",
        ): "ok",
        s("vllm.models.registry", "_Registry", "class", "x", decorator="dataclass(frozen=True)"): "changed",
        s("vllm.gone", "", "module", "x"): "missing",
        s("vllm.models", "", "module", "x"): "ok",
    }
    tree = SourceTree.from_wheel(_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl", FAKE_SOURCES))
    results = check_symbols(tree, tuple(expected))
    assert {(r.symbol, r.status) for r in results} == set(expected.items())
    assert tree.version() == "9.9.9"


def _installed_sources_without(tmp_path: Path, old: str, new: str) -> Path:
    """A wheel holding the installed vLLM files the checker reads, with one edit."""
    tree = SourceTree.installed()
    check_symbols(tree)
    site = Path(tree.origin).parent
    sources = {name: (site / name).read_text() for name in sorted(tree.files_read)}
    path = "vllm/v1/worker/gpu_input_batch.py"
    assert sources[path].count(old) == 1
    sources[path] = sources[path].replace(old, new)
    return _wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", sources)


def test_command_reports_a_missing_method_and_exits_1(tmp_path):
    wheel = _installed_sources_without(tmp_path, "def remove_request(", "def drop_request(")
    proc = subprocess.run(
        [sys.executable, "-m", "my_pkg.devtools.compat", "--wheel", str(wheel)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{len(ENGINE_SYMBOLS) - 1} of {len(ENGINE_SYMBOLS)} engine symbols found" in proc.stdout
    assert "missing: vllm.v1.worker.gpu_input_batch.InputBatch.remove_request (method" in proc.stdout


def test_a_changed_signature_is_reported(tmp_path, capsys):
    wheel = _installed_sources_without(
        tmp_path,
        "def add_request(\n        self,\n        request:",
        "def add_request(\n        self,\n        req_index: int,\n        request:",
    )
    assert main(["--wheel", str(wheel)]) == 1
    out = capsys.readouterr().out
    assert "changed: vllm.v1.worker.gpu_input_batch.InputBatch.add_request" in out
    assert "the engine passes (self, request)" in out


def test_a_cached_wheel_is_reused_without_downloading(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = _wheel(cache / "vllm-9.9.9-py3-none-any.whl", FAKE_SOURCES)
    assert fetch_wheel("9.9.9", cache) == cached
    assert main(["--vllm-version", "9.9.9", "--cache-dir", str(cache)]) == 1  # the fake lacks the engine's symbols
    out = capsys.readouterr().out
    assert "downloading" not in out and f"vLLM 9.9.9 from {cached}" in out


def test_unreadable_sources_exit_2_with_a_message(tmp_path, capsys):
    not_a_wheel = tmp_path / "vllm-1.0.0-py3-none-any.whl"
    not_a_wheel.write_text("not a zip")
    assert main(["--wheel", str(not_a_wheel)]) == 2
    assert "cannot open" in capsys.readouterr().err
    empty = _wheel(tmp_path / "empty.whl", {"other/__init__.py": ""})
    assert main(["--wheel", str(empty)]) == 2
    assert "holds no vllm package" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--wheel", "a.whl", "--installed"], ["--vllm-version", "0.33.0", "--installed"]])
def test_sources_are_chosen_once(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
