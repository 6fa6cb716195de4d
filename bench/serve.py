"""Decode throughput of a real vLLM server, FlashHead vs dense LM head, measured in one process.

For each model shape one random checkpoint is built (cached under ``--work-dir``) and converted
with ``python -m my_pkg flashhead build``; few k-means iterations are used, since cluster quality
changes which tokens come out, not how long a step takes.  One server serves the FlashHead model
in float32.  Dense and FlashHead are compared on that same server by switching
``PUT /plugins/my_pkg/flashhead {"enabled": ...}`` between measurements, in the order
dense, FlashHead, FlashHead, dense, ... over ``--rounds`` rounds so that drift cancels.

One measurement = C concurrent clients, each sending greedy completions of exactly
``--max-tokens`` tokens (``ignore_eos``) one after the other for ``--seconds`` (at least one
each); throughput = completion tokens / wall time until the last answer.  Around every
measurement the status route's row counters are read, to check that FlashHead rounds were
served by FlashHead and dense rounds were not.

    python -m bench.serve --quick                     # tiny model, a few minutes, prints only
    python -m bench.serve --write-docs                # both shapes, writes the serve section
    python -m bench.serve --shape llama-1b --llama-layers 8 --concurrency 1,8,32,64 --write-docs
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench._load import (
    DEFAULT_WORK_DIR,
    Admin,
    LoadResult,
    RowCounts,
    flashhead_server,
    prepare_flashhead_model,
    run_load,
)
from bench._report import command_line, machine_description, write_section
from tests.support.tiny_model import TinyLlamaSpec

MODES = ("dense", "flashhead")


@dataclass(frozen=True)
class Shape:
    key: str
    title: str
    spec: TinyLlamaSpec


def shapes(llama_layers: int) -> dict[str, Shape]:
    return {
        "head-heavy": Shape(
            "head-heavy",
            "head-heavy (Gemma-3-270M-like proportions)",
            TinyLlamaSpec(
                vocab_size=262144,
                hidden_size=640,
                intermediate_size=2048,
                num_hidden_layers=18,
                num_attention_heads=4,
                num_key_value_heads=1,
                tie_word_embeddings=True,
            ),
        ),
        "llama-1b": Shape(
            "llama-1b",
            f"Llama-3.2-1B-like, {llama_layers} of 16 layers",
            TinyLlamaSpec(
                vocab_size=128256,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=llama_layers,
                num_attention_heads=32,
                num_key_value_heads=8,
                tie_word_embeddings=True,
            ),
        ),
        "quick": Shape(
            "quick",
            "tiny smoke model",
            TinyLlamaSpec(
                vocab_size=32000,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
            ),
        ),
    }


@dataclass
class Measurement:
    mode: str
    round: int
    load: LoadResult
    rows: RowCounts

    @property
    def check(self) -> bool:
        """FlashHead rounds went (at least partly) through FlashHead; dense rounds never did."""
        if self.load.errors or self.load.completion_tokens == 0:
            return False
        return self.rows.flashhead > 0 if self.mode == "flashhead" else self.rows.flashhead == 0


@dataclass
class ShapeResult:
    shape: Shape
    n_probes: int
    num_clusters: int
    threshold: int
    backend: str | None
    runs: dict[int, list[Measurement]] = field(default_factory=dict)

    def tokens_per_s(self, concurrency: int, mode: str) -> float:
        ms = [m for m in self.runs[concurrency] if m.mode == mode]
        wall = sum(m.load.wall_s for m in ms)
        return sum(m.load.completion_tokens for m in ms) / wall if wall else 0.0

    def flash_share(self, concurrency: int) -> float:
        rows = [m.rows for m in self.runs[concurrency] if m.mode == "flashhead"]
        total = sum(r.total for r in rows)
        return sum(r.flashhead for r in rows) / total if total else 0.0

    def all_checked(self, concurrency: int) -> bool:
        return all(m.check for m in self.runs[concurrency])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def measure(
    url: str, model: str, admin: Admin, mode: str, rnd: int, args: argparse.Namespace, concurrency: int
) -> Measurement:
    admin.update(enabled=mode == "flashhead")
    before = RowCounts.of(admin.status())
    load = run_load(url, model, concurrency=concurrency, max_tokens=args.max_tokens, seconds=args.seconds)
    if load.errors == load.requests:
        raise RuntimeError(f"every completion failed ({mode}, C={concurrency}); see the server log")
    rows = RowCounts.of(admin.status()) - before
    m = Measurement(mode, rnd, load, rows)
    print(
        f"    C={concurrency:3d} round {rnd} {mode:9s}: {load.tokens_per_s:8.1f} tok/s  "
        f"({load.requests} requests, {load.completion_tokens} tokens, {load.wall_s:5.1f} s, "
        f"{load.errors} errors; rows flashhead {rows.flashhead}, dense {rows.dense or 0})"
        f"{'' if m.check else '  CHECK FAILED'}",
        flush=True,
    )
    return m


def bench_shape(shape: Shape, args: argparse.Namespace) -> ShapeResult:
    spec = shape.spec
    print(f"== {shape.title}: V={spec.vocab_size:,} H={spec.hidden_size:,} layers={spec.num_hidden_layers}", flush=True)
    name = f"{shape.key}-{spec.num_hidden_layers}l"
    model = prepare_flashhead_model(args.work_dir, name, spec, iterations=args.iterations)
    max_c = max(args.concurrency)
    server = flashhead_server(
        model,
        args.work_dir / "logs" / f"serve-{name}.log",
        max_model_len=args.max_tokens + 64,
        max_num_seqs=max(32, max_c),
    )
    t0 = time.perf_counter()
    with server:
        print(f"  server ready in {time.perf_counter() - t0:.0f} s (log: {server.log_path})", flush=True)
        admin = Admin(server.url)
        try:
            # The head is built on the first decode step; n_probes can be set only after that.
            run_load(server.url, server.model, concurrency=1, max_tokens=4, seconds=0)
            settings = {}
            if args.n_probes is not None:
                settings["n_probes"] = args.n_probes
            if args.dense_batch_threshold is not None:
                settings["dense_batch_threshold"] = args.dense_batch_threshold
            status = admin.update(**settings) if settings else admin.status()
            result = ShapeResult(
                shape,
                status["n_probes"],
                status["num_clusters"],
                status["dense_batch_threshold"],
                status.get("backend"),
            )
            print(
                f"  FlashHead: {result.num_clusters:,} clusters, n_probes {result.n_probes}, "
                f"dense_batch_threshold {result.threshold}, backend {result.backend}",
                flush=True,
            )
            for c in args.concurrency:
                run_load(server.url, server.model, concurrency=c, max_tokens=4, seconds=0)  # warm-up
                runs: list[Measurement] = []
                for rnd in range(args.rounds):
                    order = MODES if rnd % 2 == 0 else MODES[::-1]
                    runs += [measure(server.url, server.model, admin, mode, rnd, args, c) for mode in order]
                result.runs[c] = runs
                dense, flash = result.tokens_per_s(c, "dense"), result.tokens_per_s(c, "flashhead")
                print(
                    f"  C={c}: dense {dense:.1f} tok/s, FlashHead {flash:.1f} tok/s, "
                    f"x{flash / dense if dense else float('nan'):.2f}",
                    flush=True,
                )
            admin.update(enabled=True)
        finally:
            admin.close()
    return result


def table(result: ShapeResult) -> list[str]:
    lines = [
        "| concurrency | dense tok/s | FlashHead tok/s | FlashHead / dense | "
        "FlashHead rows in FlashHead rounds | check |",
        "|---:|---:|---:|---:|---:|:---:|",
    ]
    for c in sorted(result.runs):
        dense, flash = result.tokens_per_s(c, "dense"), result.tokens_per_s(c, "flashhead")
        ratio = f"{flash / dense:.2f}x" if dense else "n/a"
        lines.append(
            f"| {c} | {dense:.1f} | {flash:.1f} | {ratio} | {100 * result.flash_share(c):.0f}% | "
            f"{'ok' if result.all_checked(c) else 'FAILED'} |"
        )
    return lines


def to_markdown(results: list[ShapeResult], args: argparse.Namespace) -> str:
    out = [
        "### Serving: decode throughput, FlashHead vs dense (vLLM server, float32)",
        "",
        f"Machine: {machine_description()}",
        "",
        f"Command: `{command_line()}`",
        "",
        "One vLLM server per shape serves the FlashHead-converted random checkpoint; dense and FlashHead "
        'are measured on the same server by switching `PUT /plugins/my_pkg/flashhead {"enabled": ...}` '
        f"between measurements, alternating the order (dense, FlashHead, FlashHead, dense, ...) over "
        f"{args.rounds} round(s). Each measurement: C clients, each sending greedy completions of exactly "
        f"{args.max_tokens} tokens (`ignore_eos`) back to back for {args.seconds:g} s (at least one each); "
        "tokens/s = completion tokens / wall time until the last answer (prefill included, same for both "
        "modes). Clusters come from "
        f"{args.iterations} balanced k-means iteration(s) only: cluster quality changes which tokens are "
        'chosen, not the time per step. "FlashHead rows" = share of head rows that the status route\'s '
        "counters show served by FlashHead during the FlashHead rounds (the rest went dense, e.g. batch "
        'above `dense_batch_threshold`); "check" = no errors, FlashHead rows counted in every FlashHead '
        "round and none in any dense round.",
        "",
    ]
    for r in results:
        spec = r.shape.spec
        out += [
            f"**{r.shape.title}**: V = {spec.vocab_size:,}, H = {spec.hidden_size:,}, "
            f"{spec.num_hidden_layers} layers, intermediate {spec.intermediate_size:,}, "
            f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads, tied embeddings; "
            f"{r.num_clusters:,} clusters of 16, n_probes {r.n_probes}, dense_batch_threshold "
            f"{r.threshold} (server default unless the command sets it), backend {r.backend}.",
            "",
        ]
        out += table(r)
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["head-heavy", "llama-1b", "all"], default="all")
    ap.add_argument("--llama-layers", type=int, default=4, help="layers of the Llama-3.2-1B-like shape (real: 16)")
    ap.add_argument("--concurrency", type=_ints, default=None, help="default 1,8,32 (quick: 1,8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 64; quick: 16)")
    ap.add_argument("--seconds", type=float, default=None, help="per measurement (default 30; quick: 4)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-probes", type=int, default=None, help="set via PUT (default: the model's)")
    ap.add_argument("--dense-batch-threshold", type=int, default=None, help="set via PUT (default: the server's)")
    ap.add_argument("--iterations", type=int, default=None, help="k-means iterations (default 2; quick: 1)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="checkpoint cache and server logs")
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs (smoke test)")
    ap.add_argument("--write-docs", action="store_true", help="write the serve section of docs/benchmarks.md")
    args = ap.parse_args(argv)
    args.concurrency = args.concurrency or ([1, 8] if args.quick else [1, 8, 32])
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.seconds = args.seconds if args.seconds is not None else (4.0 if args.quick else 30.0)
    args.iterations = args.iterations or (1 if args.quick else 2)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    table_shapes = shapes(args.llama_layers)
    keys = ["quick"] if args.quick else (["head-heavy", "llama-1b"] if args.shape == "all" else [args.shape])
    print(machine_description())
    results = [bench_shape(table_shapes[k], args) for k in keys]
    md = to_markdown(results, args)
    print()
    print(md)
    if args.write_docs:
        print(f"wrote the serve section of {write_section('serve', md)}")
    failed = [r.shape.key for r in results for c in r.runs if not r.all_checked(c)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
