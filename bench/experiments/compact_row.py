"""A compact sampled row against today's full row with the sampler work it takes, at several head shapes.

Each side is what a sampled decode step costs from the head to the drawn token, on a random head (random balanced
clusters, the sampled rows' default rescored tokens with a fitted estimate, rank ``min(64, H / 8)``), hidden states
``randn / sqrt(H) * --hidden-scale`` (3: peaked rows; 0.5: flat rows, whose nucleus holds most of the vocabulary),
temperature 0.7, top_p 0.9:

* compact: ``CompactHead.plan`` (the placeholder and the plan) and ``compact_law.draw`` reading the exact sets from it;
* full row: ``FlashHead.step_logits`` for sampled rows, the plugin's sort-free top-p (``my_pkg.sampling``) and a
  Gumbel-max over the vocabulary (vLLM's own CPU sampler would sort instead, which costs more).

Prints each side's median of ``--rounds`` calls (after one warm-up call) per shape and batch.

    python -m bench.experiments.compact_row
    python -m bench.experiments.compact_row --shapes 32768x384 --batches 1 --rounds 3
    python -m bench.experiments.compact_row --shapes 262144x640 --hidden-scale 0.5
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch

from bench._report import machine_description, median_ms
from my_pkg.flashhead.compact import CompactHead, CompactRows, compact_clusters
from my_pkg.flashhead.compact_law import RowFilter, draw
from my_pkg.flashhead.gumbel import row_keys
from my_pkg.flashhead.head import FlashHead, PinnedIds
from my_pkg.flashhead.spec import default_sampled_rescore
from my_pkg.sampling.top_p import apply_top_k_top_p
from tests.support.heads import random_head

TEMPERATURE, TOP_P = 0.7, 0.9
Exact = tuple[torch.Tensor, torch.Tensor]  # a resolved cluster's ids and exact logits


def drawn(logits: torch.Tensor, planned: CompactRows, resolve: Callable[[int, torch.Tensor], Exact]) -> torch.Tensor:
    """The tokens of the compact rows ``planned`` at ``TEMPERATURE`` / ``TOP_P``, their exact logits read from
    ``logits`` ``[B, V]`` (the placeholder, or the ranks' gathered shards of it), seeded by their row index."""
    rows, vocab = logits.shape
    offsets = torch.arange(rows).view(-1, 1) * vocab
    exact = (logits.float() / TEMPERATURE).reshape(-1).take(offsets + planned.exact_ids)
    exact.masked_fill_(~planned.exact_valid, -math.inf)
    filters = [RowFilter(top_p=TOP_P)] * rows
    return draw(planned.exact_ids, exact, planned.atoms, filters, row_keys(torch.arange(rows)), resolve, vocab).tokens


def sides(head: FlashHead, hidden: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(compact, full row)``: one sampled step of ``hidden``'s rows each way, to the drawn tokens."""
    rows = hidden.shape[0]
    planner = CompactHead(head)
    pins = PinnedIds(torch.tensor([1, 2]), head.weight[[1, 2]])
    temperature = torch.full((rows,), TEMPERATURE)

    def compact() -> torch.Tensor:
        placeholder, planned = planner.plan(
            hidden, temperature, pinned=pins, postprocess=lambda x: x, clusters=compact_clusters(head)
        )
        return drawn(placeholder, planned, lambda row, clusters: planner.resolve(planned, row, clusters))

    def full_row() -> torch.Tensor:
        logits = head.step_logits(hidden, sampled=torch.ones(rows, dtype=torch.bool).numpy(), pinned=pins)
        masked, _ = apply_top_k_top_p(
            logits.float() / TEMPERATURE, None, torch.full((rows,), TOP_P), sort_fallback=None
        )
        return (masked - torch.empty_like(masked).exponential_().log()).argmax(1)

    return compact, full_row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32768x384,128256x2048,262144x640", help="VxH,...")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--hidden-scale", type=float, default=3.0, help="hidden states randn / sqrt(H) * this")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_description())
    print("| V × H | batch | compact ms | full row + sort-free top-p + Gumbel ms | full / compact |")
    print("|---|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        vocab, hidden_size = (int(x) for x in shape.split("x"))
        head, generator = random_head(
            vocab, hidden_size, n_probes=max(1, vocab // 512), sampled_rank=min(64, hidden_size // 8)
        )
        head.sampled_rescore = default_sampled_rescore(vocab, fitted=True)
        for batch in (int(b) for b in args.batches.split(",")):
            hidden = torch.randn(batch, hidden_size, generator=generator) / math.sqrt(hidden_size) * args.hidden_scale
            compact, full_row = sides(head, hidden)
            compact(), full_row()  # warm-up
            ours, theirs = median_ms(compact, args.rounds), median_ms(full_row, args.rounds)
            print(
                f"| {vocab:,} × {hidden_size:,} | {batch} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
