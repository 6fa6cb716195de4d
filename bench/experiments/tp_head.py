"""FlashHead's head speed-up under tensor parallelism: TP=2 against TP=1 on the same shape, on CPU.

Two processes joined by a gloo process group, each with one thread (two cores), and by default vLLM's
TP group over it (its CPU shared-memory all-gather, the one vLLM serves with on CPU; ``--gather gloo``:
``torch.distributed.all_gather``). Each TP=2 rank holds one half of the vocabulary (its head rows) and
one half of the centroids, as serving lays them out:

* dense: ``F.linear`` over the rank's shard, then the all-gather of the ``[B, V]`` logits;
* FlashHead (split stage 1, as served now): the rank scores its ``C / 2`` centroids, keeps its best
  ``P`` cluster keys (:class:`~my_pkg.flashhead.probes.ShardStage1`), one all-gather of the keys, the
  best ``P`` of the gathered keys (:func:`~my_pkg.flashhead.probes.merge_probes`, the full stage 1's
  probes), ``FlashHead.step_logits`` over the rank's shard with those probes, then the same logits
  all-gather;
* FlashHead with stage 1 unsplit (before): every rank scores all ``C`` centroids, no key exchange.

TP=1 (one thread too): rank 0 alone over the whole head, dense ``F.linear`` and FlashHead
``step_logits``, no gather, while rank 1 waits. Greedy rows. Each batch is measured in rounds: TP=2
dense, FlashHead and unsplit (median of ``--repeats`` calls each, every call started on both ranks
after a barrier), then TP=1 dense and FlashHead, so that TP=1 and TP=2 are paired in the same minutes
of a shared machine. Speed-up = dense / FlashHead; TP=2 / TP=1 = the ratio of the two speed-ups; each
the median over the rounds.

The cost model (rows scored per rank and step, of ``H`` multiply-adds each): dense ``V / tp``; FlashHead
split ``C / tp + P * cap / tp`` (a cluster's members spread over the shards); unsplit ``C + P * cap / tp``.
Split, the speed-up in rows is ``V / (C + P * cap)`` at every TP: what is left is the fixed cost of
the key exchange and of the step's small ops, which grows relative to the rank's work as TP grows.

    python -m bench.experiments.tp_head --rounds 11                            # wall time, vLLM's TP all-gather
    python -m bench.experiments.tp_head --rounds 11 --gather gloo --clock cpu  # CPU time: steadier on a shared machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench._report import (
    EXPERIMENTS_MD,
    add_head_shape_options,
    command_line,
    free_port,
    int_list,
    machine_description,
    write_section,
)
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.probes import ShardStage1, merge_probes

SECTION = "tp-head"
CLOCK_TEXT = {
    "wall": "wall time of rank 0",
    "cpu": "CPU time of rank 0's process (all its threads): time given to other processes and waits for a "
    "descheduled peer left out",
}
GATHERS = {
    "vllm": "over vLLM's TP group (process group gloo, vLLM's CPU shared-memory all-gather, as vLLM serves on CPU)",
    "gloo": "over a gloo process group (`torch.distributed.all_gather`)",
}
BLOCK = 128  # rows drawn per seeded block: any shard boundary on a block gives the same head


def _rows(seed: int, start: int, end: int, hidden: int) -> torch.Tensor:
    """Rows ``[start, end)`` of the random head (drawn in seeded blocks, the same for any split)."""
    blocks = [
        torch.randn(BLOCK, hidden, generator=torch.Generator().manual_seed(seed * 1_000_003 + b))
        for b in range(start // BLOCK, -(-end // BLOCK))
    ]
    first = (start // BLOCK) * BLOCK
    return torch.cat(blocks)[start - first : end - first].contiguous()


def _hidden(batch: int, hidden: int) -> torch.Tensor:
    return torch.randn(batch, hidden, generator=torch.Generator().manual_seed(100 + batch))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _round(calls: dict, repeats: int, sync, reverse: bool) -> dict[str, float]:
    """Each call's median time (ms) over ``repeats`` calls, back to back; ``sync`` runs before every timed call."""
    out = {}
    for name in reversed(calls) if reverse else calls:
        samples = []
        for _ in range(repeats):
            sync()
            t0 = _clock()
            calls[name]()
            samples.append((_clock() - t0) * 1e3)
        out[name] = statistics.median(samples)
    return out


def _gloo_gather(local: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


def _vllm_gather(local: torch.Tensor, world: int) -> torch.Tensor:
    """vLLM's TP all-gather (its CPU shared-memory communicator, as vLLM serves on CPU); int64 keys travel as
    float32 pairs, as the logits processor sends them."""
    from vllm.distributed import tensor_model_parallel_all_gather

    if local.dtype == torch.int64:
        return tensor_model_parallel_all_gather(local.contiguous().view(torch.float32)).contiguous().view(torch.int64)
    return tensor_model_parallel_all_gather(local.contiguous())


_gather = _gloo_gather


def _init_group(rank: int, world: int, port: int, kind: str) -> None:
    """The ranks' process group (gloo); with ``kind`` ``vllm`` also vLLM's TP group over it."""
    global _gather
    if kind == "gloo":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        return
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    os.environ["VLLM_DIST_IDENT"] = f"bench-tp-head-{port}"  # as vLLM's CPU worker sets it
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
    _gather = _vllm_gather


def _flash_split(head: FlashHead, stage1: ShardStage1, h: torch.Tensor, probes: int, world: int) -> torch.Tensor:
    keys = _gather(stage1.keys(h, probes), world)
    return _gather(head.step_logits(h, probes=merge_probes(keys, probes, stage1.num_clusters)), world)


def _rank(rank: int, world: int, port: int, work: str, args: argparse.Namespace, queue) -> None:
    """One TP=2 rank; rank 0 also times TP=1 (the whole head, alone) in every round while rank 1 waits."""
    global _clock
    torch.set_num_threads(1)
    _clock = CLOCKS[args.clock]
    _init_group(rank, world, port, args.gather)
    try:
        tables = torch.load(Path(work) / "tables.pt")
        vocab = tables["assignments"].numel()
        start, end = vocab * rank // world, vocab * (rank + 1) // world
        full = _rows(args.seed, 0, vocab, args.hidden) if rank == 0 else None
        shard = full[start:end] if full is not None else _rows(args.seed, start, end, args.hidden)
        head = FlashHead(
            shard,
            tables["centroids"],
            tables["assignments"][start:end],
            vocab_size=end - start,
            n_probes=args.n_probes,
            backend="torch",
            allow_empty_clusters=True,
        )
        stage1 = ShardStage1(head.centroids, rank, world)
        whole = (
            FlashHead(full, tables["centroids"], tables["assignments"], n_probes=args.n_probes, backend="torch")
            if full is not None
            else None
        )
        out = {}
        for batch in args.batches:
            h = _hidden(batch, args.hidden)
            logits = F.linear(h, shard)
            tp2 = {
                "gather": partial(_gather, logits, world),
                "stage1": lambda h=h: _gather(stage1.keys(h, args.n_probes), world),
                "exchange": partial(_gather, stage1.keys(h, args.n_probes), world),
                "dense": lambda h=h: _gather(F.linear(h, shard), world),
                "flash": partial(_flash_split, head, stage1, h, args.n_probes, world),
                "unsplit": lambda h=h: _gather(head.step_logits(h), world),
            }
            tp1 = {"tp1_dense": partial(F.linear, h, full), "tp1_flash": partial(whole.step_logits, h)} if whole else {}
            split = _gather(stage1.keys(h, args.n_probes), world)
            same = torch.equal(merge_probes(split, args.n_probes, head.num_clusters), head.select_probes(h))
            _round(tp2, 1, dist.barrier, False)  # warm-up
            _round(tp1, 1, lambda: None, False)
            times: dict[str, list[float]] = {name: [] for name in (*tp2, *tp1)}
            for round_ in range(args.rounds):
                dist.barrier()
                for name, ms in _round(tp2, args.repeats, dist.barrier, round_ % 2 == 1).items():
                    times[name].append(ms)
                for name, ms in _round(tp1, args.repeats, lambda: None, round_ % 2 == 1).items():
                    times[name].append(ms)  # rank 1 waits in the barrier above (a blocking receive)
            out[batch] = times | {"same_probes": same}
            dist.barrier()
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def _ratio(times: dict[str, list[float]], dense: str, flash: str) -> list[float]:
    return [d / f for d, f in zip(times[dense], times[flash], strict=True)]


def cost_model(vocab: int, clusters: int, probes: int, cap: int, tps=(1, 2, 4, 8)) -> list[dict]:
    """Rows scored per rank and step, and the speed-up in rows relative to TP=1, split and unsplit."""
    base = vocab / (clusters + probes * cap)
    rows = []
    for tp in tps:
        split = clusters / tp + probes * cap / tp
        unsplit = clusters + probes * cap / tp
        rows.append(
            {
                "tp": tp,
                "dense": vocab / tp,
                "split": split,
                "unsplit": unsplit,
                "split_vs_tp1": (vocab / tp / split) / base,
                "unsplit_vs_tp1": (vocab / tp / unsplit) / base,
            }
        )
    return rows


def _spread(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}..{max(values):.2f})"


def to_markdown(results: dict, model: list[dict], shape: dict, machine: str) -> str:
    out = [
        "### FlashHead under tensor parallelism: TP=2 against TP=1 (cpu, float32, greedy rows)",
        "",
        f"Machine: {machine}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"V = {shape['vocab']:,}, H = {shape['hidden']:,}, {shape['clusters']:,} clusters of {shape['cap']}, "
        f"{shape['probes']} probes, random head and balanced assignment. TP=2: two processes, one thread each, "
        f"each with half the vocabulary and half the centroids, collectives {GATHERS[shape['gather']]}. Dense = "
        "`F.linear` over the rank's shard + the logits all-gather; FlashHead = its centroid share, the key "
        "all-gather, the merged probes, `step_logits` on its shard + the same logits all-gather; unsplit = "
        "every rank scoring all centroids, no key exchange (before). TP=1: rank 0 alone, one thread, over the "
        "whole head (dense `F.linear`, FlashHead `step_logits`), while rank 1 waits. Key exchange alone = the "
        "all-gather of keys computed beforehand, after the same barrier (the collective's latency and the ranks' "
        "skew). "
        f"Clock: {CLOCK_TEXT[shape['clock']]}. "
        f"{shape['rounds']} rounds of {shape['repeats']} calls each (median): in each round TP=2 dense, FlashHead "
        "and unsplit, then TP=1 dense and FlashHead, so TP=1 and TP=2 are paired in the same minutes; speed-up "
        "= dense / FlashHead, TP=2 / TP=1 = the ratio of the two speed-ups, each the median over the rounds "
        "(lowest..highest round).",
        "",
        "| batch | TP=1 dense ms | TP=1 FlashHead ms | TP=1 speed-up | TP=2 dense ms | TP=2 FlashHead ms "
        "| TP=2 speed-up | **TP=2 / TP=1** | unsplit / TP=1 (before) | stage 1 + key exchange ms "
        "| key exchange alone ms | logits gather ms | split probes = full stage 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for batch, t in results.items():
        one, two, unsplit = (
            _ratio(t, "tp1_dense", "tp1_flash"),
            _ratio(t, "dense", "flash"),
            _ratio(t, "dense", "unsplit"),
        )
        paired = [b / a for a, b in zip(one, two, strict=True)]
        before = [b / a for a, b in zip(one, unsplit, strict=True)]
        out.append(
            f"| {batch} | {statistics.median(t['tp1_dense']):.1f} | {statistics.median(t['tp1_flash']):.2f} | "
            f"{_spread(one, 'x')} | {statistics.median(t['dense']):.1f} | {statistics.median(t['flash']):.2f} | "
            f"{_spread(two, 'x')} | **{_spread(paired)}** | {_spread(before)} | "
            f"{statistics.median(t['stage1']):.2f} | {statistics.median(t['exchange']):.2f} | "
            f"{statistics.median(t['gather']):.2f} | {t['same_probes']} |"
        )
    out += [
        "",
        "Cost model, rows of H scored per rank and step (dense V / tp; split C / tp + P * cap / tp; unsplit "
        "C + P * cap / tp) and the speed-up in rows relative to TP=1 (fixed costs, such as the key exchange, "
        "left out):",
        "",
        "| TP | dense rows | split rows | split / TP=1 | unsplit rows | unsplit / TP=1 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in model:
        out.append(
            f"| {row['tp']} | {row['dense']:,.0f} | {row['split']:,.0f} | {row['split_vs_tp1']:.2f} | "
            f"{row['unsplit']:,.0f} | {row['unsplit_vs_tp1']:.2f} |"
        )
    base = model[0]["dense"] / model[0]["split"]
    far = [row for row in model if row["tp"] in (4, 8)]
    out += [
        "",
        f"In rows the split keeps TP=1's {base:.1f}x at every TP; scoring every centroid on every rank gave "
        + " and ".join(f"{base * row['unsplit_vs_tp1']:.1f}x at TP={row['tp']}" for row in far)
        + ". What the model leaves out is per step and per rank: the key exchange (a `[B, tp * P]` int64 "
        "all-gather), the merge (a top-P of `tp * P` keys per row) and the step's small ops; they weigh more "
        "as each rank's share of the rows shrinks, and the logits gather, paid alike by the dense head, "
        "lowers every TP>1 speed-up ratio (dense + gather) / (FlashHead + gather).",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_head_shape_options(ap)
    ap.add_argument("--batches", type=int_list, default=[1, 8])
    ap.add_argument("--n-probes", type=int, default=None, help="default: the builder's (about 1/32 of the clusters)")
    ap.add_argument("--rounds", type=int, default=7, help="paired rounds per batch")
    ap.add_argument("--repeats", type=int, default=5, help="calls per measurement (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gather",
        choices=["vllm", "gloo"],
        default="vllm",
        help="TP=2 collectives: vLLM's TP group (its CPU shared-memory all-gather, as served) or plain gloo",
    )
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: the rank process's CPU time (all its threads; with --gather gloo, whose waits block): "
        "time the machine gives other processes, and a rank's wait for a descheduled peer, are left out",
    )
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.gather != "gloo":
        ap.error("--clock cpu needs --gather gloo (vLLM's shared-memory all-gather waits spinning)")
    if args.vocab % (2 * BLOCK):
        ap.error(f"--vocab must be a multiple of {2 * BLOCK} (each rank draws its rows in blocks)")
    torch.set_num_threads(1)
    machine = machine_description()
    print(machine)
    weight = _rows(args.seed, 0, args.vocab, args.hidden)
    assignments = random_balanced_assignment(args.vocab, 16, seed=args.seed)
    clusters = int(assignments.max()) + 1
    args.n_probes = args.n_probes or default_n_probes(clusters)
    sums = torch.zeros(clusters, args.hidden).index_add_(0, assignments, weight)
    centroids = sums / torch.bincount(assignments, minlength=clusters).unsqueeze(1)
    cap = int(torch.bincount(assignments).max())
    print(f"V={args.vocab} H={args.hidden} C={clusters} cap={cap} P={args.n_probes}", flush=True)
    del weight
    print(f"TP=2 (two processes, {args.gather} collectives) and TP=1 on rank 0, paired rounds ...", flush=True)
    with tempfile.TemporaryDirectory() as work:
        torch.save({"centroids": centroids, "assignments": assignments}, Path(work) / "tables.pt")
        context = mp.get_context("spawn")
        queue = context.Queue()
        port = free_port()
        procs = [context.Process(target=_rank, args=(r, 2, port, work, args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = queue.get(timeout=3600)
        for p in procs:
            p.join()
    shape = {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "clusters": clusters,
        "cap": cap,
        "probes": args.n_probes,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "gather": args.gather,
        "clock": args.clock,
    }
    md = to_markdown(results, cost_model(args.vocab, clusters, args.n_probes, cap), shape, machine)
    print(md)
    if not args.no_write:
        name = SECTION if (args.gather, args.clock) == ("vllm", "wall") else f"{SECTION}-{args.gather}-{args.clock}"
        path = write_section(name, md, EXPERIMENTS_MD)
        print(f"wrote the {name} section of {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
