"""Shared helpers for the benchmarks: machine description, marker-delimited sections of
``docs/benchmarks.md``, comma-separated integer arguments, a median wall-clock timer, the timing
options of the paired-round CPU benchmarks, the sampled-row estimate a default build writes, and the dense head
as vLLM computes it."""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "write_section",
    "machine_description",
    "int_list",
    "shape_list",
    "median_ms",
    "add_timing_options",
    "start_timing",
    "timing_args",
    "fitted_tail_factors",
    "dense_head",
    "BENCHMARKS_MD",
    "EXPERIMENTS_MD",
    "DOCS_ENV",
]

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
#: Where the A/B experiments (`bench/experiments/`) and superseded variants write their sections.
EXPERIMENTS_MD = BENCHMARKS_MD.parent / "research" / "experiments.md"
# `python -m bench --docs PATH` hands its children another file to write (a copy, in its tests).
DOCS_ENV = "BENCH_DOCS"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """One markdown line: CPU model and cores, torch version, threads, GPU name (if any)."""
    parts = [f"CPU: {_cpu_model()} ({os.cpu_count()} logical cores)"]
    try:
        import torch

        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
        if torch.cuda.is_available():
            parts.append(f"GPU: {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})")
        else:
            parts.append("GPU: none")
    except ImportError:  # pragma: no cover
        parts.append("torch not installed")
    parts.append(f"Python {platform.python_version()}, {platform.system()} {platform.release()}")
    if hasattr(os, "getloadavg"):
        parts.append(f"load average {os.getloadavg()[0]:.1f} at start")
    return "; ".join(parts)


def write_section(name: str, markdown: str, path: str | Path | None = None) -> Path:
    """Replace the text between ``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->``
    in ``docs/benchmarks.md``, or in the file ``$BENCH_DOCS`` names (appending the section, or creating the
    file, when missing); the rest of the file is kept as is."""
    path = Path(path) if path is not None else Path(os.environ.get(DOCS_ENV) or BENCHMARKS_MD)
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def command_line() -> str:
    """How this benchmark was run, as ``python -m bench.NAME ...`` (``--work-dir`` left out)."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path(__file__).resolve().parents[1])
    except ValueError:
        script = Path(script.name)
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--work-dir":
            skip = True  # a local cache folder: does not change the results
        elif not arg.startswith("--work-dir="):
            args.append(arg)
    module = ".".join(script.with_suffix("").parts)
    return " ".join(["python", "-m", module, *args])


def int_list(text: str) -> list[int]:
    """`"1,8,32"` as `[1, 8, 32]` (an argparse `type`)."""
    return [int(x) for x in text.split(",") if x.strip()]


def shape_list(text: str) -> list[tuple[int, int]]:
    """`"128256x2048,262144x640"` as `[(128256, 2048), (262144, 640)]`: (vocabulary, hidden) pairs (argparse `type`)."""
    out = []
    for item in text.split(","):
        vocab, _, hidden = item.strip().lower().partition("x")
        out.append((int(vocab), int(hidden)))
    return out


def median_ms(fn: Callable[[], object], repeats: int, evict=None) -> float:
    """Median wall-clock milliseconds of `repeats` calls of `fn`; with `evict` (a tensor), each call after writing
    it, untimed, as a model's layers evict the head's matrices from the cache between two steps."""
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def paired_rounds(dense: Callable[[], object], served: Callable[[], object], rounds: int, repeats: int) -> dict:
    """``dense`` then ``served``, each the median of ``repeats`` calls, in each of ``rounds`` rounds: the medians
    over the rounds of their milliseconds (``dense_ms``, ``ms``) and of the ratios dense / served (``ratio``),
    with the lowest and highest round's ratio (``min``, ``max``)."""
    ratios, served_ms, dense_ms = [], [], []
    for _ in range(rounds):
        d = median_ms(dense, repeats)
        s = median_ms(served, repeats)
        ratios.append(d / s)
        served_ms.append(s)
        dense_ms.append(d)
    return {
        "dense_ms": statistics.median(dense_ms),
        "ms": statistics.median(served_ms),
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


def add_head_shape_options(parser: argparse.ArgumentParser) -> None:
    """``--hidden`` and ``--vocab`` of the random head, by default 2,048 x 128,256 (Llama-3.2-1B's head)."""
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)


def add_timing_options(parser: argparse.ArgumentParser) -> None:
    """``--threads``, ``--repeats`` (calls per measurement) and ``--rounds`` (paired rounds)."""
    parser.add_argument("--threads", type=int, default=None, help="default: torch's (every core)")
    parser.add_argument("--repeats", type=int, default=7, help="calls per measurement (median)")
    parser.add_argument("--rounds", type=int, default=5)


def timing_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed by ``parser`` with the timing options added (:func:`add_timing_options`), the timing
    started (:func:`start_timing`): the arguments of a paired-round CPU benchmark."""
    add_timing_options(parser)
    args = parser.parse_args(argv)
    start_timing(args)
    return args


def start_timing(args: argparse.Namespace) -> None:
    """Sets torch's threads from ``--threads`` and prints the machine and how the benchmark was run."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(machine_description())
    print(f"Command: `{command_line()}`; {torch.get_num_threads()} threads", flush=True)


def dense_head(weight):
    """``(fn, name)``: the dense LM-head product ``fn(hidden) -> [B, V]`` over ``weight`` ``[V, H]`` as vLLM
    computes it, and how. On CPU vLLM's build multiplies an unquantized head through oneDNN with the weight
    packed once at load (``dispatch_cpu_unquantized_gemm``), far faster than ``F.linear`` from a few rows on:
    that, when vLLM is installed and has it; else (and on other devices) ``F.linear``."""
    import torch

    if weight.device.type == "cpu":
        try:
            from vllm import _custom_ops as ops

            if ops._supports_onednn:
                handle = ops.create_onednn_mm(weight.t(), 32)
                return (lambda hidden: ops.onednn_mm(handle, hidden, None)), "vLLM's CPU GEMM (oneDNN, packed weight)"
        except Exception:  # noqa: BLE001 - no vLLM, or a build without it: the plain product
            pass
    return (lambda hidden: torch.nn.functional.linear(hidden, weight)), "`F.linear`"


def fitted_tail_factors(weight, vocab_size: int, *, states: int = 512, seed: int = 0):
    """The sampled rows' estimate a default build writes (fitted to calibration states, here random ones:
    the estimate's cost does not depend on them, only which tokens it ranks best), so that a benchmark head
    serves sampled rows as a default build's does (the fitted estimate's exact-token count, not the
    weight-only one's)."""
    import torch

    from my_pkg.flashhead.tail_estimate import default_tail_rank, fit_tail_factors

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(states, weight.shape[1], generator=generator).to(weight.device)
    return fit_tail_factors(weight, vocab_size, default_tail_rank(weight.shape[1]), hidden, seed=seed)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a torch.distributed rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
