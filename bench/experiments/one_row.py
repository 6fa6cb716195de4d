"""The products a decode step streams whole, as FlashHead stores and multiplies them, against before.

Two matrices are multiplied whole by every step of few rows: stage 1's centroids (greedy rows) and a sampled
row's ``[V, r]`` estimate table (:mod:`my_pkg.flashhead.layout`).  Since this change a float32 CPU head stores the
table hidden-major, as it stores the centroids, and a bfloat16 CPU head multiplies one row by ``torch.mv`` (both
matrices).  This measures, in one run, at ``--batches`` rows:

* the two products alone: ``F.linear`` over the row-major matrix (before) and :func:`my_pkg.flashhead.layout.linear`
  over the stored one (as served);
* ``FlashHead.step_logits`` (greedy and sampled rows, 3 pinned ids) before and as served: before = the table
  swapped for its row-major copy and ``torch.mv`` switched off, the same head otherwise;

beside the dense head (vLLM's CPU GEMM when vLLM is installed, else ``F.linear``).  In each of ``--rounds`` rounds
every call is the median of ``--repeats`` calls, each after writing ``--cold-mb`` MiB elsewhere (untimed), as a
model's layers evict the head's matrices from the cache between two steps (0: warm calls), the order of before
and after alternating; the table gives the median over the rounds and after / before (below 1: faster now).
Random head, random balanced clusters, the builder's default probes, a fitted sampled-row estimate.

    python -m bench.experiments.one_row --threads 1                  # float32 and bfloat16, both shapes
    python -m bench.experiments.one_row --dtypes bfloat16 --batches 1 --threads 1 --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np
import torch

from bench._report import (
    EXPERIMENTS_MD,
    command_line,
    dense_head,
    fitted_tail_factors,
    int_list,
    machine_description,
    median_ms,
    shape_list,
    timing_args,
    write_section,
)
from my_pkg.flashhead import FlashHead, default_n_probes, layout
from my_pkg.flashhead.clustering import random_balanced_assignment

WAYS = ("before", "served")
PARTS = ("stage 1", "estimate", "greedy", "sampled")


@contextlib.contextmanager
def before_this_change(head: FlashHead, row_major_table: torch.Tensor) -> Iterator[None]:
    """``head`` as it multiplied before: its estimate table ``row_major_table`` (the stored one's values) and no
    ``torch.mv``."""
    tables = head._tail_tables()
    stored = tables.projected
    tables.projected = row_major_table
    try:
        with mock.patch.object(layout, "prefers_vector_product", lambda matrix: False):
            yield
    finally:
        tables.projected = stored


def _head(vocab: int, hidden: int, dtype: torch.dtype) -> FlashHead:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=generator).to(dtype)
    assignments = random_balanced_assignment(vocab, 16)
    clusters = int(assignments.max()) + 1
    return FlashHead(
        weight,
        torch.randn(clusters, hidden, generator=generator),
        assignments,
        n_probes=default_n_probes(clusters),
        tail_factors=fitted_tail_factors(weight, vocab),
    )


def _calls(
    head: FlashHead, way: str, x: torch.Tensor, projected: torch.Tensor, row_major_table: torch.Tensor, pins
) -> dict[str, Callable[[], object]]:
    """The four calls of ``way``: before, the centroids as stored (hidden-major in float32 already) and the table
    row-major, multiplied by ``F.linear``; as served, the stored matrices by :func:`layout.linear`."""
    product = layout.linear if way == "served" else torch.nn.functional.linear
    table = head._tail_tables().projected if way == "served" else row_major_table
    greedy, sampled = np.zeros(x.shape[0], bool), np.ones(x.shape[0], bool)
    return {
        "stage 1": lambda: product(x, head.centroids),
        "estimate": lambda: product(projected, table),
        "greedy": lambda: head.step_logits(x, sampled=greedy, pinned=pins),
        "sampled": lambda: head.step_logits(x, sampled=sampled, pinned=pins),
    }


def run_shape(
    vocab: int, hidden: int, dtype: torch.dtype, batches: list[int], rounds: int, repeats: int, cold_mb: int = 0
) -> dict:
    """Per batch, the median ms of every ``"<part> <way>"`` call and of ``"dense"``."""
    evict = torch.zeros(cold_mb << 18) if cold_mb > 0 else None  # float32: 2**18 elements a MiB
    head = _head(vocab, hidden, dtype)
    dense, _ = dense_head(head.weight)
    pins = torch.arange(vocab - 3, vocab)
    tables = head._tail_tables()
    row_major_table = tables.projected.contiguous()
    generator = torch.Generator().manual_seed(1)
    results = []
    for batch in batches:
        x = torch.randn(batch, hidden, generator=generator).to(dtype)
        projected = (x @ tables.basis).to(dtype)

        times: dict[str, list[float]] = {"dense": []}
        for rnd in range(rounds):
            times["dense"].append(median_ms(lambda x=x: dense(x), repeats, evict))
            for way in WAYS if rnd % 2 == 0 else WAYS[::-1]:
                with before_this_change(head, row_major_table) if way == "before" else contextlib.nullcontext():
                    for part, call in _calls(head, way, x, projected, row_major_table, pins).items():
                        call()  # warm: the first call of a layout pays its page faults
                        times.setdefault(f"{part} {way}", []).append(median_ms(call, repeats, evict))
        ms = {name: statistics.median(values) for name, values in times.items()}
        results.append({"batch": batch, **ms})
        line = "  ".join(f"{part} {ms[f'{part} before']:.2f}->{ms[f'{part} served']:.2f}" for part in PARTS)
        print(f"  {vocab}x{hidden} {str(dtype)[6:]} B={batch}: dense {ms['dense']:.2f}  {line}", flush=True)
    return {"vocab": vocab, "hidden": hidden, "dtype": str(dtype)[6:], "rows": results}


def to_markdown(shapes: list[dict], rounds: int, threads: int, cold_mb: int = 0) -> str:
    lines = [
        "### One-row products: the estimate's table hidden-major, bfloat16 rows by `torch.mv` (cpu)",
        "",
        f"Machine: {machine_description()}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Milliseconds, median of {rounds} paired rounds, {threads} thread(s), "
        + (f"{cold_mb} MiB written before each call; " if cold_mb else "warm calls; ")
        + "before / as served (after ÷ before), "
        "and the steps' speed-up over the dense head (dense ÷ step) before → as served.",
        "",
        "| shape | dtype | batch | dense | stage 1 | estimate | greedy step | sampled step "
        "| greedy vs dense | sampled vs dense |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in shapes:
        for row in shape["rows"]:

            def pair(part: str, row: dict = row) -> str:
                before, served = row[f"{part} before"], row[f"{part} served"]
                return f"{before:.2f} / {served:.2f} ({served / before:.2f})"

            def speed(part: str, row: dict = row) -> str:
                return f"{row['dense'] / row[f'{part} before']:.2f}x → {row['dense'] / row[f'{part} served']:.2f}x"

            lines.append(
                f"| {shape['vocab']:,} × {shape['hidden']:,} | {shape['dtype']} | {row['batch']} "
                f"| {row['dense']:.2f} | "
                + " | ".join(pair(part) for part in PARTS)
                + f" | {speed('greedy')} | {speed('sampled')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=shape_list, default=[(262144, 640), (128256, 2048)], help="VOCABxHIDDEN,...")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32, bfloat16 or both")
    ap.add_argument("--batches", type=int_list, default=[1, 2, 8])
    ap.add_argument("--cold-mb", type=int, default=64, help="MiB written before each call (0: warm calls)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = timing_args(ap, argv)
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",") if name.strip()]
    with torch.inference_mode():
        shapes = [
            run_shape(vocab, hidden, dtype, args.batches, args.rounds, args.repeats, args.cold_mb)
            for dtype in dtypes
            for vocab, hidden in args.shapes
        ]
    markdown = to_markdown(shapes, args.rounds, torch.get_num_threads(), args.cold_mb)
    print(markdown)
    if not args.no_write:
        print(f"wrote {write_section('one-row', markdown, EXPERIMENTS_MD)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
