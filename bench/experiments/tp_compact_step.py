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
on rank 0's wall clock.

    python -m bench.experiments.tp_compact_step
    python -m bench.experiments.tp_compact_step --vocab 128256 --hidden 2048 --batches 1,8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from bench._report import fitted_tail_factors, free_port, int_list, machine_description, paired_rounds
from my_pkg.engine import setup as engine_setup

WORLD = 2
TEMPERATURE, TOP_P = 0.7, 0.9


def _rank(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    try:
        queue.put((rank, _measure(rank, port, args)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        queue.put((rank, exc))
        raise


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
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from my_pkg.engine.flashhead import FlashHeadController, StepRows
    from my_pkg.engine.patches import logits_processor
    from my_pkg.flashhead.clustering import random_balanced_assignment
    from my_pkg.flashhead.compact import CompactHead, compact_clusters
    from my_pkg.flashhead.compact_law import RowFilter, draw
    from my_pkg.flashhead.gumbel import row_keys
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
            lm_head = ParallelLMHead(args.vocab, args.hidden)
            lm_head.weight_loader(lm_head.weight, weight)
            lm_head.quant_method.process_weights_after_loading(lm_head)
            processor = logits_processor.subclass()(args.vocab)
            controller = FlashHeadController(
                centroids=centroids,
                assignments=assignments,
                config={"n_probes": default_n_probes(clusters)},
                vocab_size=args.vocab,
                pinned_ids=pinned,
                tail_factors=tail_factors,
            )
            processor._my_pkg_flashhead = controller
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
                offsets = torch.arange(rows).view(-1, 1) * args.vocab
                exact = (logits.float() / TEMPERATURE).reshape(-1).take(offsets + planned.exact_ids)
                exact.masked_fill_(~planned.exact_valid, -math.inf)

                def resolve(row: int, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                    ids, values = planner.resolve(planned, row, chosen)
                    finite = torch.isfinite(values)
                    own = finite & (ids >= start) & (ids < end)
                    summed = tensor_model_parallel_all_reduce(torch.where(own, values, 0.0))
                    return ids, summed.masked_fill_(~finite, -math.inf)

                return draw(
                    planned.exact_ids,
                    exact,
                    planned.atoms,
                    [RowFilter(top_p=TOP_P)] * rows,
                    row_keys(torch.arange(rows)),
                    resolve,
                    args.vocab,
                ).tokens

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
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(rank, port, args, queue)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    results: dict[int, list[dict]] = {}
    try:
        for _ in procs:
            rank, value = queue.get(timeout=3600)
            if isinstance(value, BaseException):
                raise SystemExit(f"rank {rank} failed: {value!r}")
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
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
