"""A sampled tensor-parallel step, today's against a compact row every rank plans whole: TP=2 on CPU, collectives in.

Two spawned ranks over vLLM's TP group (gloo, and vLLM's CPU shared-memory collectives, as vLLM serves on CPU), one
thread each, the same random head on both (random balanced clusters, the builder's default probes, a fitted
sampled-row estimate, 3 pinned ids), sampled rows at temperature 0.7, top_p 0.9. Each side runs from the hidden
states to the drawn tokens:

* **today**: our ``LogitsProcessor`` subclass over vLLM's ``ParallelLMHead`` (half the vocabulary each), armed with
  the step's sampled rows, each rank's head built and timed at start-up as served (`bench.tp_served_step`): the
  stage-1 exchange, the rank's shard, vLLM's gather; then the plugin's sort-free top-p and a Gumbel-max over the row.
* **compact, planned whole** (a prototype, not the plugin's code path): every rank plans the rows over the whole
  vocabulary (`CompactHead.plan` over a head of every token, as if each rank held the estimate's table of every
  token), keeps its own half of the placeholder, joins the halves with vLLM's gather, checks in one more all-gather
  that both ranks planned alike (a per-row checksum of the plan), says it is ready in one all-reduce, and draws
  (`compact_law.draw`); a resolved cluster is scored and then summed over the ranks in one all-reduce, as a rank
  would send its members' logits and zeros for the rest.

The prototype scores every exact token on each rank (a rank would score only its half) and resolves every member
of a cluster on each rank: it overstates the compact side's work, never the other's. Both ranks draw the same
tokens (checked). Ratio = today / compact, median over ``--rounds`` paired rounds of ``--repeats`` calls (median)
on rank 0's wall clock; hidden states ``randn / sqrt(H) * --hidden-scale``. A ratio above 1 here did not carry over
to a server, whose rows were cheaper for today's top-p (docs/research/experiments.md, ``tp_compact_step``).

    python -m bench.experiments.tp_compact_step
    python -m bench.experiments.tp_compact_step --vocab 128256 --hidden 2048 --batches 1,8
    python -m bench.experiments.tp_compact_step --hidden-scale 1     # flat rows
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch

from bench._report import fitted_tail_factors, int_list, machine_description, paired_rounds
from bench.experiments.compact_row import TEMPERATURE, TOP_P, drawn
from bench.tp_served_step import WORLD, rank_head, spawn_ranks
from my_pkg.engine import setup as engine_setup


def _measure(rank: int, port: int, args: argparse.Namespace) -> list[dict]:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    from my_pkg.engine.flashhead import StepRows
    from my_pkg.flashhead.clustering import random_balanced_assignment
    from my_pkg.flashhead.compact import CompactHead, compact_clusters
    from my_pkg.flashhead.head import FlashHead, PinnedIds
    from my_pkg.flashhead.spec import default_n_probes, default_sampled_rescore
    from my_pkg.sampling.top_p import apply_top_k_top_p

    torch.set_num_threads(1)
    os.environ["VLLM_DIST_IDENT"] = f"bench-tp-compact-step-{port}"
    os.environ.pop("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", None)
    generator = torch.Generator().manual_seed(0)  # the same head on both ranks
    weight = torch.randn(args.vocab, args.hidden, generator=generator)
    assignments = random_balanced_assignment(args.vocab, 16)
    clusters = int(assignments.max()) + 1
    centroids = torch.randn(clusters, args.hidden, generator=generator)
    tail_factors = fitted_tail_factors(weight, args.vocab)
    pinned = list(range(args.vocab - 3, args.vocab))
    shard = args.vocab // WORLD
    start, end = rank * shard, (rank + 1) * shard

    whole = FlashHead(
        weight,
        centroids,
        assignments,
        vocab_size=args.vocab,
        n_probes=default_n_probes(clusters),
        tail_factors=tail_factors,
    )
    whole.sampled_rescore = default_sampled_rescore(args.vocab, fitted=True)
    planner = CompactHead(whole)
    pins = PinnedIds(torch.tensor(pinned), weight[pinned])

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(WORLD, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=WORLD)
        try:
            lm_head, processor = rank_head(weight, assignments, centroids, tail_factors, pinned)
            controller = processor._my_pkg_flashhead
            engine_setup.build_head(controller, lm_head)

            def sampler(logits: torch.Tensor) -> torch.Tensor:
                rows = logits.shape[0]
                masked, _ = apply_top_k_top_p(logits.float().div_(TEMPERATURE), None, torch.full((rows,), TOP_P))
                return (masked - torch.empty_like(masked).exponential_().log()).argmax(1)

            def today(hidden: torch.Tensor) -> torch.Tensor:
                step = StepRows(np.zeros(hidden.shape[0], np.uint8), np.ones(hidden.shape[0], dtype=bool))
                controller.arm(lambda: step)
                return sampler(processor(lm_head, hidden))

            def compact(hidden: torch.Tensor) -> torch.Tensor:
                rows = hidden.shape[0]
                placeholder, planned = planner.plan(
                    hidden,
                    torch.full((rows,), TEMPERATURE),
                    pinned=pins,
                    postprocess=lambda x: x,
                    clusters=compact_clusters(whole),
                )
                logits = tensor_model_parallel_all_gather(placeholder[:, start:end].contiguous(), dim=-1)
                checksum = torch.stack(
                    [planned.exact_ids.sum(1).float(), planned.atom_log_mass.nan_to_num(neginf=0.0).sum(1)], 1
                )
                every = tensor_model_parallel_all_gather(checksum, dim=-1).view(rows, WORLD, 2)
                if not bool((every == every[:, :1]).all()):
                    raise RuntimeError("the ranks planned different rows")
                if float(tensor_model_parallel_all_reduce(torch.ones(1))) != WORLD:
                    raise RuntimeError("a rank is not ready")

                def resolve(row: int, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                    ids, values = planner.resolve(planned, row, chosen)
                    finite = torch.isfinite(values)
                    own = finite & (ids >= start) & (ids < end)
                    summed = tensor_model_parallel_all_reduce(torch.where(own, values, 0.0))
                    return ids, summed.masked_fill_(~finite, -math.inf)

                return drawn(logits, planned, resolve)

            out = []
            hidden_rows = torch.Generator().manual_seed(1)
            with torch.inference_mode():
                for batch in args.batches:
                    hidden = torch.randn(batch, args.hidden, generator=hidden_rows) / math.sqrt(args.hidden)
                    hidden *= args.hidden_scale
                    tokens = compact(hidden)
                    today(hidden)
                    both = tensor_model_parallel_all_gather(tokens.view(1, -1).float(), dim=0)
                    timed = paired_rounds(
                        lambda h=hidden: today(h), lambda h=hidden: compact(h), args.rounds, args.repeats
                    )
                    out.append({"batch": batch, "same_tokens": bool((both[0] == both[1]).all()), **timed})
                    if rank == 0:
                        print(
                            f"  B={batch}: today {timed['dense_ms']:.2f} ms, compact {timed['ms']:.2f} ms, "
                            f"x{timed['ratio']:.2f} ({timed['min']:.2f}..{timed['max']:.2f})",
                            flush=True,
                        )
            return out
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32])
    ap.add_argument("--hidden-scale", type=float, default=3.0, help="hidden states randn / sqrt(H) * this")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="calls per measurement (median)")
    args = ap.parse_args(argv)
    if args.vocab % WORLD:
        ap.error(f"--vocab must be a multiple of {WORLD}")
    print(machine_description(), flush=True)
    results = spawn_ranks(_measure, args)
    print("| batch | today ms | compact planned whole ms | today / compact (spread) | same tokens on both ranks |")
    print("|---:|---:|---:|---:|:---|")
    for line in results[0]:
        print(
            f"| {line['batch']} | {line['dense_ms']:.2f} | {line['ms']:.2f} | {line['ratio']:.2f}x "
            f"({line['min']:.2f}..{line['max']:.2f}) | {line['same_tokens']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
