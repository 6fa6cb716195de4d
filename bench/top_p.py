"""vLLM's CPU top-k/top-p against the sort-free exact one, side by side in one process.

What is timed is the function vLLM's CPU sampler calls when a batch has a top-p,
`apply_top_k_top_p_pytorch(logits, None, p, allow_cpu_sync=True)`. vLLM's own version sorts every row.
The patched one (`my_pkg.engine.patches.top_p_sampler`, `my_pkg.sampling.top_p`) takes a window of 1,024
logits and one normaliser, and sends only the rows the window cannot decide to vLLM's sort.

The logits have a trained LM's shape: a Gaussian floor (sd 2) with 50 tokens at random positions raised
by 12, divided by T = 0.7; every row has p = 0.9. Each call masks a fresh copy of the same logits, so
both sides include one copy (shown in the `copy` column). Each figure is the median over `--rounds`
paired rounds (vLLM, then the patched one) of the median of `--repeats` calls. The `sorted rows` column
counts the rows the patched function sent to vLLM's sort.

Needs vLLM (vLLM's CPU build). Single thread by default.

    python -m bench.top_p                       # V 32,768 / 128,256 / 262,144, batch 1, 8, 32, 1 thread
    python -m bench.top_p --vocabs 262144 --batches 8 --no-write
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch

from bench._report import command_line, int_list, machine_description, median_ms, paired_rounds, write_section

TEMPERATURE, TOP_P, RAISED, RAISE_BY = 0.7, 0.9, 50, 12.0


def peaked_logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 2.0
    raised = torch.rand(batch, vocab, generator=g).topk(RAISED, dim=1).indices  # random positions per row
    logits.scatter_add_(1, raised, torch.full(raised.shape, RAISE_BY))
    return logits / TEMPERATURE


def _masked_copy(fn, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return fn(logits.clone(), None, p, True)


def run(args: argparse.Namespace) -> list[dict]:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from my_pkg.engine.patches import top_p_sampler

    vllm_fn = getattr(apply_top_k_top_p_pytorch, "__wrapped__", apply_top_k_top_p_pytorch)
    patched_fn = top_p_sampler.wrap(vllm_fn)
    rows = []
    for vocab in args.vocabs:
        for batch in args.batches:
            logits = peaked_logits(batch, vocab)
            p = torch.full((batch,), TOP_P)
            before = top_p_sampler.counters()
            ours = patched_fn(logits.clone(), None, p, True)
            sorted_rows = top_p_sampler.counters()["sorted_rows"] - before["sorted_rows"]
            theirs = vllm_fn(logits.clone(), None, p, True)
            same = bool(torch.equal(ours == float("-inf"), theirs == float("-inf")))
            kept = (theirs > float("-inf")).sum(dim=1).float()
            timing = paired_rounds(
                partial(_masked_copy, vllm_fn, logits, p),
                partial(_masked_copy, patched_fn, logits, p),
                args.rounds,
                args.repeats,
            )
            row = {
                "vocab": vocab,
                "batch": batch,
                "vllm_ms": timing["dense_ms"],
                "patched_ms": timing["ms"],
                "ratio": timing["ratio"],
                "min": timing["min"],
                "max": timing["max"],
                "copy_ms": median_ms(logits.clone, args.repeats),
                "sorted_rows": sorted_rows,
                "nucleus": statistics.median(kept.tolist()),
                "same_mask": same,
            }
            rows.append(row)
            print(
                f"  V={vocab:,} B={batch}: vLLM {row['vllm_ms']:.2f} ms, patched {row['patched_ms']:.2f} ms, "
                f"x{row['ratio']:.1f} (rounds {row['min']:.1f}-{row['max']:.1f}); copy {row['copy_ms']:.2f} ms; "
                f"sorted rows {sorted_rows}/{batch}; nucleus {row['nucleus']:.0f} tokens; same mask: {same}",
                flush=True,
            )
    return rows


def to_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "### Top-k / top-p on CPU: vLLM's sort against the sort-free patch",
        "",
        machine_description(),
        "",
        f"Command: `{command_line()}`; {torch.get_num_threads()} thread(s), {args.rounds} rounds of {args.repeats} "
        f"calls; p = {TOP_P}, T = {TEMPERATURE}, peaked logits (median nucleus in the table).",
        "",
        "| V | batch | vLLM (sort) ms | patched ms | speed-up (rounds) | copy ms | sorted rows | nucleus | same mask |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']:,} | {r['batch']} | {r['vllm_ms']:.2f} | {r['patched_ms']:.2f} "
            f"| {r['ratio']:.1f}x ({r['min']:.1f}-{r['max']:.1f}) | {r['copy_ms']:.2f} | {r['sorted_rows']} "
            f"| {r['nucleus']:.0f} | {'yes' if r['same_mask'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", type=int_list, default=[32768, 128256, 262144])
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="calls per measurement (median)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_description())
    print(f"Command: `{command_line()}`", flush=True)
    with torch.inference_mode():
        rows = run(args)
    markdown = to_markdown(rows, args)
    print(markdown)
    if not args.no_write:
        print(f"wrote {write_section('top-p', markdown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
