"""The product benchmarks behind one runner: each section of docs/benchmarks.md and the command that writes it.

    python -m bench --list                      # the sections and their commands
    python -m bench top-p head                  # run those benchmarks, each rewriting its section
    python -m bench --all                       # every section (hours on a 2-core CPU; servers included)
    python -m bench top-p -- --vocabs 4096      # extra arguments go to the benchmark (one section only)

Each command is the one that produced the figures documented today, so a rerun is comparable. A run
fails (exit 1) when a benchmark exits non-zero or leaves its section unchanged. The A/B experiments
under ``bench/experiments/`` are not run here: their records live in ``docs/research/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench._report import BENCHMARKS_MD, DOCS_ENV

# section name -> `python -m` arguments; keys match the `<!-- bench:NAME:begin -->` markers of docs/benchmarks.md.
SECTIONS: dict[str, tuple[str, ...]] = {
    "head": ("bench.head", "--quick", "--threads", "1", "--clock", "cpu", "--repeats", "1", "--rounds", "3"),
    "head-bfloat16": (
        "bench.head",
        "--quick",
        "--dtype",
        "bfloat16",
        "--threads",
        "1",
        "--clock",
        "cpu",
        "--repeats",
        "1",
        "--rounds",
        "3",
        "--min-time",
        "0",
    ),
    "served-step": ("bench.served_step", "--shapes", "262144x640,128256x2048", "--rounds", "3"),
    "served-step-bfloat16": (
        "bench.served_step",
        "--dtype",
        "bfloat16",
        "--shapes",
        "262144x640,128256x2048",
        "--rounds",
        "3",
    ),
    "tp-served-step": ("bench.tp_served_step", "--vocab", "262144", "--hidden", "640", "--rounds", "3"),
    "tp-served-step-bfloat16": ("bench.tp_served_step", "--dtype", "bfloat16", "--rounds", "3"),
    "serve": ("bench.serve", "--seconds", "20", "--rounds", "2", "--write-docs"),
    "admin": ("bench.admin_load", "--seconds", "15", "--write-docs"),
    "admin-1hz": ("bench.admin_load", "--hz", "1", "--write-docs"),
    "top-p": ("bench.top_p",),
    "compact-fidelity": ("bench.compact_fidelity",),
}


def section_text(docs: Path, name: str) -> str | None:
    """The text between a section's markers, or None when the file has no such section."""
    text = docs.read_text() if docs.exists() else ""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0]


def run_section(name: str, extra: list[str], docs: Path) -> str | None:
    """Run one section's benchmark; None when it wrote its section, else what went wrong."""
    command = [sys.executable, "-m", *SECTIONS[name], *extra]
    before = section_text(docs, name)
    print(f"== {name}: {' '.join(['python', '-m', *SECTIONS[name], *extra])}", flush=True)
    started = time.monotonic()
    returncode = subprocess.run(command, env={**os.environ, DOCS_ENV: str(docs)}).returncode
    print(f"== {name}: exit {returncode} after {time.monotonic() - started:.0f} s", flush=True)
    if returncode != 0:
        return f"exit status {returncode}"
    after = section_text(docs, name)
    if after is None or after == before:
        return f"did not rewrite its section of {docs}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sections", nargs="*", metavar="SECTION", help=f"one or more of: {', '.join(SECTIONS)}")
    ap.add_argument("--all", action="store_true", help="run every section")
    ap.add_argument("--list", action="store_true", help="print the sections and their commands, run nothing")
    ap.add_argument("--docs", type=Path, default=BENCHMARKS_MD, help="the file to rewrite (default: %(default)s)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.list:
        for name, command in SECTIONS.items():
            print(f"{name:<24} python -m {' '.join(command)}")
        return 0
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    names = list(SECTIONS) if args.all else args.sections
    if not names:
        ap.error("name one or more sections, or --all (see --list)")
    if extra and len(names) != 1:
        ap.error("arguments after -- go to one benchmark: name exactly one section")
    failures = {name: problem for name in names if (problem := run_section(name, extra, args.docs)) is not None}
    for name, problem in failures.items():
        print(f"FAILED {name}: {problem}", file=sys.stderr)
    print(f"{len(names) - len(failures)} of {len(names)} section(s) rewritten in {args.docs}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
