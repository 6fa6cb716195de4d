"""FlashHead vs dense LM head: time per decode step over batch sizes and head shapes.

Timing only: heads are random and the cluster assignment is a fast random balanced one
(stage costs do not depend on cluster quality).  Greedy decoding is timed on both sides:
dense = ``argmax(hidden @ W.T)`` (best of ``F.linear`` and ``mm(W, hidden.T)``), FlashHead = stage 1 + fused stage 2 greedy.  On CUDA the
dense side is also run as one fused Triton argmax kernel (every row scored, no logits
written).  Results go to stdout and to the ``head`` section of ``docs/benchmarks.md``.

    python bench/head.py --quick                 # 128,256 x 2,048, batch 1..64
    python bench/head.py --hidden 2048 --vocab 32000,128256 --batches 1,8,32
    python bench/head.py                          # full grid (slow on CPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

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


def _timer(device: torch.device, fn, repeats: int, min_time: float) -> float:
    """Median wall time (ms) of ``fn``, after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    ts = []
    start = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - start < min_time and len(ts) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
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


def bench_shape(hidden: int, vocab: int, batches: list[int], device: torch.device, dtype: torch.dtype,
                n_probes: int | None, repeats: int, min_time: float) -> dict:
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
        # Dense: the faster of two formulations (F.linear is slow for small B > 1 on some CPUs).
        dense = min(_timer(device, lambda: torch.nn.functional.linear(h, weight).argmax(1), repeats, min_time),
                    _timer(device, lambda: torch.mm(weight, h.t()).argmax(0), repeats, min_time))
        flash = _timer(device, lambda: head.greedy(h), repeats, min_time)
        fused_ms = _timer(device, lambda: fused(h), repeats, min_time) if fused else None
        rows.append({"batch": b, "dense": dense, "flash": flash, "fused": fused_ms})
        extra = f" fused-dense {fused_ms:8.2f} ms" if fused_ms is not None else ""
        print(f"  H={hidden:5d} V={vocab:7d} B={b:4d}: dense {dense:8.2f} ms  flashhead {flash:8.2f} ms  "
              f"x{dense / flash:5.2f}{extra}", flush=True)
    crossover = next((r["batch"] for r in rows if r["flash"] >= r["dense"]), None)
    del weight, head
    return {"hidden": hidden, "vocab": vocab, "clusters": c, "probes": min(p, c), "rows": rows,
            "crossover": crossover, "backend": "triton" if fused else "torch"}


def to_markdown(results: list[dict], device: torch.device, dtype: torch.dtype) -> str:
    out = [f"### FlashHead vs dense LM head ({device.type}, {str(dtype).replace('torch.', '')})", "",
           f"Machine: {machine_description()}", "",
           f"Command: `{command_line()}`", "",
           "Greedy decode step (ms, median). Dense = `argmax(hidden @ W.T)` (faster of `F.linear` and "
           "`mm(W, hidden.T)`); FlashHead = centroid scoring + "
           "top-P + exact scoring of the P x 16 candidate rows. Random heads with a random balanced "
           "assignment (timing does not depend on cluster quality). Crossover = smallest measured batch "
           "at which dense is at least as fast. On a shared machine timings are noisy (see the load average above); "
           "with 2 threads under load every OpenMP barrier can cost a scheduler tick, `--threads 1` is steadier.",
           ""]
    for r in results:
        fused = any(x["fused"] is not None for x in r["rows"])
        out.append(f"**V = {r['vocab']:,}, H = {r['hidden']:,}** ({r['clusters']:,} clusters, "
                   f"{r['probes']} probes, {r['clusters'] + 16 * r['probes']:,} scored rows, {r['backend']})")
        out.append("")
        head = "| batch | dense ms | FlashHead ms | speed-up |" + (" fused dense argmax ms | vs fused |" if fused else "")
        out.append(head)
        out.append("|---:|---:|---:|---:|" + ("---:|---:|" if fused else ""))
        for x in r["rows"]:
            line = f"| {x['batch']} | {x['dense']:.2f} | {x['flash']:.2f} | {x['dense'] / x['flash']:.2f}x |"
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
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds spent per measurement at least")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    hidden = args.hidden or ([2048] if args.quick else FULL_HIDDEN)
    vocab = args.vocab or ([128256] if args.quick else FULL_VOCAB)
    batches = args.batches or ([1, 2, 4, 8, 16, 32, 64] if args.quick else FULL_BATCHES)
    print(machine_description())
    results = []
    for v in vocab:
        for h in hidden:
            results.append(bench_shape(h, v, batches, device, dtype, args.n_probes, args.repeats, args.min_time))
            r = results[-1]
            print(f"  -> crossover batch: {r['crossover'] if r['crossover'] is not None else 'none measured'}")
    md = to_markdown(results, device, dtype)
    if not args.no_write:
        path = write_section("head", md)
        print(f"wrote the head section of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
