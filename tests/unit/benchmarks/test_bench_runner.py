"""`python -m bench`: one command per section of docs/benchmarks.md, and a run that rewrites its section."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import SECTIONS, section_text
from bench._report import BENCHMARKS_MD, EXPERIMENTS_MD

REPO = Path(__file__).resolve().parents[3]
TINY_TOP_P = ["--vocabs", "4096", "--batches", "1", "--repeats", "1", "--rounds", "1"]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_every_section_of_the_benchmarks_page_has_its_command_and_no_other():
    markers = re.findall(r"^<!-- bench:([\w.-]+):begin -->", BENCHMARKS_MD.read_text(), re.M)
    assert sorted(markers) == sorted(SECTIONS)
    assert all((REPO / Path(*command[0].split("."))).with_suffix(".py").is_file() for command in SECTIONS.values())


def test_the_experiments_write_their_sections_in_the_research_page_only():
    experiments = re.findall(r"^<!-- bench:([\w.-]+):begin -->", EXPERIMENTS_MD.read_text(), re.M)
    assert experiments and not set(experiments) & set(SECTIONS)


@pytest.mark.slow
def test_a_run_rewrites_its_section_in_the_file_it_is_given(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(BENCHMARKS_MD.read_text())
    original = BENCHMARKS_MD.read_text()

    done = run_bench("--docs", str(docs), "top-p", "--", *TINY_TOP_P)

    assert done.returncode == 0, done.stdout + done.stderr
    section = section_text(docs, "top-p")
    assert section is not None and "| 4,096 | 1 |" in section
    assert f"Command: `python -m bench.top_p {' '.join(TINY_TOP_P)}`" in section
    assert BENCHMARKS_MD.read_text() == original


@pytest.mark.slow
def test_a_benchmark_that_leaves_its_section_alone_fails_the_run(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(BENCHMARKS_MD.read_text())

    done = run_bench("--docs", str(docs), "top-p", "--", *TINY_TOP_P, "--no-write")

    assert done.returncode == 1
    assert "FAILED top-p: did not rewrite its section" in done.stderr
    assert docs.read_text() == BENCHMARKS_MD.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuch"], "unknown section(s) nosuch"),
        ([], "name one or more sections, or --all"),
        (["head", "top-p", "--", "--rounds", "1"], "name exactly one section"),
    ],
)
def test_bad_arguments_exit_2_and_run_nothing(args, message):
    done = run_bench(*args)
    assert done.returncode == 2 and message in done.stderr


def test_the_list_names_each_section_with_its_command():
    listed = run_bench("--list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == list(SECTIONS)
    assert all(" ".join(["python", "-m", *SECTIONS[line.split()[0]]]) in line for line in listed)
