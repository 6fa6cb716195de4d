"""Where a FlashHead step's time goes on a GPU: each CUDA kernel's time in one served step, beside the dense head.

``torch.profiler`` records ``--steps`` eager calls of ``FlashHead.step_logits`` (greedy rows, then sampled rows,
3 pinned ids, as ``bench.gpu_check`` times them) and of the dense head ``F.linear(hidden, W[:V])`` after warm-up
calls, and prints, per shape and batch, the device time of each kernel per step (summed over its launches), the
launches per step, and the step's wall time on the host (synchronised) against the sum of its kernels: a wall time
far above the kernels' sum is launch overhead and host work between the launches.  Then stage 1's probe choice
alone, as served (int64 keys that order ties) against a plain float ``topk`` and 32-bit keys, in CUDA-graph
replays.  Random head, random balanced assignment, the builder's default probes and the fitted sampled-row
estimate of a default build.

Needs a CUDA device and torch + Triton only (no vLLM).

    python -m bench.experiments.gpu_step_profile                                  # 128,256 x 2,048, batch 1 and 64
    python -m bench.experiments.gpu_step_profile --shapes 262144x640 --batches 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from bench._report import int_list, shape_list
from bench.gpu_check import PINNED, RandomHead
from my_pkg.flashhead import default_n_probes

_TOP_KERNELS = 8


def _profile(fn: Callable[[], Any], steps: int) -> tuple[dict[str, tuple[float, int]], float]:
    """Per kernel name: (device ms per step, launches per step); and the step's synchronised wall ms."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        entry = totals[event.name]
        entry[0] += event.device_time_total / 1e3  # us -> ms
        entry[1] += 1
    return {name: (ms / steps, count // steps) for name, (ms, count) in totals.items()}, wall_ms


def _report(label: str, kernels: dict[str, tuple[float, int]], wall_ms: float) -> None:
    device_ms = sum(ms for ms, _ in kernels.values())
    launches = sum(count for _, count in kernels.values())
    print(f"  {label}: wall {wall_ms:.4f} ms, kernels {device_ms:.4f} ms in {launches} launches")
    for name, (ms, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:_TOP_KERNELS]:
        print(f"      {ms:8.4f} ms  x{count:<3d} {name[:110]}")


def half_precision_probes(scores: torch.Tensor, n_probes: int) -> torch.Tensor:
    """:func:`my_pkg.flashhead.probes.select_probes` from 32-bit keys, for bf16/fp16 scores and at most 65,536
    clusters: the score's 16 bits mapped to an int that sorts like the score, times ``2**16``, plus
    ``2**16 - 1 - id``; the same clusters in the same order (widening a half-precision score to float32, as the
    served 64-bit keys do, keeps its order)."""
    if scores.dtype not in (torch.bfloat16, torch.float16) or scores.shape[1] > 1 << 16:
        raise ValueError("32-bit keys need bf16/fp16 scores and at most 65,536 clusters")
    bits = scores.contiguous().view(torch.int16).to(torch.int32)
    ordered = bits ^ ((bits >> 15) & 0x7FFF)  # negative scores: reverse their magnitude order
    ids = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int32)
    keys = ordered * (1 << 16) + ((1 << 16) - 1 - ids)
    top = torch.topk(keys, n_probes, dim=-1, sorted=True).values
    return ((1 << 16) - 1 - (top & 0xFFFF)).long()


def stage1_selection_ms(scores: torch.Tensor, n_probes: int) -> dict[str, float]:
    """Device ms (CUDA-graph replays, median) of choosing the probes from stage 1's scores ``[B, C]``: as served
    (int64 keys, the smaller id first on ties, ``topk(sorted=True)``: :func:`my_pkg.flashhead.probes.select_probes`),
    against a plain ``topk`` of the float scores, sorted and unsorted (no tie rule, for scale only), and for
    half-precision scores the same choice from 32-bit keys (:func:`half_precision_probes`)."""
    import triton.testing

    from my_pkg.flashhead.probes import select_probes

    runs = {
        "served (int64 keys, sorted)": lambda: select_probes(scores, n_probes),
        "float topk, sorted": lambda: torch.topk(scores, n_probes, dim=1, sorted=True),
        "float topk, unsorted": lambda: torch.topk(scores, n_probes, dim=1, sorted=False),
    }
    if scores.dtype in (torch.bfloat16, torch.float16):
        runs["32-bit keys, sorted"] = lambda: half_precision_probes(scores, n_probes)
    return {
        name: float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")) for name, fn in runs.items()
    }


def profile_shape(
    vocab: int, hidden_size: int, batches: list[int], dtype: torch.dtype, steps: int, device: str = "cuda"
) -> None:
    """Every batch of one head shape: the dense head's and each kind of FlashHead step's kernels, then stage 1's
    probe choice alone."""
    from bench._report import fitted_tail_factors

    head = RandomHead.make(vocab, hidden_size, dtype, torch.device(device), seed=0)
    n_probes = default_n_probes(head.centroids.shape[0])
    flash = head.flashhead("triton", n_probes, fitted_tail_factors(head.weight, vocab))
    dense_weight = head.weight[:vocab]
    pins = torch.arange(vocab - PINNED, vocab, device=device)
    print(f"\nV={vocab:,} H={hidden_size:,}: {head.centroids.shape[0]:,} clusters, {n_probes} probes")
    for batch in batches:
        hidden = torch.randn(batch, hidden_size, device=device).to(dtype)
        print(f" batch {batch}")
        runs: dict[str, Callable[[], Any]] = {
            "dense": partial(torch.nn.functional.linear, hidden, dense_weight),
            "greedy": partial(flash.step_logits, hidden, sampled=np.zeros(batch, bool), pinned=pins),
            "sampled": partial(flash.step_logits, hidden, sampled=np.ones(batch, bool), pinned=pins),
        }
        for label, fn in runs.items():
            kernels, wall_ms = _profile(fn, steps)
            _report(label, kernels, wall_ms)
        scores = flash.kernels.stage1_scores(hidden, flash.centroids)
        choice = stage1_selection_ms(scores, n_probes)
        print("  stage 1's probe choice alone: " + ", ".join(f"{name} {ms:.4f} ms" for name, ms in choice.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shape_list, default=[(128256, 2048)], metavar="VxH,...")
    ap.add_argument("--batches", type=int_list, default=[1, 64])
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step_profile: no CUDA device is visible; this measures a GPU step only.")
        return 2
    print(f"gpu_step_profile: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}")
    for vocab, hidden_size in args.shapes:
        profile_shape(vocab, hidden_size, args.batches, getattr(torch, args.dtype), args.steps)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
