"""FlashHead vs dense LM head, timed as served: one decode step into the sampler's logits.

Both sides produce the ``[B, V]`` logits vLLM's sampler gets: dense = the product vLLM computes (on CPU
its oneDNN GEMM over the packed weight when vLLM is installed, else ``F.linear(hidden, W[:V])``);
FlashHead = ``FlashHead.step_logits`` with the inputs serving gives it: greedy rows, sampled rows
(exact candidates + the tail estimate) or a mixed batch (every other row sampled), with ``--pinned``
ids (EOS/special/stop tokens) scored on every row.  Heads are random with a random balanced
assignment (the cost does not depend on cluster quality), ``n_probes`` the builder's default.

Every (shape, batch) is measured in ``--rounds`` paired rounds: in each round the dense step and
every FlashHead kind are timed back to back (median of ``--repeats`` calls each), and the speed-up
of the round is dense / FlashHead.  The table gives the median speed-up of the rounds and their
spread (lowest..highest): on a shared machine only ratios taken in the same minutes compare.
Results go to stdout and to a section of ``docs/benchmarks.md``: ``head`` for the device's default
dtype (float32 on CPU, bfloat16 on CUDA), ``head-<dtype>`` for any other.  On CUDA prefer
``bench/gpu_check.py`` (CUDA-graph replays, as vLLM decodes).

    python -m bench.head --quick                    # 128,256 x 2,048, batch 1..256, fp32, 3 rounds
    python -m bench.head --quick --dtype bfloat16
    python -m bench.head --hidden 2048 --vocab 128256 --batches 1,8,32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch

from bench._report import command_line, dense_head, fitted_tail_factors, int_list, machine_description, write_section
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.clustering import random_balanced_assignment

FULL_HIDDEN = [640, 2048, 4096]
FULL_VOCAB = [32000, 128256]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
KINDS = ("greedy", "sampled", "mixed")


_CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}


def _timer(device: torch.device, fn, repeats: int, min_time: float, clock: str = "wall") -> float:
    """Median time (ms, on ``clock``) of ``fn`` over ``repeats`` calls (more while under ``min_time`` s, at most 50)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = _CLOCK[clock]
    ts = []
    start = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - start < min_time and len(ts) < 50):
        t0 = now()
        fn()
        sync()
        ts.append((now() - t0) * 1e3)
    return statistics.median(ts)


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def section_name(device: torch.device, dtype: torch.dtype) -> str:
    """``head`` for the device's default dtype, ``head-<dtype>`` otherwise (each dtype keeps its table)."""
    return "head" if dtype == _default_dtype(device) else f"head-{str(dtype).replace('torch.', '')}"


def sampled_mask(kind: str, batch: int) -> np.ndarray:
    """The ``sampled`` argument serving passes for a batch of this kind."""
    if kind == "greedy":
        return np.zeros(batch, bool)
    if kind == "sampled":
        return np.ones(batch, bool)
    return np.arange(batch) % 2 == 1  # mixed: every other row samples


def bench_shape(
    hidden: int,
    vocab: int,
    batches: list[int],
    device: torch.device,
    dtype: torch.dtype,
    n_probes: int | None,
    repeats: int,
    min_time: float,
    rounds: int,
    kinds: tuple[str, ...],
    pinned: int,
    backend: str = "auto",
    clock: str = "wall",
) -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float32).to(dtype).to(device)
    assign = random_balanced_assignment(vocab, 16)
    c = int(assign.max()) + 1
    p = min(n_probes or default_n_probes(c), c)
    head = FlashHead(
        weight,
        torch.randn(c, hidden, generator=g),
        assign,
        n_probes=p,
        backend=backend,
        tail_factors=fitted_tail_factors(weight, vocab) if "sampled" in kinds or "mixed" in kinds else None,
    )
    pins = torch.arange(vocab - pinned, vocab, device=device)  # e.g. the special tokens at the vocabulary's end
    t0 = time.perf_counter()
    if "sampled" in kinds or "mixed" in kinds:
        head.step_logits(torch.zeros(1, hidden, dtype=dtype, device=device), sampled=np.ones(1, bool))
    tables_s = time.perf_counter() - t0
    dense, dense_name = dense_head(weight[: head.vocab_size])
    rows = []
    for b in batches:
        h = torch.randn(b, hidden, generator=g).to(dtype).to(device)
        steps = {
            kind: partial(head.step_logits, h, sampled=sampled_mask(kind, b), pinned=pins)
            for kind in kinds
            if not (kind == "mixed" and b == 1)
        }
        dense_fn = partial(dense, h)
        dense_fn()
        for fn in steps.values():  # warm-up (allocator, first-call paths)
            fn()
        dense_runs: list[float] = []
        flash_runs: dict[str, list[float]] = {kind: [] for kind in steps}
        for _ in range(rounds):
            dense_runs.append(_timer(device, dense_fn, repeats, min_time, clock))
            for kind, fn in steps.items():
                flash_runs[kind].append(_timer(device, fn, repeats, min_time, clock))
        row = {"batch": b, "dense": statistics.median(dense_runs), "kinds": {}}
        for kind, runs in flash_runs.items():
            ratios = [d / f for d, f in zip(dense_runs, runs)]
            row["kinds"][kind] = {
                "ms": statistics.median(runs),
                "ratio": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        rows.append(row)
        text = "  ".join(
            f"{k} {v['ms']:8.2f} ms x{v['ratio']:.2f} ({v['min']:.2f}..{v['max']:.2f})" for k, v in row["kinds"].items()
        )
        print(f"  H={hidden:5d} V={vocab:7d} B={b:4d}: dense {row['dense']:8.2f} ms  {text}", flush=True)
    worst = min((v["ratio"], r["batch"], k) for r in rows for k, v in r["kinds"].items())
    crossover = next((r["batch"] for r in rows if any(v["ratio"] <= 1.0 for v in r["kinds"].values())), None)
    result = {
        "hidden": hidden,
        "vocab": vocab,
        "clusters": c,
        "probes": p,
        "rows": rows,
        "crossover": crossover,
        "worst": worst,
        "backend": head.backend,
        "rounds": rounds,
        "dense": dense_name,
        "pinned": pinned,
        "clock": clock,
        "sampled_probes": head.sampled_n_probes,
        "rank": head.sampled_rank,
        "rescore": head.sampled_rescore,
        "estimate": "fitted" if head.tail_fitted else "weight-only",
        "tables_s": tables_s,
        "extra_bytes": head.extra_memory_bytes,
        "rows_greedy": head.scored_rows_per_step(sampled=False, pinned=pinned),
        "rows_sampled": head.scored_rows_per_step(sampled=True, pinned=pinned),
    }
    del weight, head
    return result


def sampled_rows_text(r: dict) -> str:
    """What a sampled row of the run scores: its clusters (if any), the estimate, its best-estimated tokens."""
    clusters = f"{r['sampled_probes']} probes + " if r["sampled_probes"] else "no stage 1, "
    estimate = f"rank-{r['rank']} {r.get('estimate', '')} estimate"
    return f"{clusters}{estimate} + {r.get('rescore', 0):,} best-estimated tokens"


def to_markdown(results: list[dict], device: torch.device, dtype: torch.dtype, machine: str | None = None) -> str:
    """The benchmark section; ``machine`` is the description taken when the run started."""
    rounds = max((r["rounds"] for r in results), default=1)
    dense = results[0].get("dense", "`F.linear`") if results else "`F.linear`"
    out = [
        f"### FlashHead vs dense LM head, as served ({device.type}, {str(dtype).replace('torch.', '')})",
        "",
        f"Machine: {machine or machine_description()}",
        "",
        f"Command: `{command_line()}`",
        "",
        "One decode step into the `[B, V]` logits vLLM's sampler gets (ms, median"
        + (
            "; the thread's CPU time, one thread: time given to other processes is left out"
            if any(r.get("clock") == "cpu" for r in results)
            else ""
        )
        + f"). Dense = {dense} over `W[:V]`; FlashHead = `FlashHead.step_logits` as serving calls it: greedy "
        "rows, sampled rows (the "
        "estimate a default build fits, its best tokens exact) or a mixed batch (every other row sampled), "
        "pinned ids scored on every row. "
        "Random heads with a random balanced assignment (the cost does not depend on cluster quality). "
        f"Each batch: {rounds} paired rounds (dense and every FlashHead kind back to back); speed-up = median "
        "over the rounds of dense / FlashHead, spread = lowest..highest round.",
        "",
    ]
    for r in results:
        kinds = list(dict.fromkeys(k for x in r["rows"] for k in x["kinds"]))  # each kind once, first seen first
        out.append(
            f"**V = {r['vocab']:,}, H = {r['hidden']:,}** ({r['clusters']:,} clusters of 16, {r['probes']} "
            f"probes; sampled rows: {sampled_rows_text(r)}; {r['pinned']} pinned ids; rows scored per row: "
            f"greedy {r['rows_greedy']:,}, sampled {r['rows_sampled']:,} "
            f"of {r['vocab']:,}; backend {r['backend']}; extra memory {r['extra_bytes'] / 2**20:.1f} MiB; "
            f"estimate tables built once in {r['tables_s']:.1f} s)"
        )
        out.append("")
        out.append("| batch | dense ms | " + " | ".join(f"{k} ms | {k} speed-up (spread)" for k in kinds) + " |")
        out.append("|---:|---:|" + "---:|---:|" * len(kinds))
        for x in r["rows"]:
            cells = []
            for k in kinds:
                v = x["kinds"].get(k)
                cells.append(
                    "n/a | n/a" if v is None else f"{v['ms']:.2f} | {v['ratio']:.2f}x ({v['min']:.2f}..{v['max']:.2f})"
                )
            out.append(f"| {x['batch']} | {x['dense']:.2f} | " + " | ".join(cells) + " |")
        ratio, batch, kind = r["worst"]
        out.append("")
        out.append(f"Lowest median speed-up: {ratio:.2f}x ({kind} rows at batch {batch}).")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only 128,256 x 2,048")
    ap.add_argument("--hidden", type=int_list, default=None)
    ap.add_argument("--vocab", type=int_list, default=None)
    ap.add_argument("--batches", type=int_list, default=None, help="default 1,2,4,...,256")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of greedy,sampled,mixed")
    ap.add_argument("--pinned", type=int, default=3, help="pinned ids scored on every row (EOS and the like)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default float32 on CPU, bfloat16 on CUDA",
    )
    ap.add_argument("--backend", default="auto", help="a registered FlashHead kernel backend")
    ap.add_argument("--n-probes", type=int, default=None, help="default: the builder's (about 1/32 of the clusters)")
    ap.add_argument("--repeats", type=int, default=2, help="calls per measurement (median)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds per batch")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds spent per measurement at least")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the thread's CPU time (CPU, --threads 1 only): steadier on a shared machine",
    )
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be >= 1")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds takes a subset of {','.join(KINDS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (args.threads != 1 or args.device == "cuda"):
        ap.error("--clock cpu needs --threads 1 on the CPU (one thread's CPU time is the step's time)")
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    dtype = getattr(torch, args.dtype) if args.dtype else _default_dtype(device)
    hidden = args.hidden or ([2048] if args.quick else FULL_HIDDEN)
    vocab = args.vocab or ([128256] if args.quick else FULL_VOCAB)
    batches = args.batches or BATCHES
    machine = machine_description()
    print(machine)
    results = []
    for v in vocab:
        for h in hidden:
            results.append(
                bench_shape(
                    h,
                    v,
                    batches,
                    device,
                    dtype,
                    args.n_probes,
                    args.repeats,
                    args.min_time,
                    args.rounds,
                    kinds,
                    args.pinned,
                    args.backend,
                    args.clock,
                )
            )
            r = results[-1]
            print(
                f"  -> crossover batch: {r['crossover'] if r['crossover'] is not None else 'none measured'}; "
                f"lowest median speed-up {r['worst'][0]:.2f}x ({r['worst'][2]} at batch {r['worst'][1]})"
            )
    md = to_markdown(results, device, dtype, machine)
    if not args.no_write:
        name = section_name(device, dtype)
        path = write_section(name, md)
        print(f"wrote the {name} section of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
