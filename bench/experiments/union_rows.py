"""A half-precision batch scored over the union of its rows' ids, or row by row.

torch's CPU ``sampled_addmm`` has no bfloat16 kernel, so a bf16 head's exact logits (greedy rows'
candidates, sampled rows' best-estimated tokens) are gathered and multiplied by ``mm``.  Row by row, a batch
of ``B`` rows gathers each row's ids and runs ``B`` products by one column; over the union
(:func:`~my_pkg.flashhead.kernels.torch_ref._logits_union`) each head row some row needs is gathered once
and one product takes every column, the same logits bit for bit where the CPU's ``mm`` allows
(``_mm_columns_exact``, checked here on every step).  This measures ``FlashHead.step_logits`` (greedy and
sampled rows, 3 pinned ids) both ways in one process beside the dense product (vLLM's CPU GEMM when vLLM
is installed, else ``F.linear``): in each of ``--rounds`` rounds dense, then union and rows (their order
alternating), median of ``--repeats`` calls each; the table gives the median over the rounds.

How much the rows share decides the gain: ``--shared S`` draws each hidden row as ``sqrt(S)`` of one
common direction plus ``sqrt(1 - S)`` of its own (0: independent rows, which on a random head share almost
no candidates: the worst case).  Each line prints the union's share of the ``B x N`` ids it gathered.
``--fixture`` prints that share on the committed trained fixture's held-out states instead (a real LM's
head: how much decode rows of real text share), for comparison.  Prints only.

    python -m bench.experiments.union_rows --batches 2,4,8,16,32 --shared 0,0.5
    python -m bench.experiments.union_rows --fixture
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from functools import partial

import numpy as np
import torch

from bench._report import add_head_shape_options, dense_head, fitted_tail_factors, int_list, median_ms, timing_args
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.kernels import torch_ref
from my_pkg.flashhead.tail_estimate import top_k_ids

KINDS = ("greedy", "sampled")
WAYS = ("union", "rows")


def _float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def union_share(head: FlashHead, hidden: torch.Tensor, kind: str) -> float:
    """Distinct ids over all ids that ``kind`` rows of ``hidden`` score exactly (1.0: nothing shared)."""
    if kind == "greedy":
        ids = torch_ref.candidate_ids(head.members, head.select_probes(hidden))
    else:
        raw = head._tail_tables().estimates(hidden.to(head.weight.dtype))
        ids = top_k_ids(raw, head.sampled_rescore)
    return ids.unique().numel() / ids.numel()


def _hidden(batch: int, hidden_size: int, shared: float, generator: torch.Generator) -> torch.Tensor:
    common = torch.randn(1, hidden_size, generator=generator)
    own = torch.randn(batch, hidden_size, generator=generator)
    return math.sqrt(shared) * common + math.sqrt(1.0 - shared) * own


def _head(vocab: int, hidden_size: int, dtype: torch.dtype) -> FlashHead:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden_size, generator=g).to(dtype)
    assignment = random_balanced_assignment(vocab, 16)
    clusters = int(assignment.max()) + 1
    # Mean centroids, so that rows that point the same way probe the same clusters.
    sums = torch.zeros(clusters, hidden_size).index_add_(0, assignment, weight.float())
    centroids = sums / torch.bincount(assignment, minlength=clusters).clamp_min(1).unsqueeze(1)
    head = FlashHead(
        weight,
        centroids,
        assignment,
        n_probes=default_n_probes(clusters),
        tail_factors=fitted_tail_factors(weight, vocab),
    )
    head.step_logits(torch.zeros(1, hidden_size, dtype=dtype), sampled=np.ones(1, bool))  # the tables, once
    return head


def run(args: argparse.Namespace) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    head = _head(args.vocab, args.hidden, dtype)
    dense, dense_name = dense_head(head.weight[: head.vocab_size])
    print(
        f"  dense: {dense_name}; the product by several columns exact here: "
        f"{torch_ref._mm_columns_exact(dtype, args.hidden)}",
        flush=True,
    )
    pins = torch.arange(args.vocab - 3, args.vocab)
    generator = torch.Generator().manual_seed(1)
    plans = {"union": torch_ref.DEFAULT_PLAN, "rows": torch_ref.CpuPlan(union_min_rows=1 << 30)}
    results = []
    for shared in args.shared:
        for batch in args.batches:
            hidden = _hidden(batch, args.hidden, shared, generator).to(dtype)
            row: dict = {"shared": shared, "batch": batch}
            runs: dict[str, list[float]] = {"dense": []}
            for kind in KINDS:
                row[f"{kind} share"] = union_share(head, hidden, kind)
                sampled = np.full(batch, kind == "sampled")
                head.cpu_plan = plans["union"]
                union = head.step_logits(hidden, sampled=sampled, pinned=pins)
                head.cpu_plan = plans["rows"]
                rows = head.step_logits(hidden, sampled=sampled, pinned=pins)
                row[f"{kind} equal"] = bool(torch.equal(union, rows))
            for rnd in range(args.rounds):
                runs["dense"].append(median_ms(partial(dense, hidden), args.repeats))
                for way in WAYS if rnd % 2 == 0 else WAYS[::-1]:
                    head.cpu_plan = plans[way]
                    for kind in KINDS:
                        sampled = np.full(batch, kind == "sampled")
                        runs.setdefault(f"{kind} {way}", []).append(
                            median_ms(partial(head.step_logits, hidden, sampled=sampled, pinned=pins), args.repeats)
                        )
            row.update({name: statistics.median(times) for name, times in runs.items()})
            results.append(row)
            text = "  ".join(
                f"{kind} (share {row[f'{kind} share']:.2f}, equal {row[f'{kind} equal']}): "
                f"union {row[f'{kind} union']:.2f} ms x{row['dense'] / row[f'{kind} union']:.2f}, "
                f"rows {row[f'{kind} rows']:.2f} ms x{row['dense'] / row[f'{kind} rows']:.2f}"
                for kind in KINDS
            )
            print(f"  shared {shared:.2f} B={batch:3d}: dense {row['dense']:.2f} ms  {text}", flush=True)
    return results


def fixture_shares(batches: list[int], draws: int = 20) -> dict[int, dict[str, float]]:
    """The union's share on the committed trained fixture (8,192 x 256, its default build: balanced k-means
    clusters of 16, the default probes, the estimate fitted to its calibration states): ``draws`` batches of
    held-out decode states per size, mean share for greedy and for sampled rows."""
    from my_pkg.flashhead.clustering import balanced_kmeans
    from my_pkg.flashhead.tail_estimate import default_tail_rank, fit_tail_factors
    from tests.support.trained_fixture import load_trained_fixture

    fixture = load_trained_fixture()
    vocab = fixture.weight.shape[0]
    clusters = balanced_kmeans(fixture.weight, 16, progress=False)
    factors = fit_tail_factors(fixture.weight, vocab, default_tail_rank(fixture.weight.shape[1]), fixture.calibration)
    head = FlashHead(
        fixture.weight,
        clusters.centroids,
        clusters.assignments,
        n_probes=default_n_probes(int(clusters.centroids.shape[0])),
        tail_factors=factors,
    )
    generator = torch.Generator().manual_seed(0)
    shares = {}
    for batch in batches:
        picks = [torch.randperm(fixture.heldout.shape[0], generator=generator)[:batch] for _ in range(draws)]
        shares[batch] = {
            kind: statistics.mean(union_share(head, fixture.heldout[index], kind) for index in picks) for kind in KINDS
        }
        print(
            f"  trained fixture, held-out states, B={batch:3d}: union share greedy {shares[batch]['greedy']:.2f}, "
            f"sampled {shares[batch]['sampled']:.2f} (mean of {draws} batches)",
            flush=True,
        )
    return shares


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_shape_options(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--batches", type=int_list, default=[2, 4, 8, 16, 32])
    ap.add_argument("--shared", type=_float_list, default=[0.0, 0.5])
    ap.add_argument("--fixture", action="store_true", help="the trained fixture's union share, then exit")
    args = timing_args(ap, argv)
    if args.fixture:
        fixture_shares(args.batches)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
