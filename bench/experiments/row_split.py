"""Small batches on several threads: each row's candidates cut into pieces for the threads, or not.

torch's CPU ``sampled_addmm`` shares whole CSR rows among the threads, so a decode step of one row (every
step at concurrency 1) would score its thousands of candidates on one thread while the dense GEMV it
replaces uses all of them. ``my_pkg.flashhead.kernels.torch_ref`` cuts each row of a batch with fewer rows
than threads into consecutive pieces (:func:`~my_pkg.flashhead.kernels.torch_ref._row_parts`, the same
values bit for bit). This measures ``FlashHead.step_logits`` (greedy and sampled rows, 3 pinned ids) both
ways in one process, at ``--threads`` threads (default: every core), beside dense ``F.linear`` into the
same logits: in each of ``--rounds`` rounds, dense, then cut and whole (their order alternating), median
of ``--repeats`` wall-clock calls each; the table gives the median over the rounds and the speed-ups.
Random head, random balanced assignment, the builder's default ``n_probes``. Prints only.

    python -m bench.experiments.row_split                      # 128,256 x 2,048 fp32, batch 1, 2, 4, every core
    python -m bench.experiments.row_split --threads 8 --batches 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from bench._report import add_head_shape_options, int_list, median_ms, timing_args
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.kernels import torch_ref

KINDS = ("greedy", "sampled")


def _step(head: FlashHead, hidden: torch.Tensor, kind: str, pins: torch.Tensor):
    sampled = np.full(hidden.shape[0], kind == "sampled")
    return lambda: head.step_logits(hidden, sampled=sampled, pinned=pins)


def run(args: argparse.Namespace, plan: torch_ref.CpuPlan = torch_ref.DEFAULT_PLAN) -> list[dict]:
    """Both ways per batch: ``plan`` (rows cut for the threads) and the same plan with no cut."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g)
    assignment = random_balanced_assignment(args.vocab, 16)
    clusters = int(assignment.max()) + 1
    head = FlashHead(
        weight,
        torch.randn(clusters, args.hidden, generator=g),
        assignment,
        n_probes=default_n_probes(clusters),
        cpu_plan=plan,
    )
    pins = torch.arange(args.vocab - 3, args.vocab)
    head.step_logits(torch.zeros(1, args.hidden), sampled=np.ones(1, bool))  # the estimate's tables, once
    plans = {"cut": plan, "whole": replace(plan, min_ids_per_part=1 << 62)}
    results = []
    for batch in args.batches:
        hidden = torch.randn(batch, args.hidden, generator=g)
        parts = torch_ref._row_parts(batch, head.n_probes * head.cluster_size, plans["cut"])
        runs: dict[str, list[float]] = {"dense": []}
        dense = partial(torch.nn.functional.linear, hidden, weight)
        for rnd in range(args.rounds):
            runs["dense"].append(median_ms(dense, args.repeats))
            for way in ("cut", "whole") if rnd % 2 == 0 else ("whole", "cut"):
                head.cpu_plan = plans[way]
                for kind in KINDS:
                    step = _step(head, hidden, kind, pins)
                    step()
                    runs.setdefault(f"{kind} {way}", []).append(median_ms(step, args.repeats))
        row = {"batch": batch, "parts": parts}
        row.update({name: statistics.median(times) for name, times in runs.items()})
        results.append(row)
        text = "  ".join(
            f"{kind}: cut {row[f'{kind} cut']:.2f} ms x{row['dense'] / row[f'{kind} cut']:.2f}, "
            f"whole {row[f'{kind} whole']:.2f} ms x{row['dense'] / row[f'{kind} whole']:.2f}"
            for kind in KINDS
        )
        print(f"  B={batch:3d} (pieces per row {row['parts']}): dense {row['dense']:.2f} ms  {text}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_shape_options(ap)
    ap.add_argument("--batches", type=int_list, default=[1, 2, 4])
    args = timing_args(ap, argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
