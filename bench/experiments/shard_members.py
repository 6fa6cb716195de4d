"""A vocabulary shard's candidates on CPU: its clusters' real members only, or every padded slot (before).

Under tensor parallelism each rank's head covers ``V / tp`` tokens with the global clusters, so a shard holds
from none to all of a cluster's members, and the cluster map pads each cluster to the largest by repeating
its first member (an empty one by token 0). ``my_pkg.flashhead.kernels.torch_ref`` now scores a small
batch's real members once each (``_candidates_sparse``) and lets the cluster-by-cluster path of batches
from 8 rows serve a shard with empty clusters; before, every padded slot was scored, and any empty cluster
sent every batch row by row. This times ``FlashHead.candidate_logits`` (stage 2, the part that changed) on
rank 0's shard both ways in one process, beside the shard's dense ``F.linear``: in each of ``--rounds``
rounds, dense, then now and before (their order alternating), median of ``--repeats`` calls each, every
call on the next of 16 hidden states (a decode step's candidates are new rows, not the last step's); the
table gives the median over the rounds. Both ways give the same logits, bit for bit (checked on each
shape). Random head, random balanced clusters of 16, the builder's default ``n_probes``. Prints only.

    python -m bench.experiments.shard_members --threads 1                      # 128,256 x 2,048 fp32, TP 2/4/8
    python -m bench.experiments.shard_members --threads 1 --tp 2 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import replace

import torch

from bench._report import add_head_shape_options, int_list, median_ms, timing_args
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.kernels import torch_ref

STATES = 16


def before(head_has_empty_cluster: bool) -> torch_ref.CpuPlan:
    """The stage-2 path before: every padded slot scored; row by row when a cluster is empty."""
    return replace(
        torch_ref.DEFAULT_PLAN,
        skip_padding_share=2.0,  # never
        grouped_min_rows=1 << 62 if head_has_empty_cluster else torch_ref.DEFAULT_PLAN.grouped_min_rows,
    )


def _shard_head(weight: torch.Tensor, centroids: torch.Tensor, assignment: torch.Tensor, tp: int) -> FlashHead:
    end = weight.shape[0] // tp
    return FlashHead(
        weight[:end],
        centroids,
        assignment[:end],
        vocab_size=end,
        n_probes=default_n_probes(centroids.shape[0]),
        allow_empty_clusters=True,
    )


def _rounds(
    head: FlashHead, states: list[torch.Tensor], probes: list[torch.Tensor], has_empty: bool, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Per round: dense, then stage 2 now and before (order alternating), each the median of ``args.repeats``
    calls, each call on the next hidden state."""

    def calls(fn):
        cycle = itertools.cycle(range(len(states)))
        return lambda: fn(next(cycle))

    dense = calls(lambda i: torch.nn.functional.linear(states[i], head.weight))
    stage2 = calls(lambda i: head.candidate_logits(states[i], probes[i]))
    runs: dict[str, list[float]] = {"dense": [], "now": [], "before": []}
    for rnd in range(args.rounds):
        runs["dense"].append(median_ms(dense, args.repeats))
        for way in ("now", "before") if rnd % 2 == 0 else ("before", "now"):
            if way == "now":
                runs[way].append(median_ms(stage2, args.repeats))
            else:
                head.cpu_plan = before(has_empty)
                runs[way].append(median_ms(stage2, args.repeats))
                head.cpu_plan = None
    return runs


def run(args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g)
    assignment = random_balanced_assignment(args.vocab, 16)
    centroids = torch.randn(int(assignment.max()) + 1, args.hidden, generator=g)
    results = []
    for tp in args.tp:
        head = _shard_head(weight, centroids, assignment, tp)
        counts = torch.bincount(assignment[: head.vocab_size], minlength=head.num_clusters)
        empty = int((counts == 0).sum())
        print(
            f"TP={tp}: shard of {head.vocab_size:,} tokens, {float(counts.float().mean()):.1f} members per cluster "
            f"on average, padded to {head.cluster_size}; {empty} of {head.num_clusters:,} clusters empty",
            flush=True,
        )
        for batch in args.batches:
            states = [torch.randn(batch, args.hidden, generator=g) for _ in range(STATES)]
            probes = [head.select_probes(h) for h in states]
            now_logits = head.candidate_logits(states[0], probes[0])[1]
            head.cpu_plan = before(empty > 0)
            assert torch.equal(now_logits, head.candidate_logits(states[0], probes[0])[1])
            head.cpu_plan = None
            runs = _rounds(head, states, probes, empty > 0, args)
            row = {"tp": tp, "batch": batch, "empty": empty}
            row.update({name: statistics.median(times) for name, times in runs.items()})
            row["gain"] = statistics.median(b / n for b, n in zip(runs["before"], runs["now"], strict=True))
            results.append(row)
            print(
                f"  B={batch:3d}: dense shard {row['dense']:.2f} ms; stage 2 now {row['now']:.2f} ms, before "
                f"{row['before']:.2f} ms: x{row['gain']:.2f} (same logits)",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_shape_options(ap)
    ap.add_argument("--tp", type=int_list, default=[2, 4, 8])
    ap.add_argument("--batches", type=int_list, default=[1, 4, 8, 32])
    args = timing_args(ap, argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
