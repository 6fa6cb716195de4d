"""A decode step as the engine serves it, start-up timing included, against vLLM's dense head.

`bench.head` times `FlashHead.step_logits`; serving goes through the worker's controller, which (with no
`MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD`) times the head beside vLLM's dense product when the model loads
and serves each step's FlashHead rows the cheaper way it predicts: FlashHead's kernels, or the dense product
masked to FlashHead's answer (the same tokens either way; `my_pkg/flashhead/step_costs.py`), corrected by the
served steps' own times (`my_pkg/engine/flashhead/timing.py`).  This benchmark builds that controller over a
random head (random balanced clusters, the builder's default probes, a fitted sampled-row estimate), lets it
time itself as a server would, then times `FlashHeadController.compute_logits` (pinned ids included) beside the dense
product (vLLM's CPU GEMM over the packed weight when vLLM is installed, else `F.linear`) for greedy,
sampled and mixed (every other row sampled) steps, in paired rounds.  A ratio below 1.0 is a step served slower
than the dense head: what "never slower than dense" would take to fail (the masked way costs the dense product
plus stage 1, and a sampled row's estimate, so it cannot reach 1.0 where FlashHead's kernels do not pay).

    python -m bench.served_step --shapes 262144x640,128256x2048 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from bench._report import (
    command_line,
    dense_head,
    int_list,
    machine_description,
    paired_rounds,
    shape_list,
    write_section,
)
from bench.head import sampled_mask
from my_pkg.engine.flashhead.controller import FlashHeadController
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.spec import default_n_probes

KINDS = ("greedy", "sampled", "mixed")
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def _plan_taken(controller: FlashHeadController, before: tuple[int, int], batch: int) -> str:
    """How the controller served the step it just served, read from its counters: `flashhead` (its kernels) or
    `masked` (the dense product masked to FlashHead's answer)."""
    masked = controller.counters.rows_flashhead_masked - before[1]
    return "masked" if masked == batch else "flashhead"


def _controller(vocab: int, hidden: int, dtype: torch.dtype, dense) -> FlashHeadController:
    from bench._report import fitted_tail_factors

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=generator).to(dtype)
    assignments = random_balanced_assignment(vocab, 16)
    clusters = int(assignments.max()) + 1
    controller = FlashHeadController(
        centroids=torch.randn(clusters, hidden, generator=generator),
        assignments=assignments,
        config={"n_probes": default_n_probes(clusters)},
        vocab_size=vocab,
        pinned_ids=range(vocab - 3, vocab),
        tail_factors=fitted_tail_factors(weight, vocab),
    )
    started = time.perf_counter()
    controller.prepare(weight, dense=dense(weight))
    print(f"  built, warmed up and timed in {time.perf_counter() - started:.1f} s", flush=True)
    return controller


def bench_shape(vocab: int, hidden: int, dtype: torch.dtype, batches: list[int], rounds: int, repeats: int) -> dict:
    products: dict[str, object] = {}

    def dense_for(weight: torch.Tensor):
        fn, products["name"] = dense_head(weight)
        products["fn"] = fn
        return fn

    controller = _controller(vocab, hidden, dtype, dense_for)
    dense = products["fn"]
    costs = controller.step_costs
    if costs is None:
        raise SystemExit("the controller did not time itself (is MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD set?)")
    report = controller.status().step_costs
    print(
        f"  timed at start-up at {report.batches} rows: dense {report.dense_ms} ms, greedy {report.greedy_ms} ms, "
        f"sampled {report.sampled_ms} ms, mixed {report.mixed_ms} ms, masked greedy {report.masked_greedy_ms} ms, "
        f"masked sampled {report.masked_sampled_ms} ms",
        flush=True,
    )
    generator = torch.Generator().manual_seed(1)
    rows_out = []
    for batch in batches:
        hidden_states = torch.randn(batch, hidden, generator=generator).to(dtype)
        line = {"batch": batch, "kinds": {}}
        for kind in KINDS:
            if kind == "mixed" and batch == 1:
                continue
            sampled = sampled_mask(kind, batch)
            step = StepRows(np.zeros(batch, np.uint8), sampled)

            def served(step=step, hidden_states=hidden_states):
                return controller.compute_logits(hidden_states, step, dense, lambda x: x)

            def dense_step(hidden_states=hidden_states):
                return dense(hidden_states)

            before = (controller.counters.rows_flashhead, controller.counters.rows_flashhead_masked)
            served()
            plan = _plan_taken(controller, before, batch)
            dense(hidden_states)
            line["kinds"][kind] = {"plan": plan, **paired_rounds(dense_step, served, rounds, repeats)}
        rows_out.append(line)
        text = "  ".join(
            f"{k} {v['plan']:<13} {v['ms']:7.2f} ms x{v['ratio']:.2f} ({v['min']:.2f}..{v['max']:.2f})"
            for k, v in line["kinds"].items()
        )
        print(f"  V={vocab} H={hidden} B={batch:4d}: {text}", flush=True)
    return {"vocab": vocab, "hidden": hidden, "rows": rows_out, "costs": report, "dense": products["name"]}


def _rounded(times: list[float | None] | None) -> list[float | None] | None:
    return [None if ms is None else round(ms, 1) for ms in times] if times is not None else None


def _from(rows: int | None) -> str:
    return f"from {rows} rows" if rows is not None else "at no timed batch"


def to_markdown(results: list[dict], dtype: torch.dtype, rounds: int, machine: str) -> str:
    out = [
        f"### A decode step as served, start-up timing included ({str(dtype).replace('torch.', '')})",
        "",
        f"Machine: {machine}",
        "",
        f"Command: `{command_line()}`",
        "",
        "`FlashHeadController.compute_logits` (what the engine calls for a decode step, pinned ids included) "
        "after the controller timed itself at start-up, against the dense product "
        f"({results[0]['dense'] if results else ''}), {rounds} paired rounds; "
        "`plan` is how the timing serves the step's rows (`flashhead`: FlashHead's kernels; `masked`: the dense "
        "product masked to FlashHead's answer, the same tokens). Ratio = dense / served, median of the rounds "
        "(lowest..highest).",
        "",
    ]
    for r in results:
        costs = r["costs"]
        out.append(
            f"**{r['vocab']:,} × {r['hidden']:,}**: timed at start-up (ms) at {costs.batches} rows: dense "
            f"{_rounded(costs.dense_ms)}, greedy {_rounded(costs.greedy_ms)}, sampled {_rounded(costs.sampled_ms)}, "
            f"mixed {_rounded(costs.mixed_ms)}, masked greedy {_rounded(costs.masked_greedy_ms)}, masked sampled "
            f"{_rounded(costs.masked_sampled_ms)}; a step of only greedy rows takes the masked way "
            f"{_from(costs.masked_from_greedy)}, of only sampled rows {_from(costs.masked_from_sampled)}."
        )
        out += ["", "| batch | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
        for line in r["rows"]:
            cells = []
            for kind in KINDS:
                v = line["kinds"].get(kind)
                cells.append("—" if v is None else f"{v['plan']}: x{v['ratio']:.2f} ({v['min']:.2f}..{v['max']:.2f})")
            out.append(f"| {line['batch']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shape_list, default=[(262144, 640), (128256, 2048)], help="VOCABxHIDDEN,...")
    ap.add_argument("--batches", type=int_list, default=BATCHES)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="calls per measurement (median)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    machine = machine_description()
    print(machine)
    print(f"Command: `{command_line()}`", flush=True)
    with torch.inference_mode():
        results = [bench_shape(v, h, dtype, args.batches, args.rounds, args.repeats) for v, h in args.shapes]
    markdown = to_markdown(results, dtype, args.rounds, machine)
    if not args.no_write:
        name = "served-step" if dtype == torch.float32 else f"served-step-{args.dtype}"
        print(f"wrote {write_section(name, markdown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
