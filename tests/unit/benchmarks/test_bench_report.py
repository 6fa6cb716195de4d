import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_write_section_keeps_other_sections(tmp_path):
    rep = _report()
    md = tmp_path / "benchmarks.md"
    rep.write_section("head", "first", md)  # creates the file
    md.write_text(md.read_text() + "\n<!-- bench:other:begin -->\nkeep me\n<!-- bench:other:end -->\ntrailer\n")
    rep.write_section("head", "| a |\n|---|\n| 1 |", md)
    text = md.read_text()
    assert text.count("<!-- bench:head:begin -->") == 1 and "first" not in text
    assert "| 1 |" in text and "keep me" in text and "trailer" in text
    rep.write_section("new", "appended", md)
    assert text.strip() in md.read_text() and md.read_text().rstrip().endswith("<!-- bench:new:end -->")
    desc = rep.machine_description()
    assert "CPU" in desc and "torch" in desc


@pytest.mark.slow
def test_bench_head_runs_small():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "head.py"),
            "--hidden",
            "40",
            "--vocab",
            "512",
            "--batches",
            "1,3",
            "--repeats",
            "1",
            "--min-time",
            "0",
            "--no-write",
            "--n-probes",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "B=   3" in proc.stdout and "crossover batch" in proc.stdout
