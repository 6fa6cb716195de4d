"""Stage 1's centroids stored row-major or hidden-major: the product alone and the served step, side by side.

On CPU in float32 ``FlashHead`` stores its centroids hidden-major (:mod:`my_pkg.flashhead.layout`). This
measures both layouts in one run, at ``--batches`` rows:

* **stage 1**: ``F.linear(hidden, centroids)`` with the ``[C, H]`` centroids contiguous (row-major) and as the
  transposed view of a contiguous ``[H, C]`` (hidden-major), the same values;
* **step**: ``FlashHead.step_logits`` (greedy and sampled rows, 3 pinned ids) with each layout (the head's
  ``centroids`` swapped between the two tensors), beside the dense head ``F.linear(hidden, W)``.  Sampled rows
  probe the greedy rows' clusters here, as they did when this was measured: by default they now run no
  stage 1, so the layout does not touch them.

Every measurement is the median of ``--repeats`` wall-clock calls; ``--rounds`` paired rounds alternate the
order of the layouts, and the table gives the median over the rounds, the ratio hidden-major / row-major
(below 1: hidden-major is faster) and the steps' speed-ups over the dense head. Random head, random balanced
assignment, the builder's default ``n_probes``. Prints only.

    python -m bench.experiments.centroid_layout                               # 128,256 x 2,048 and 262,144 x 640
    python -m bench.experiments.centroid_layout --shapes 128256x2048 --batches 1,8 --threads 1
    python -m bench.experiments.centroid_layout --dtype bfloat16                 # bfloat16 keeps them row-major
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import numpy as np
import torch

from bench._report import int_list, median_ms, shape_list, timing_args
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment

LAYOUTS = ("row-major", "hidden-major")


def _paired(calls: dict[str, Callable[[], object]], rounds: int, repeats: int) -> dict[str, float]:
    """Median over ``rounds`` of each call's median time; the calls' order alternates between rounds."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            times[name].append(median_ms(calls[name], repeats))
    return {name: statistics.median(values) for name, values in times.items()}


def _ratio_line(label: str, ms: dict[str, float], dense: float | None = None) -> str:
    row, col = ms[f"{label} row-major"], ms[f"{label} hidden-major"]
    if dense is None:
        return f"row-major {row:7.2f} ms  hidden-major {col:7.2f} ms  ratio {col / row:.2f}"
    return (
        f"row-major {row:7.2f} ms (x{dense / row:.2f})  hidden-major {col:7.2f} ms (x{dense / col:.2f})  "
        f"ratio {col / row:.2f}"
    )


def run_shape(vocab: int, hidden_size: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """Prints and returns, per batch, the median ms of every call ("dense", "stage 1 <layout>",
    "<kind> <layout>") and the batch."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weight = torch.randn(vocab, hidden_size, generator=g).to(dtype)
    assignment = random_balanced_assignment(vocab, 16)
    n_probes = default_n_probes(int(assignment.max()) + 1)
    head = FlashHead(
        weight,
        torch.randn(int(assignment.max()) + 1, hidden_size, generator=g),
        assignment,
        n_probes=n_probes,
        sampled_n_probes=n_probes,  # sampled rows with stage 1 (by default they run none: nothing to compare)
    )
    served = "row-major" if head.centroids.is_contiguous() else "hidden-major"
    stored = {"row-major": head.centroids.contiguous(), "hidden-major": head.centroids.t().contiguous().t()}
    pins = torch.arange(vocab - 3, vocab)
    print(
        f"\n{vocab:,} x {hidden_size:,} {args.dtype}: {head.num_clusters:,} centroids, n_probes {head.n_probes}; "
        f"FlashHead stores them {served}"
    )
    results = []
    for batch in args.batches:
        hidden = torch.randn(batch, hidden_size, generator=g).to(dtype)

        def product(layout: str, hidden: torch.Tensor = hidden) -> Callable[[], object]:
            return lambda: torch.nn.functional.linear(hidden, stored[layout])

        def step(kind: str, layout: str, hidden: torch.Tensor = hidden) -> Callable[[], object]:
            sampled = np.full(hidden.shape[0], kind == "sampled")

            def call() -> object:
                head.centroids = stored[layout]
                return head.step_logits(hidden, sampled=sampled, pinned=pins)

            return call

        calls: dict[str, Callable[[], object]] = {"dense": lambda h=hidden: torch.nn.functional.linear(h, weight)}
        calls.update({f"stage 1 {layout}": product(layout) for layout in LAYOUTS})
        calls.update({f"{kind} {layout}": step(kind, layout) for kind in ("greedy", "sampled") for layout in LAYOUTS})
        for warm_up in calls.values():
            warm_up()  # the estimate's tables, once
        ms = _paired(calls, args.rounds, args.repeats)
        head.centroids = stored[served]
        print(f"  B={batch:<3d} stage 1  {_ratio_line('stage 1', ms)}")
        for kind in ("greedy", "sampled"):
            print(
                f"  B={batch:<3d} {kind:8s} {_ratio_line(kind, ms, ms['dense'])}  dense {ms['dense']:.2f} ms",
                flush=True,
            )
        results.append({"batch": batch, **ms})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=shape_list, default=[(128256, 2048), (262144, 640)])
    ap.add_argument("--batches", type=int_list, default=[1, 2, 8, 32])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = timing_args(ap, argv)
    for vocab, hidden_size in args.shapes:
        run_shape(vocab, hidden_size, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
