"""GPU readiness check for FlashHead: Triton kernels against the torch reference, then timing as served.

Needs torch and Triton only (never vLLM). Two parts:

1. Correctness, per case (vocabulary x hidden size x batch x dtype, odd sizes included):
   - stage 1: the probed clusters are a top-P of the centroid scores computed in float32;
   - stage 2: the Triton candidate logits (and the torch path's) match float32 logits of the
     same candidates within the dtype's tolerance (``TOLERANCES``), with identical token ids;
   - step: ``FlashHead.step_logits`` on the Triton backend (what serving calls) is finite exactly
     on the candidates and the pinned ids, and its argmax is a candidate whose float32 logit is the
     best within tolerance, at the default probe count and at full probes (then against the dense head);
   - ties: the smallest token id wins among equal logits.
   One line per case; the exit status is 1 when any case fails.
2. Timing (CUDA only), with ``triton.testing`` (median ms), of the serving path: ``step_logits`` for
   greedy rows, sampled rows and a mixed batch, with pinned ids, against dense ``F.linear`` into the
   same ``[B, V]`` logits, batch 1 to 256.  By default each step is captured in a CUDA graph and
   replayed (``--eager`` times eager launches instead).  Then, per head, what a server's start-up timing
   decides: FlashHead's kernels serve, or the head stands down (``slower_than_dense``).

    python -m bench.gpu_check                      # CUDA: correctness, then timing (CUDA graphs)
    python -m bench.gpu_check --json gpu.json      # also write every figure as JSON
    python -m bench.gpu_check --eager              # time eager launches instead of graph replays
    python -m bench.gpu_check --no-correctness     # timing only
    python -m bench.gpu_check --interpret          # no GPU: correctness only, Triton interpreter, tiny shapes

Exit status: 0 every case passed, 1 a correctness case failed, 2 no CUDA device (without ``--interpret``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch

from bench._report import fitted_tail_factors, int_list, shape_list
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.kernels import torch_ref, triton_available
from my_pkg.flashhead.kernels.tolerances import TOLERANCES, Tolerance
from my_pkg.flashhead.tail_estimate import TailFactors

EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 2
CLUSTER_SIZE = 16

# Shapes of real heads, odd ones included: Llama-2 32000, Llama-3 128256, Qwen2 151936, GPT-2 50257.
GPU_VOCABS = (32000, 128256, 151936, 50257)
GPU_HIDDENS = (2048, 4096, 896)
GPU_BATCHES = (1, 3, 8, 64)
# The interpreter runs every Triton program on the CPU: a few tiny shapes, sizes not multiples of anything.
INTERPRET_SHAPES = ((333, 129, 3), (517, 37, 1))
TIMING_SHAPES = ((128256, 2048), (128256, 4096), (151936, 896))
TIMING_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TIMING_KINDS = ("greedy", "sampled", "mixed")
PINNED = 3  # EOS and the like, scored on every row


DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class CaseResult:
    """Outcome of one correctness case; ``errors`` is empty when it passed."""

    name: str
    dtype: str
    vocab: int = 0
    hidden: int = 0
    batch: int = 0
    probes: int = 0
    logits_max_error: float = 0.0
    torch_path_max_error: float = 0.0
    argmax_matches_torch_path: bool = True  # informative: rounding may pick another equally good token
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.errors

    def line(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        if self.vocab:
            detail = (
                f"V={self.vocab:<6d} H={self.hidden:<4d} B={self.batch:<2d} P={self.probes:<3d} "
                f"logits err {self.logits_max_error:.1e} (torch path {self.torch_path_max_error:.1e})"
            )
        else:
            detail = self.name
        return f"{status} {self.dtype:4s} {detail}" + ("".join(f"\n       - {e}" for e in self.errors))


@dataclass
class RandomHead:
    """A random head with a balanced cluster map, shaped like a real one (padded rows included)."""

    weight: torch.Tensor  # [V', H], V' = V rounded up to a multiple of 64, like vLLM's padded heads
    centroids: torch.Tensor
    assignments: torch.Tensor
    vocab: int

    @classmethod
    def make(cls, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int) -> RandomHead:
        g = torch.Generator(device=device).manual_seed(seed)
        rows = vocab + (-vocab) % 64
        scale = 2.0 / math.sqrt(hidden)  # logits of a few units, as in trained heads
        weight = (torch.randn(rows, hidden, generator=g, device=device) * scale).to(dtype)
        num_clusters = math.ceil(vocab / CLUSTER_SIZE)
        centroids = (torch.randn(num_clusters, hidden, generator=g, device=device) * scale).to(dtype)
        cpu_g = torch.Generator().manual_seed(seed)
        assignments = torch.arange(vocab) % num_clusters  # sizes differ by at most one: padded clusters
        assignments = assignments[torch.randperm(vocab, generator=cpu_g)]
        return cls(weight, centroids, assignments, vocab)

    @cached_property
    def weight_fp32(self) -> torch.Tensor:
        """The head in float32, the reference's precision (made on first use: up to 2.5 GB)."""
        return self.weight.float()

    def flashhead(self, backend: str, n_probes: int, tail_factors: TailFactors | None = None) -> FlashHead:
        return FlashHead(
            self.weight,
            self.centroids,
            self.assignments,
            vocab_size=self.vocab,
            n_probes=n_probes,
            backend=backend,
            tail_factors=tail_factors,
        )


def _exceeds(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> tuple[float, bool]:
    error = (got.float() - want).abs()
    return float(error.max()), bool((error > tol.bound(want)).any())


def _check_best(token: torch.Tensor, reference: torch.Tensor, best: torch.Tensor, tol: Tolerance) -> int:
    """Rows whose chosen token's float32 logit falls short of the best by more than the tolerance."""
    picked = reference.gather(1, token.view(-1, 1)).squeeze(1)
    return int((picked < best - tol.bound(best)).sum())


def check_case(head: RandomHead, batch: int, seed: int) -> CaseResult:
    """Stage 1, stage 2 and the served step of the Triton backend against float32 torch math, for one batch."""
    from my_pkg.flashhead.kernels import triton_kernels

    dtype, device = head.weight.dtype, head.weight.device
    tol = TOLERANCES[dtype]
    num_clusters = head.centroids.shape[0]
    n_probes = default_n_probes(num_clusters)
    triton_head = head.flashhead("triton", n_probes)
    result = CaseResult(
        name="case",
        dtype=DTYPE_NAMES[dtype],
        vocab=head.vocab,
        hidden=head.weight.shape[1],
        batch=batch,
        probes=n_probes,
    )
    errors = result.errors
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(batch, head.weight.shape[1], generator=g, device=device).to(dtype)
    hidden_fp32 = hidden.float()
    dense_fp32 = torch.nn.functional.linear(hidden_fp32, head.weight_fp32)  # [B, V'] reference logits

    # Stage 1: every probed cluster scores within tolerance of the P-th best float32 score.
    probes = triton_head.select_probes(hidden)
    scores_fp32 = torch.nn.functional.linear(hidden_fp32, triton_head.centroids.float())
    kth_best = scores_fp32.topk(n_probes, dim=1).values[:, -1:]
    chosen = scores_fp32.gather(1, probes)
    if bool((chosen < kth_best - tol.bound(kth_best)).any()):
        errors.append("stage 1: a probed cluster is not among the top-P centroid scores")
    if bool((probes.sort(dim=1).values.diff(dim=1) == 0).any()):
        errors.append("stage 1: a cluster is probed twice in one row")

    # Stage 2: candidate ids and logits.
    ids, logits = triton_kernels.candidate_logits(hidden, head.weight, triton_head.members, probes)
    want_ids = torch_ref.candidate_ids(triton_head.members, probes)
    if not torch.equal(ids, want_ids):
        errors.append("stage 2: candidate token ids differ from the cluster map")
    if logits.dtype != dtype:
        errors.append(f"stage 2: logits are {logits.dtype}, expected {dtype}")
    if bool((want_ids >= head.vocab).any()):
        errors.append("stage 2: a candidate lies in the head's padding rows")
    want_logits = dense_fp32.gather(1, want_ids)
    result.logits_max_error, bad = _exceeds(logits, want_logits, tol)
    if bad:
        errors.append(f"stage 2: Triton logits off by {result.logits_max_error:.3g} (tolerance {tol})")
    torch_ids, torch_logits = torch_ref.candidate_logits(hidden, head.weight, triton_head.members, probes)
    result.torch_path_max_error, bad = _exceeds(torch_logits, want_logits, tol)
    if not torch.equal(torch_ids, want_ids) or bad:
        errors.append(f"stage 2: torch path off by {result.torch_path_max_error:.3g} (tolerance {tol})")

    # The served step over the default probes: finite exactly on the candidates and pinned ids; its argmax
    # (pins left out) a candidate, and the best one within tolerance.
    pins = torch.tensor([0, head.vocab - 1], device=device)
    step = triton_head.step_logits(hidden, pinned=pins)
    finite = torch.zeros(step.shape, dtype=torch.bool, device=device).scatter_(1, want_ids, True)
    finite[:, pins] = True
    if not torch.equal(torch.isfinite(step), finite):
        errors.append("step: finite logits are not exactly the candidates and the pinned ids")
    token = triton_head.step_logits(hidden).argmax(dim=1)
    if not bool((want_ids == token.view(-1, 1)).any(dim=1).all()):
        errors.append("step: the argmax is not a candidate of its row")
    elif short := _check_best(token, dense_fp32, want_logits.max(dim=1).values, tol):
        errors.append(f"step: {short} row(s) pick a token worse than the best candidate beyond tolerance")
    torch_step = head.flashhead("torch", n_probes).step_logits(hidden)
    result.argmax_matches_torch_path = torch.equal(token, torch_step.argmax(dim=1))

    # Full probes: FlashHead is the dense head.
    triton_head.n_probes = num_clusters
    token = triton_head.step_logits(hidden).argmax(dim=1)
    dense_best = dense_fp32[:, : head.vocab].max(dim=1).values
    if bool((token >= head.vocab).any()) or bool((token < 0).any()):
        errors.append("full probes: the argmax is a token outside the vocabulary")
    elif short := _check_best(token, dense_fp32, dense_best, tol):
        errors.append(f"full probes: {short} row(s) differ from the dense argmax beyond tolerance")
    return result


def check_ties(dtype: torch.dtype, device: torch.device) -> CaseResult:
    """Equal maximal logits in three clusters (all logits negative): the smallest token id wins."""
    result = CaseResult(name="tie rule: equal maxima at tokens 9, 20, 40 -> 9", dtype=DTYPE_NAMES[dtype])
    weight = torch.zeros(48, 4)
    weight[:, 0] = -torch.arange(48, dtype=torch.float32) - 1.0
    weight[[40, 20, 9], 0] = -0.5
    head = FlashHead(
        weight.to(device, dtype),
        torch.randn(3, 4).to(device, dtype),
        torch.arange(48) % 3,
        n_probes=3,
        backend="triton",
    )
    got = head.step_logits(torch.tensor([[1.0, 0, 0, 0]], device=device, dtype=dtype)).argmax(dim=1).tolist()
    if got != [9]:
        result.errors.append(f"expected token 9, got {got}")
    return result


def run_correctness(
    device: torch.device,
    shapes: list[tuple[int, int, int]],
    dtypes: list[torch.dtype],
    report: Callable[[CaseResult], None],
) -> list[CaseResult]:
    """Every (vocab, hidden, batch) shape in every dtype, one head per (vocab, hidden, dtype)."""
    results: list[CaseResult] = []

    def record(case: CaseResult) -> None:
        results.append(case)
        report(case)

    for dtype in dtypes:
        record(check_ties(dtype, device))
        heads: dict[tuple[int, int], RandomHead] = {}
        for seed, (vocab, hidden, batch) in enumerate(shapes):
            key = (vocab, hidden)
            if key not in heads:
                heads.clear()  # one head alive at a time: the largest float32 copy is 2.5 GB
                heads[key] = RandomHead.make(vocab, hidden, dtype, device, seed=len(results))
            try:
                record(check_case(heads[key], batch, seed))
            except Exception as exc:  # noqa: BLE001 - a crashing case is a failed case; keep checking
                record(
                    CaseResult(
                        name=f"V={vocab} H={hidden} B={batch}",
                        dtype=DTYPE_NAMES[dtype],
                        vocab=vocab,
                        hidden=hidden,
                        batch=batch,
                        errors=[f"raised {type(exc).__name__}: {exc}"],
                    )
                )
        heads.clear()
    return results


@contextmanager
def exact_matmuls() -> Iterator[None]:
    """float32 references in float32 (no TF32) and fp16/bf16 torch-path matmuls that round once, as the
    tolerances assume; vLLM's defaults come back afterwards, for the timing."""
    matmul = torch.backends.cuda.matmul
    names = ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
    saved = {name: getattr(matmul, name) for name in names}
    try:
        for name in names:
            setattr(matmul, name, False)
        yield
    finally:
        for name, value in saved.items():
            setattr(matmul, name, value)


# ---- timing ------------------------------------------------------------------------------------


def sampled_mask(kind: str, batch: int):
    """The ``sampled`` argument serving passes for a batch of this kind (mixed: every other row samples)."""
    import numpy as np

    return {"greedy": np.zeros(batch, bool), "sampled": np.ones(batch, bool), "mixed": np.arange(batch) % 2 == 1}[kind]


def _bench(fn: Callable[[], Any], cuda_graphs: bool) -> float:
    import triton.testing

    if cuda_graphs:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def startup_verdict(flash: FlashHead, dense_weight: torch.Tensor, pins: torch.Tensor) -> str | None:
    """What a server's start-up timing decides for this head (``measure_step_costs`` on the device's clock, then
    ``StepCosts.slower_than_dense``): None when FlashHead's kernels serve, else why the head stands down."""
    from my_pkg.flashhead.step_costs import measure_step_costs

    costs = measure_step_costs(
        lambda hidden, sampled: flash.step_logits(hidden, sampled=sampled, pinned=pins),
        lambda hidden: torch.nn.functional.linear(hidden, dense_weight),
        dense_weight.shape[1],
        dtype=dense_weight.dtype,
        sampled_rows=True,
        device=dense_weight.device,
    )
    return costs.slower_than_dense()


def run_timing(
    device: torch.device,
    shapes: list[tuple[int, int]],
    batches: list[int],
    dtype: torch.dtype,
    cuda_graphs: bool,
    kinds: tuple[str, ...] = TIMING_KINDS,
) -> list[dict[str, Any]]:
    """Median ms of one served step (``step_logits``) per kind, and of the dense head into the same logits."""
    tables = []
    print(f"\ntiming: median ms of {'CUDA-graph replays' if cuda_graphs else 'eager launches'} (triton.testing)")
    for vocab, hidden in shapes:
        head = RandomHead.make(vocab, hidden, dtype, device, seed=0)
        num_clusters = head.centroids.shape[0]
        n_probes = default_n_probes(num_clusters)
        flash = head.flashhead("triton", n_probes, fitted_tail_factors(head.weight, vocab))  # as a default build
        dense_weight = head.weight[:vocab]
        pins = torch.arange(vocab - PINNED, vocab, device=device)
        flash.step_logits(torch.zeros(1, hidden, device=device, dtype=dtype), sampled=sampled_mask("sampled", 1))
        print(
            f"\nV={vocab:,} H={hidden:,} {DTYPE_NAMES[dtype]}: {num_clusters:,} clusters, {n_probes} probes; sampled "
            f"rows {flash.sampled_n_probes} probes + rank-{flash.sampled_rank} estimate + {flash.sampled_rescore:,} "
            f"best-estimated tokens; {PINNED} pinned ids"
        )
        print("batch | dense ms | " + " | ".join(f"{k} ms | vs dense" for k in kinds) + " | stage 1 ms")
        rows = []
        for batch in batches:
            h = torch.randn(batch, hidden, device=device).to(dtype)
            row: dict[str, Any] = {
                "batch": batch,
                "dense_ms": _bench(partial(torch.nn.functional.linear, h, dense_weight), cuda_graphs),
                "stage1_ms": _bench(partial(flash.select_probes, h), cuda_graphs),
            }
            cells = []
            for kind in kinds:
                if kind == "mixed" and batch == 1:
                    continue
                mask = sampled_mask(kind, batch)
                flash.step_logits(h, sampled=mask, pinned=pins)  # warm-up outside any capture
                ms = _bench(partial(flash.step_logits, h, sampled=mask, pinned=pins), cuda_graphs)
                row[f"{kind}_ms"], row[f"{kind}_speedup"] = ms, row["dense_ms"] / ms
                cells.append(f"{ms:8.4f} | {row['dense_ms'] / ms:6.2f}x")
            print(
                f"{batch:5d} | {row['dense_ms']:8.4f} | " + " | ".join(cells) + f" | {row['stage1_ms']:.4f}", flush=True
            )
            rows.append(row)
        verdict = startup_verdict(flash, dense_weight, pins)
        print("start-up timing, as a server times it: " + (verdict or "FlashHead's kernels serve"), flush=True)
        tables.append(
            {
                "startup_stands_down": verdict,
                "vocab": vocab,
                "hidden": hidden,
                "dtype": DTYPE_NAMES[dtype],
                "clusters": num_clusters,
                "probes": n_probes,
                "sampled_probes": flash.sampled_n_probes,
                "rank": flash.sampled_rank,
                "rescore": flash.sampled_rescore,
                "pinned": PINNED,
                "rows": rows,
            }
        )
        del head, flash
        torch.cuda.empty_cache()
    return tables


# ---- command line ------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    info = {
        "torch": str(torch.__version__),
        "triton": str(triton.__version__),
        "python": platform.python_version(),
        "device": device.type,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="no GPU needed: correctness only, on CPU tensors under TRITON_INTERPRET=1, tiny shapes",
    )
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every figure to FILE")
    ap.add_argument("--no-timing", action="store_true", help="correctness only")
    ap.add_argument("--no-correctness", action="store_true", help="timing only (CUDA)")
    ap.add_argument(
        "--timing-shapes",
        type=shape_list,
        default=list(TIMING_SHAPES),
        metavar="VxH,...",
        help="heads to time (default: 128256x2048,128256x4096,151936x896)",
    )
    ap.add_argument("--batches", type=int_list, default=list(TIMING_BATCHES), help="timed batch sizes")
    ap.add_argument("--timing-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replays")
    args = ap.parse_args(argv)

    if args.interpret:
        # Read when the kernels are decorated: set before the Triton kernels module is first imported.
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        shapes = list(INTERPRET_SHAPES)
    else:
        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device is visible, so there is nothing to check here. Run it on a CUDA "
                "machine, or pass --interpret for the correctness part on CPU under the Triton interpreter."
            )
            return EXIT_NO_CUDA
        device = torch.device("cuda")
        shapes = [(v, h, b) for v in GPU_VOCABS for h in GPU_HIDDENS for b in GPU_BATCHES]
    if not triton_available():
        print("gpu_check: Triton cannot be imported; install the Triton build that matches torch.")
        return EXIT_FAILED

    info = environment(device)
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    dtypes = list(TOLERANCES)
    print(
        "tolerances: " + "; ".join(f"{DTYPE_NAMES[d]} atol {t.atol:g} rtol {t.rtol:g}" for d, t in TOLERANCES.items())
    )
    results: list[CaseResult] = []
    if not args.no_correctness:
        with exact_matmuls():
            results = run_correctness(device, shapes, dtypes, lambda case: print(case.line(), flush=True))
    failed = [r for r in results if not r.passed]
    differ = sum(not r.argmax_matches_torch_path for r in results)
    if results:
        print(
            f"correctness: {len(results) - len(failed)}/{len(results)} cases passed"
            + (f" ({differ} where the argmax differs from the torch path's within tolerance)" if differ else "")
        )

    timing = []
    if not args.interpret and not args.no_timing:
        timing = run_timing(device, args.timing_shapes, args.batches, getattr(torch, args.timing_dtype), not args.eager)
    if args.json is not None:
        payload = {
            "environment": info,
            "tolerances": {DTYPE_NAMES[d]: asdict(t) for d, t in TOLERANCES.items()},
            "correctness": [{**asdict(r), "passed": r.passed} for r in results],
            "timing": timing,
            "timing_mode": "eager" if args.eager else "cuda_graphs",
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    if failed:
        print(f"gpu_check: {len(failed)} case(s) FAILED")
        return EXIT_FAILED
    print("gpu_check: all checks passed")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
