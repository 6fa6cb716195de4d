"""A decode step as a tensor-parallel server serves it, start-up timing included: TP=2 on CPU.

Two spawned ranks over vLLM's TP group (gloo, and vLLM's CPU shared-memory all-gather, as vLLM serves on
CPU), one thread each. Each rank holds vLLM's ``ParallelLMHead`` over its half of a random head (loaded by
its weight loader and set up as vLLM's loader does) and our ``LogitsProcessor`` subclass with a FlashHead
controller (random balanced clusters, the builder's default probes, a fitted sampled-row estimate). Each
rank builds its head and times it alone (``build_head``, as right after the weights load); then every step
runs through the processor as the model runner calls it, armed with the step's rows: the stage-1 exchange,
the rank's shard (each rank the way it finds cheaper), vLLM's logits gather. Against vLLM's own
``LogitsProcessor.forward`` (its product for the head and the same gather), in paired rounds, for greedy,
sampled and mixed (every other row sampled) steps. A ratio below 1.0 is a step served slower than dense.

``--untimed`` sets ``MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD=never``: every step by FlashHead, as a
tensor-parallel server served before its ranks were timed.

    python -m bench.tp_served_step --dtype bfloat16 --rounds 3
    python -m bench.tp_served_step --dtype bfloat16 --rounds 3 --untimed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from bench._report import (
    EXPERIMENTS_MD,
    add_head_shape_options,
    command_line,
    fitted_tail_factors,
    free_port,
    int_list,
    machine_description,
    paired_rounds,
    write_section,
)
from bench.head import sampled_mask
from bench.served_step import KINDS, _plan_taken
from my_pkg.engine import setup as engine_setup

BATCHES = [1, 2, 4, 8, 16, 32, 64]
WORLD = 2


def _served_as(controller: Any, before: tuple[int, int, int], batch: int) -> str:
    """How this rank served the step it just served (`served_step._plan_taken`), with `+x` when the step exchanged
    its best clusters; `before`: the counters' FlashHead rows, masked rows and exchanges before it."""
    exchanged = controller.counters.stage1_exchanges > before[2]
    return _plan_taken(controller, before[:2], batch) + ("+x" if exchanged else "")


def _rank(
    work: Callable[[int, int, argparse.Namespace], Any], rank: int, port: int, args: argparse.Namespace, queue: Any
) -> None:
    try:
        queue.put((rank, work(rank, port, args)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        queue.put((rank, exc))
        raise


def spawn_ranks(work: Callable[[int, int, argparse.Namespace], Any], args: argparse.Namespace) -> dict[int, Any]:
    """``work(rank, port, args)`` on each of ``WORLD`` spawned ranks (a module-level function: spawned processes
    import it), which join vLLM's TP group at ``port``; rank -> what it returned (a rank that raised ends the run)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(work, rank, port, args, queue)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
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
    return results


def rank_head(
    weight: torch.Tensor,
    assignments: torch.Tensor,
    centroids: torch.Tensor,
    tail_factors: Any,
    pinned_ids: Sequence[int],
) -> tuple[Any, Any]:
    """`(lm_head, processor)` on this rank of vLLM's TP group: vLLM's `ParallelLMHead` over its shard of `weight`
    (loaded by its weight loader and set up as vLLM's loader does) and our `LogitsProcessor` subclass with a FlashHead
    controller (the builder's default probes; its head not yet built)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from my_pkg.engine.flashhead import FlashHeadController
    from my_pkg.engine.patches import logits_processor
    from my_pkg.flashhead.spec import default_n_probes

    vocab, hidden = weight.shape
    clusters = int(centroids.shape[0])
    lm_head = ParallelLMHead(vocab, hidden, params_dtype=weight.dtype)
    lm_head.weight_loader(lm_head.weight, weight)
    lm_head.quant_method.process_weights_after_loading(lm_head)  # vLLM's CPU GEMM set-up
    processor = logits_processor.subclass()(vocab)
    processor._my_pkg_flashhead = FlashHeadController(
        centroids=centroids,
        assignments=assignments,
        config={"n_probes": default_n_probes(clusters)},
        vocab_size=vocab,
        pinned_ids=pinned_ids,
        tail_factors=tail_factors,
    )
    return lm_head, processor


def _serve(rank: int, port: int, args: argparse.Namespace) -> dict:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from my_pkg.engine.flashhead import StepRows
    from my_pkg.flashhead.clustering import random_balanced_assignment

    torch.set_num_threads(1)
    os.environ["VLLM_DIST_IDENT"] = f"bench-tp-served-step-{port}"  # as vLLM's CPU worker sets it
    os.environ.pop("MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD", None)
    if args.untimed:
        os.environ["MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD"] = "never"
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)  # the same head on both ranks
    weight = torch.randn(args.vocab, args.hidden, generator=generator).to(dtype)
    assignments = random_balanced_assignment(args.vocab, 16)
    clusters = int(assignments.max()) + 1
    centroids = torch.randn(clusters, args.hidden, generator=generator)
    tail_factors = fitted_tail_factors(weight, args.vocab)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(WORLD, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=WORLD)
        try:
            pinned = range(args.vocab - 3, args.vocab)
            lm_head, processor = rank_head(weight, assignments, centroids, tail_factors, pinned)
            controller = processor._my_pkg_flashhead
            del weight
            started = time.perf_counter()
            engine_setup.build_head(controller, lm_head)
            report = controller.status().step_costs
            out: dict = {"build_s": time.perf_counter() - started, "costs": report, "rows": []}
            hidden_rows = torch.Generator().manual_seed(1)
            with torch.inference_mode():
                for batch in args.batches:
                    hidden = torch.randn(batch, args.hidden, generator=hidden_rows).to(dtype)
                    line: dict = {"batch": batch, "kinds": {}}
                    for kind in KINDS:
                        if kind == "mixed" and batch == 1:
                            continue
                        step = StepRows(np.zeros(batch, np.uint8), sampled_mask(kind, batch))

                        def served(step=step, hidden=hidden):
                            controller.arm(lambda: step)
                            return processor(lm_head, hidden)

                        def dense(hidden=hidden):
                            return LogitsProcessor.forward(processor, lm_head, hidden)

                        counters = controller.counters
                        before = (
                            counters.rows_flashhead,
                            counters.rows_flashhead_masked,
                            counters.stage1_exchanges,
                        )
                        served()
                        served_as = _served_as(controller, before, batch)
                        dense()
                        timed = paired_rounds(dense, served, args.rounds, args.repeats)
                        line["kinds"][kind] = {"served_as": served_as, **timed}
                    out["rows"].append(line)
                    if rank == 0:
                        text = "  ".join(
                            f"{k} {v['served_as']:<15} {v['ms']:7.2f} ms x{v['ratio']:.2f}"
                            for k, v in line["kinds"].items()
                        )
                        print(f"  B={batch:4d}: {text}", flush=True)
            out["exchanges"] = controller.counters.stage1_exchanges
            return out
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _cell(kinds: list[dict]) -> str:
    ranks = [k["served_as"] for k in kinds]
    label = ranks[0] if len(set(ranks)) == 1 else " / ".join(ranks)
    v = kinds[0]
    return f"{label}: x{v['ratio']:.2f} ({v['min']:.2f}..{v['max']:.2f})"


def _rounded(times: list[float | None] | None) -> list[float | None] | None:
    return [None if ms is None else round(ms, 2) for ms in times] if times is not None else None


def to_markdown(results: dict[int, dict], args: argparse.Namespace, machine: str) -> str:
    first = results[0]
    out = [
        f"### A tensor-parallel decode step as served, TP=2{' untimed' if args.untimed else ''} (cpu, {args.dtype})",
        "",
        f"Machine: {machine}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"V = {args.vocab:,}, H = {args.hidden:,}, random head, random balanced clusters of 16, the builder's default "
        "probes, a fitted sampled-row estimate, 3 pinned ids. Two ranks (processes, one thread each) over vLLM's "
        "TP group (its CPU shared-memory all-gather), each with vLLM's `ParallelLMHead` over its half of the "
        "vocabulary and our logits processor; "
        + (
            "`MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD=never`: every step by FlashHead (before the ranks were timed). "
            if args.untimed
            else "each rank built and timed its head alone at start-up. "
        )
        + "Served = the processor's `forward` armed with the step's rows (the stage-1 exchange unless skipped, the "
        "rank's shard, vLLM's logits gather), against vLLM's own `LogitsProcessor.forward` (its product and the "
        f"same gather), {args.rounds} paired rounds of {args.repeats} calls (median) on rank 0's wall clock. "
        "Ratio = dense / served, median of the rounds (lowest..highest). Each cell says how each rank served the "
        "step (`rank 0 / rank 1` where they differ): `flashhead` FlashHead's kernels, `masked` the dense product "
        "masked to FlashHead's answer (the same logits); `+x`: the step exchanged its best clusters.",
        "",
    ]
    for rank in range(WORLD):
        costs = results[rank]["costs"]
        if costs is None:
            out.append(f"Rank {rank}: not timed; built in {results[rank]['build_s']:.1f} s.")
        else:
            out.append(
                f"Rank {rank}, built and timed in {results[rank]['build_s']:.1f} s, at {costs.batches} rows (ms): "
                f"dense {_rounded(costs.dense_ms)}, greedy {_rounded(costs.greedy_ms)}, sampled "
                f"{_rounded(costs.sampled_ms)}, mixed {_rounded(costs.mixed_ms)}, masked greedy "
                f"{_rounded(costs.masked_greedy_ms)}, masked sampled {_rounded(costs.masked_sampled_ms)}."
            )
        out.append("")
    out.append(
        f"Steps that exchanged: {first['exchanges']} on rank 0, {results[1]['exchanges']} on rank 1 (warm-up calls "
        "included)."
    )
    out += ["", "| batch | dense ms | " + " | ".join(KINDS) + " |", "|---:|---:|" + "---|" * len(KINDS)]
    for index, line in enumerate(first["rows"]):
        other = results[1]["rows"][index]["kinds"]
        cells = ["—" if kind not in line["kinds"] else _cell([line["kinds"][kind], other[kind]]) for kind in KINDS]
        out.append(f"| {line['batch']} | {line['kinds']['greedy']['dense_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_head_shape_options(ap)
    ap.add_argument("--batches", type=int_list, default=BATCHES)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="calls per measurement (median)")
    ap.add_argument("--untimed", action="store_true", help="every step by FlashHead (no start-up timing)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be >= 1")
    if args.vocab % WORLD:
        ap.error(f"--vocab must be a multiple of {WORLD}")
    return args


def run(args: argparse.Namespace) -> dict[int, dict]:
    """Both ranks' results (rank -> its timing, and how it served each step), from two spawned ranks."""
    return spawn_ranks(_serve, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_description()
    print(machine)
    print(f"Command: `{command_line()}`", flush=True)
    markdown = to_markdown(run(args), args, machine)
    print(markdown)
    if not args.no_write:
        name = "tp-served-step" + ("" if args.dtype == "float32" else f"-{args.dtype}")
        name += "-untimed" if args.untimed else ""
        print(f"wrote {write_section(name, markdown, EXPERIMENTS_MD if args.untimed else None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
