"""my_pkg.devtools.compat.check: the installed vLLM passes; the command reports what is missing or changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from my_pkg.devtools.compat import ENGINE_SYMBOLS, SourceTree, check_symbols, main

from .conftest import ROOT, write_wheel


def test_installed_vllm_has_every_engine_symbol():
    tree = SourceTree.installed()
    results = check_symbols(tree)
    assert [(r.symbol.name, r.status, r.detail) for r in results if not r.ok] == []
    assert len(results) == len(ENGINE_SYMBOLS)
    assert tree.version() and tree.version()[0].isdigit()
    assert "vllm/v1/worker/gpu_input_batch.py" in tree.files_read


def _installed_sources_without(tmp_path: Path, old: str, new: str) -> Path:
    """A wheel holding the installed vLLM files the checker reads, with one edit."""
    tree = SourceTree.installed()
    check_symbols(tree)
    site = Path(tree.origin).parent
    sources = {name: (site / name).read_text() for name in sorted(tree.files_read)}
    path = "vllm/v1/worker/gpu_input_batch.py"
    assert sources[path].count(old) == 1
    sources[path] = sources[path].replace(old, new)
    return write_wheel(tmp_path / "vllm-0.0.1-py3-none-any.whl", sources)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.parametrize("argv", [["--wheel", "a.whl", "--installed"], ["--vllm-version", "0.33.0", "--installed"]])
def test_sources_are_chosen_once(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
