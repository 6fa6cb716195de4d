"""FlashHead vs dense LM head: time per decode step over batch sizes and head shapes.

Timing only: heads are random and the cluster assignment is a fast random balanced one
(stage costs do not depend on cluster quality).  Greedy decoding is timed on both sides:
dense = ``argmax(hidden @ W.T)`` (best of ``F.linear`` and ``mm(W, hidden.T)``), FlashHead =
stage 1 + fused stage 2 greedy.  On CUDA the dense side is also run as one fused Triton argmax
kernel (every row scored, no logits written).  With ``--rounds N`` every (shape, batch) is
measured N times, dense and FlashHead alternating, and the table gives the median speed-up of
the rounds and their spread (a shared machine is noisy).  ``--stages`` adds the split of the
FlashHead step: stage 1 (centroid scores + top-P) and stage 2 (exact candidate logits +
argmax).  ``--clock cpu`` (CPU, one thread) times the thread's CPU time instead of wall time.
Results go to stdout and to a section of ``docs/benchmarks.md``: ``head`` for the device's
default dtype (float32 on CPU, bfloat16 on CUDA), ``head-<dtype>`` for any other.

    python bench/head.py --quick                 # 128,256 x 2,048, batch 1..64
    python bench/head.py --hidden 2048 --vocab 32000,128256 --batches 1,8,32
    python bench/head.py --hidden 2048 --vocab 128256 --batches 1,8,32 --dtype bfloat16 --rounds 5 --stages
    python bench/head.py                          # full grid (slow on CPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import command_line, machine_description, write_section  # noqa: E402

from my_pkg.flashhead import FlashHead, default_n_probes  # noqa: E402
from my_pkg.flashhead.clustering import random_balanced_assignment  # noqa: E402

FULL_HIDDEN = [640, 2048, 4096]
FULL_VOCAB = [32000, 128256, 262144]
FULL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _timer(device: torch.device, fn, repeats: int, min_time: float,
           clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time (ms, on ``clock``) of ``fn``, after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    ts = []
    start = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - start < min_time and len(ts) < 200):
        t0 = clock()
        fn()
        sync()
        ts.append((clock() - t0) * 1e3)
    return statistics.median(ts)


def _dense_fused(weight: torch.Tensor, cap: int = 16):
    """Dense argmax as one fused Triton kernel: the FlashHead greedy kernel over an identity map."""
    from my_pkg.flashhead.kernels import triton_kernels

    v = weight.shape[0] - weight.shape[0] % cap
    members = torch.arange(v, device=weight.device).view(-1, cap)

    def run(hidden):
        probes = torch.arange(members.shape[0], device=weight.device).expand(hidden.shape[0], -1)
        return triton_kernels.greedy(hidden, weight[:v], members, probes)

    return run


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def section_name(device: torch.device, dtype: torch.dtype) -> str:
    """``head`` for the device's default dtype, ``head-<dtype>`` otherwise (each dtype keeps its table)."""
    return "head" if dtype == _default_dtype(device) else f"head-{str(dtype).replace('torch.', '')}"


def _stage_timers(head: FlashHead, h: torch.Tensor):
    """Callables for stage 1 (centroid scores + top-P) and stage 2 (candidate logits + argmax) of ``head.greedy``."""
    probes = head.select_probes(h)
    return lambda: head.select_probes(h), lambda: head.greedy(h, probes)


def bench_shape(hidden: int, vocab: int, batches: list[int], device: torch.device, dtype: torch.dtype,
                n_probes: int | None, repeats: int, min_time: float, rounds: int = 1,
                stages: bool = False, clock: Callable[[], float] = time.perf_counter) -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float32).to(dtype).to(device)
    assign = random_balanced_assignment(vocab, 16)
    c = int(assign.max()) + 1
    cent = torch.randn(c, hidden, generator=g)
    p = n_probes or default_n_probes(c)
    head = FlashHead(weight, cent, assign, n_probes=min(p, c))
    fused = _dense_fused(weight) if device.type == "cuda" and head.backend == "triton" else None
    rows = []
    for b in batches:
        h = torch.randn(b, hidden, generator=g).to(dtype).to(device)
        dense_runs, flash_runs = [], []
        for _ in range(rounds):
            # Dense: the faster of two formulations (F.linear is slow for small B > 1 on some CPUs).
            dense_runs.append(min(
                _timer(device, lambda: torch.nn.functional.linear(h, weight).argmax(1), repeats, min_time, clock),
                _timer(device, lambda: torch.mm(weight, h.t()).argmax(0), repeats, min_time, clock)))
            flash_runs.append(_timer(device, lambda: head.greedy(h), repeats, min_time, clock))
        ratios = [d / f for d, f in zip(dense_runs, flash_runs)]
        dense, flash = statistics.median(dense_runs), statistics.median(flash_runs)
        fused_ms = _timer(device, lambda: fused(h), repeats, min_time, clock) if fused else None
        stage_ms = [_timer(device, fn, repeats, min_time, clock) for fn in _stage_timers(head, h)] if stages else None
        rows.append({"batch": b, "dense": dense, "flash": flash, "fused": fused_ms, "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "stages": stage_ms})
        extra = f" fused-dense {fused_ms:8.2f} ms" if fused_ms is not None else ""
        if rounds > 1:
            extra += f" (median of {rounds} rounds, x{min(ratios):.2f}..x{max(ratios):.2f})"
        if stage_ms is not None:
            extra += f" stage 1 {stage_ms[0]:.2f} ms, stage 2 {stage_ms[1]:.2f} ms"
        print(f"  H={hidden:5d} V={vocab:7d} B={b:4d}: dense {dense:8.2f} ms  flashhead {flash:8.2f} ms  "
              f"x{rows[-1]['ratio']:5.2f}{extra}", flush=True)
    crossover = next((r["batch"] for r in rows if r["ratio"] <= 1.0), None)
    extra_bytes = head.extra_memory_bytes
    del weight, head
    return {"hidden": hidden, "vocab": vocab, "clusters": c, "probes": min(p, c), "rows": rows,
            "crossover": crossover, "backend": "triton" if fused else "torch", "rounds": rounds,
            "extra_bytes": extra_bytes}


def to_markdown(results: list[dict], device: torch.device, dtype: torch.dtype, clock: str = "wall",
                machine: str | None = None) -> str:
    """The benchmark section; ``machine`` is the description taken when the run started."""
    rounds = max((r["rounds"] for r in results), default=1)
    any_stages = any(x["stages"] is not None for r in results for x in r["rows"])
    out = [f"### FlashHead vs dense LM head ({device.type}, {str(dtype).replace('torch.', '')})", "",
           f"Machine: {machine or machine_description()}", "",
           f"Command: `{command_line()}`", "",
           ("Greedy decode step (ms of the thread's CPU time, median: time the scheduler gave to other "
            "processes is left out, memory bandwidth is still shared)." if clock == "cpu" else
            "Greedy decode step (ms, median).") + " Dense = `argmax(hidden @ W.T)` (faster of `F.linear` and "
           "`mm(W, hidden.T)`); FlashHead = centroid scoring + "
           "top-P + exact scoring of the P x 16 candidate rows. Random heads with a random balanced "
           "assignment (timing does not depend on cluster quality). Crossover = smallest measured batch "
           "at which dense is at least as fast. On a shared machine timings are noisy (see the load average above); "
           "with 2 threads under load every OpenMP barrier can cost a scheduler tick, `--threads 1` is steadier."
           + (f" Each row: {rounds} rounds, dense and FlashHead alternating; ms and speed-up are the medians of the "
              "rounds, spread = lowest..highest speed-up of a round." if rounds > 1 else "")
           + (" Stage 1 (centroid scores + top-P) and stage 2 (candidate logits + argmax) are each timed alone, "
              "with warmer caches than inside the whole step, so they need not add up to it." if any_stages else ""),
           ""]
    for r in results:
        fused = any(x["fused"] is not None for x in r["rows"])
        stages = any(x["stages"] is not None for x in r["rows"])
        out.append(f"**V = {r['vocab']:,}, H = {r['hidden']:,}** ({r['clusters']:,} clusters, "
                   f"{r['probes']} probes, {r['clusters'] + 16 * r['probes']:,} scored rows, {r['backend']}; "
                   f"centroids + cluster map {r['extra_bytes'] / 2**20:.1f} MiB)")
        out.append("")
        head = ("| batch | dense ms | FlashHead ms | speed-up |" + (" spread |" if r["rounds"] > 1 else "")
                + (" stage 1 ms | stage 2 ms |" if stages else "")
                + (" fused dense argmax ms | vs fused |" if fused else ""))
        out.append(head)
        out.append("|---:|---:|---:|---:|" + ("---:|" if r["rounds"] > 1 else "") + ("---:|---:|" if stages else "")
                   + ("---:|---:|" if fused else ""))
        for x in r["rows"]:
            line = f"| {x['batch']} | {x['dense']:.2f} | {x['flash']:.2f} | {x['ratio']:.2f}x |"
            if r["rounds"] > 1:
                line += f" {x['ratio_min']:.2f}..{x['ratio_max']:.2f}x |"
            if stages:
                line += f" {x['stages'][0]:.2f} | {x['stages'][1]:.2f} |"
            if fused:
                line += f" {x['fused']:.2f} | {x['fused'] / x['flash']:.2f}x |"
            out.append(line)
        cross = (f"dense is faster from batch {r['crossover']}" if r["crossover"] is not None
                 else f"FlashHead faster at every measured batch (up to {r['rows'][-1]['batch']})")
        out.append("")
        out.append(f"Crossover: {cross}.")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only 128,256 x 2,048, batch 1..64")
    ap.add_argument("--hidden", type=_ints, default=None)
    ap.add_argument("--vocab", type=_ints, default=None)
    ap.add_argument("--batches", type=_ints, default=None)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--n-probes", type=int, default=None, help="default: about 1/32 of the clusters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each batch this many times (dense and FlashHead alternating); report the median "
                         "speed-up and its spread")
    ap.add_argument("--stages", action="store_true", help="also time stage 1 and stage 2 of the FlashHead step")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds spent per measurement at least")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: time the thread's CPU time (CPU device and --threads 1 only), which leaves out "
                         "time given to other processes")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype) if args.dtype else _default_dtype(device)
    if args.clock == "cpu" and (device.type != "cpu" or args.threads != 1):
        ap.error("--clock cpu needs the CPU device and --threads 1 (one thread's CPU time is the step's time)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    hidden = args.hidden or ([2048] if args.quick else FULL_HIDDEN)
    vocab = args.vocab or ([128256] if args.quick else FULL_VOCAB)
    batches = args.batches or ([1, 2, 4, 8, 16, 32, 64] if args.quick else FULL_BATCHES)
    machine = machine_description()
    print(machine)
    results = []
    for v in vocab:
        for h in hidden:
            results.append(bench_shape(h, v, batches, device, dtype, args.n_probes, args.repeats, args.min_time,
                                       args.rounds, args.stages, clock))
            r = results[-1]
            print(f"  -> crossover batch: {r['crossover'] if r['crossover'] is not None else 'none measured'}")
    md = to_markdown(results, device, dtype, args.clock, machine)
    if not args.no_write:
        name = section_name(device, dtype)
        path = write_section(name, md)
        print(f"wrote the {name} section of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
