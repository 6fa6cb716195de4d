"""Candidates read from a copy of the head's rows in cluster order, or from the head itself (before).

A cluster's members are scattered over the LM head, so stage 2 on CPU read ``P * cap`` rows from as many
places; a CPU head now keeps its token rows sorted by cluster (``my_pkg.flashhead.cluster_rows``,
``MY_PKG_FLASHHEAD_CLUSTER_ROWS``) and reads each probed cluster in one run, with the same logits bit for bit.
This times, in one process, two heads over the same weight and clusters, with and without the copy:
stage 2 alone (``FlashHead.candidate_logits`` on given probes) and the step serving calls
(``FlashHead.step_logits``, greedy and sampled rows, 3 pinned ids, the fitted estimate of a default
build), beside dense ``F.linear``. In each of ``--rounds`` rounds: dense, then for each measure both
heads (their order alternating), each the median of ``--repeats`` calls, every call on the next of 16
hidden states (a decode step's rows are new ones); the table gives the medians over the rounds and the
median of the rounds' ratios. The two heads' logits are checked equal on every shape and batch. Random
head, random balanced clusters of 16, the builder's default ``n_probes``. Prints only.

    python -m bench.experiments.cluster_rows --threads 1                      # 262,144 x 640 and 128,256 x 2,048, fp32
    python -m bench.experiments.cluster_rows --threads 1 --shapes 128256x2048 --batches 1
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import numpy as np
import torch

from bench._report import fitted_tail_factors, int_list, median_ms, shape_list, timing_args
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment

STATES = 16
PINNED = 3
WAYS = ("copy", "head")  # candidates read from the copy in cluster order / from the head itself (before)


def _heads(vocab: int, hidden: int, dtype: torch.dtype) -> dict[str, FlashHead]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    assignment = random_balanced_assignment(vocab, 16)
    clusters = int(assignment.max()) + 1
    centroids = torch.randn(clusters, hidden, generator=g)
    factors = fitted_tail_factors(weight, vocab)
    return {
        way: FlashHead(
            weight,
            centroids,
            assignment,
            n_probes=default_n_probes(clusters),
            tail_factors=factors,
            cluster_rows=way == "copy",
        )
        for way in WAYS
    }


def _measures(head: FlashHead, states: list[torch.Tensor], pins: torch.Tensor) -> dict:
    probes = [head.select_probes(h) for h in states]
    greedy = np.zeros(states[0].shape[0], bool)
    return {
        "stage 2": lambda i: head.candidate_logits(states[i], probes[i])[1],
        "greedy step": lambda i: head.step_logits(states[i], sampled=greedy, pinned=pins),
        "sampled step": lambda i: head.step_logits(states[i], sampled=~greedy, pinned=pins),
    }


def _cycled(fn):
    index = itertools.cycle(range(STATES))
    return lambda: fn(next(index))


def run(args: argparse.Namespace) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    results = []
    for vocab, hidden in args.shapes:
        heads = _heads(vocab, hidden, dtype)
        copy = heads["copy"].cluster_rows
        assert copy is not None and heads["head"].cluster_rows is None
        print(
            f"{vocab:,} x {hidden:,} {args.dtype}: {heads['copy'].num_clusters:,} clusters, "
            f"{heads['copy'].n_probes} probes; the copy: {copy.nbytes / 2**20:.0f} MiB",
            flush=True,
        )
        pins = torch.arange(vocab - PINNED, vocab)
        g = torch.Generator().manual_seed(1)
        for batch in args.batches:
            states = [torch.randn(batch, hidden, generator=g).to(dtype) for _ in range(STATES)]
            calls = {way: _measures(head, states, pins) for way, head in heads.items()}
            for name in calls["copy"]:  # the same logits both ways (the sampled step builds its tables here)
                assert torch.equal(calls["copy"][name](0), calls["head"][name](0))
            weight = heads["head"].weight
            dense = _cycled(lambda i, states=states, weight=weight: torch.nn.functional.linear(states[i], weight))
            runs: dict[str, list[float]] = {"dense": []}
            for rnd in range(args.rounds):
                runs["dense"].append(median_ms(dense, args.repeats))
                for name in calls["copy"]:
                    for way in WAYS if rnd % 2 == 0 else WAYS[::-1]:
                        runs.setdefault(f"{name}, {way}", []).append(median_ms(_cycled(calls[way][name]), args.repeats))
            row = {"shape": f"{vocab}x{hidden}", "batch": batch}
            row.update({key: statistics.median(times) for key, times in runs.items()})
            print(f"  B={batch:3d}: dense {row['dense']:.2f} ms", flush=True)
            for name in calls["copy"]:
                ours, before = runs[f"{name}, copy"], runs[f"{name}, head"]
                row[f"{name} gain"] = statistics.median(b / o for b, o in zip(before, ours, strict=True))
                print(
                    f"    {name:12s}: copy {row[f'{name}, copy']:.2f} ms, head {row[f'{name}, head']:.2f} ms: "
                    f"x{row[f'{name} gain']:.2f}; vs dense {row['dense'] / row[f'{name}, copy']:.2f}x "
                    f"(before {row['dense'] / row[f'{name}, head']:.2f}x)",
                    flush=True,
                )
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=shape_list, default=[(262144, 640), (128256, 2048)])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32])
    args = timing_args(ap, argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
