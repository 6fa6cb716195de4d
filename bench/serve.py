"""Decode throughput of a real vLLM server, FlashHead vs dense LM head, measured in one process.

For each model shape one random checkpoint is built (cached under ``--work-dir``) and converted
with ``python -m my_pkg flashhead build --no-calibration`` (the builder's default ``n_probes``), then given the
sampled rows' estimate a default build fits (fitted to random states: its cost does not depend on them); few
k-means iterations are used, since cluster quality changes which tokens come out, not how long a step takes.
One server serves the FlashHead model in float32.  Dense and FlashHead are compared on that same server by switching
``PUT /plugins/my_pkg/flashhead {"enabled": ...}`` between measurements, in the order
dense, FlashHead, FlashHead, dense, ... over ``--rounds`` rounds so that drift cancels.

One measurement = C concurrent clients, each sending completions of exactly ``--max-tokens``
tokens (``ignore_eos``) one after the other for ``--seconds`` (at least one each), all greedy
or all sampled (``--traffic``: temperature 0.7, top_p 0.9); throughput = completion tokens /
wall time until the last answer.  Each (concurrency, traffic) gets ``--rounds`` paired rounds;
the table gives the median FlashHead / dense ratio of the rounds and its spread.  Around every
measurement the status route's row counters are read, to check that FlashHead rounds were
served by FlashHead (sampled rows included; under ``--spec`` the verify rows too, and the drafter's rows
in the variant that drafts with FlashHead) and dense rounds were not.  ``--write-docs`` also
states the targets (C = 1: >= 2.2x head-heavy, >= 1.8x Llama-1B-like; >= 1.0x everywhere) and
whether they were met.  The measuring time is at least shapes x concurrencies x traffics x
rounds x 2 x ``--seconds`` (printed at the start); bound it with those options.

    python -m bench.serve --quick                     # tiny model, ~8 min with its first build, prints only
    python -m bench.serve --write-docs                # both shapes, writes the serve section
    python -m bench.serve --shape llama-1b --traffic sampled --concurrency 1 --rounds 3 --seconds 20

Under speculative decoding (``--spec ngram|draft|eagle``, 3 speculative tokens, concurrency 1 and 8 unless given;
prints only): one server per variant, each compared with its own dense rounds (``enabled`` off turns the
drafter's FlashHead head off too), with vLLM's acceptance rate of each mode.  ``ngram``: FlashHead verify.
``draft``: FlashHead verify (the draft model is the assetless random checkpoint: a dense drafter), then
FlashHead verify + draft (the draft model is the FlashHead checkpoint itself).  Both drafters are the target's
own weights, as large as the target: the ratios say what FlashHead changes in such a step, not what a small
trained drafter gains.  ``eagle``: FlashHead verify + draft with a one-layer EAGLE head built for the shape
(``tests/support/tiny_eagle.py``, untrained: it passes the target's hidden state through one small random
layer), which computes its drafts with the target's LM head, as a real EAGLE head does: a small drafter whose
cost is mostly that head.

    python -m bench.serve --quick --spec draft
    python -m bench.serve --shape head-heavy --spec eagle --concurrency 1 --traffic greedy --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench._load import (
    DEFAULT_WORK_DIR,
    TRAFFIC,
    Admin,
    LoadResult,
    RowCounts,
    flashhead_server,
    prepare_flashhead_model,
    run_load,
)
from bench._report import command_line, int_list, machine_description, write_section
from my_pkg.contract import DenseReason
from tests.support.tiny_model import TinyLlamaSpec

MODES = ("dense", "flashhead")
#: Speculative decoding under `--spec`: the n-gram proposer, a draft model or an EAGLE head, 3 tokens per step.
SPEC_METHODS = ("ngram", "draft", "eagle")
NUM_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class SpecVariant:
    """One server of a `--spec` run: what its FlashHead rounds serve, and its `--speculative-config`."""

    label: str
    config: dict
    flashhead_drafts: bool = False  # its FlashHead rounds draft with FlashHead (the draft model has assets)


def eagle_head_dir(base_model: Path) -> Path:
    """Where `--spec eagle` builds the EAGLE head of the shape whose random checkpoint is `base_model`."""
    return base_model.parent / f"{base_model.name}-eagle"


def spec_variants(method: str | None, flashhead_model: Path, base_model: Path) -> list[SpecVariant]:
    """The servers a `--spec` run starts for one shape (one variant without speculation: `method` None)."""
    if method is None:
        return [SpecVariant("", {})]
    if method == "ngram":
        ngram = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2}
        return [SpecVariant("FlashHead verify", {**ngram, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})]
    if method == "draft":
        return [
            SpecVariant(
                "FlashHead verify",
                {"method": "draft_model", "model": str(base_model), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
            ),
            SpecVariant(
                "FlashHead verify + draft",
                {
                    "method": "draft_model",
                    "model": str(flashhead_model),
                    "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                },
                flashhead_drafts=True,
            ),
        ]
    if method == "eagle":
        eagle = {
            "method": "eagle",
            "model": str(eagle_head_dir(base_model)),
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        }
        return [SpecVariant("FlashHead verify + draft", eagle, flashhead_drafts=True)]
    raise ValueError(f"--spec: one of {', '.join(SPEC_METHODS)}")


def spec_counts(url: str) -> tuple[float, float]:
    """vLLM's own (accepted, drafted) speculative token counters, summed over their label sets."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30.0).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("vllm:spec_decode_num_accepted_tokens_total"), total("vllm:spec_decode_num_draft_tokens_total")


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


#: Targets of the serving benchmark (FlashHead / dense, median over rounds): the C = 1 speed-up of a
#: shape, for every traffic measured; and never slower than dense, at every concurrency and traffic.
C1_TARGETS = {"head-heavy": 2.2, "llama-1b": 1.8}
FLOOR = 1.0
#: Dense rows for these reasons in a FlashHead round mean the requests themselves were sent dense
#: (the benchmark's requests ask for nothing that needs dense logits, greedy or sampled).
REQUEST_REASONS = frozenset(reason.label for reason in DenseReason)


@dataclass
class Measurement:
    mode: str
    traffic: str
    round: int
    load: LoadResult
    rows: RowCounts
    accepted: float = 0.0  # vLLM's accepted and drafted tokens during the measurement (speculative decoding)
    drafted: float = 0.0
    flashhead_drafts: bool = False  # the variant's FlashHead rounds draft with FlashHead

    @property
    def check(self) -> bool:
        """FlashHead rounds went through FlashHead (no row sent dense for what its request asked, so the
        sampled rows too; under speculative decoding the verify rows, and the drafts when the variant drafts
        with FlashHead); dense rounds never did, drafts included."""
        if self.load.errors or self.load.completion_tokens == 0:
            return False
        if self.mode == "dense":
            return self.rows.flashhead == 0 and self.rows.verify == 0 and self.rows.draft == 0
        if self.drafted and self.rows.verify == 0:
            return False
        if self.flashhead_drafts and self.rows.draft == 0:
            return False
        return self.rows.flashhead > 0 and not REQUEST_REASONS & set(self.rows.dense)


@dataclass
class ShapeResult:
    shape: Shape
    n_probes: int
    sampled_n_probes: int | None
    probe_sampling: bool | None
    num_clusters: int
    threshold: int | None
    backend: str | None
    runs: dict[tuple[str, int], list[Measurement]] = field(default_factory=dict)
    variant: SpecVariant = field(default_factory=lambda: SpecVariant("", {}))
    sampled_estimate: str = ""  # the sampled rows' estimate, as the status route reports it

    def acceptance(self, key: tuple[str, int], mode: str) -> float:
        """vLLM's acceptance rate over the mode's measurements (speculative decoding; nan without drafts)."""
        ms = [m for m in self.runs[key] if m.mode == mode]
        drafted = sum(m.drafted for m in ms)
        return sum(m.accepted for m in ms) / drafted if drafted else math.nan

    def tokens_per_s(self, key: tuple[str, int], mode: str) -> float:
        ms = [m for m in self.runs[key] if m.mode == mode]
        wall = sum(m.load.wall_s for m in ms)
        return sum(m.load.completion_tokens for m in ms) / wall if wall else 0.0

    def ratios(self, key: tuple[str, int]) -> list[float]:
        """FlashHead / dense tokens/s of each round (its two measurements were taken back to back)."""
        by_round: dict[int, dict[str, float]] = {}
        for m in self.runs[key]:
            by_round.setdefault(m.round, {})[m.mode] = m.load.tokens_per_s
        return [r["flashhead"] / r["dense"] for r in by_round.values() if r.get("dense") and "flashhead" in r]

    def median_ratio(self, key: tuple[str, int]) -> float:
        ratios = self.ratios(key)
        return statistics.median(ratios) if ratios else math.nan

    def flash_share(self, key: tuple[str, int]) -> float:
        rows = [m.rows for m in self.runs[key] if m.mode == "flashhead"]
        total = sum(r.total for r in rows)
        return sum(r.flashhead for r in rows) / total if total else 0.0

    def all_checked(self, key: tuple[str, int]) -> bool:
        return all(m.check for m in self.runs[key])


def _traffics(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in TRAFFIC]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"traffic: a comma-separated list of {', '.join(TRAFFIC)}")
    return list(dict.fromkeys(names))


def measure(
    url: str,
    model: str,
    admin: Admin,
    mode: str,
    traffic: str,
    rnd: int,
    args: argparse.Namespace,
    concurrency: int,
    variant: SpecVariant | None = None,
) -> Measurement:
    admin.update(enabled=mode == "flashhead")
    before = RowCounts.of(admin.status())
    spec = getattr(args, "spec", None) is not None
    accepted0, drafted0 = spec_counts(url) if spec else (0.0, 0.0)
    load = run_load(
        url, model, concurrency=concurrency, max_tokens=args.max_tokens, seconds=args.seconds, traffic=traffic
    )
    if load.errors == load.requests:
        raise RuntimeError(f"every completion failed ({mode}, {traffic}, C={concurrency}); see the server log")
    rows = RowCounts.of(admin.status()) - before
    accepted1, drafted1 = spec_counts(url) if spec else (0.0, 0.0)
    drafts = variant is not None and variant.flashhead_drafts
    m = Measurement(mode, traffic, rnd, load, rows, accepted1 - accepted0, drafted1 - drafted0, drafts)
    acceptance = (
        f"; verify rows flashhead {rows.verify}, draft rows flashhead {rows.draft}, "
        f"acceptance {m.accepted:.0f}/{m.drafted:.0f}"
        if spec
        else ""
    )
    print(
        f"    C={concurrency:3d} {traffic:7s} round {rnd} {mode:9s}: {load.tokens_per_s:8.1f} tok/s  "
        f"({load.requests} requests, {load.completion_tokens} tokens, {load.wall_s:5.1f} s, "
        f"{load.errors} errors; rows flashhead {rows.flashhead}, dense {rows.dense or 0}{acceptance})"
        f"{'' if m.check else '  CHECK FAILED'}",
        flush=True,
    )
    return m


def bench_shape(shape: Shape, args: argparse.Namespace) -> list[ShapeResult]:
    """One result per server: the shape without speculation, or each `--spec` variant."""
    spec = shape.spec
    print(f"== {shape.title}: V={spec.vocab_size:,} H={spec.hidden_size:,} layers={spec.num_hidden_layers}", flush=True)
    name = f"{shape.key}-{spec.num_hidden_layers}l"
    model = prepare_flashhead_model(args.work_dir, name, spec, iterations=args.iterations)
    method = getattr(args, "spec", None)
    if method == "eagle":
        from tests.support.tiny_eagle import build_tiny_eagle

        build_tiny_eagle(eagle_head_dir(args.work_dir / name), args.work_dir / name)
    variants = spec_variants(method, model, args.work_dir / name)
    return [bench_server(shape, name, model, variant, args) for variant in variants]


def bench_server(shape: Shape, name: str, model: Path, variant: SpecVariant, args: argparse.Namespace) -> ShapeResult:
    max_c = max(args.concurrency)
    extra_args = ["--speculative-config", json.dumps(variant.config)] if variant.config else []
    if args.tensor_parallel_size > 1:
        extra_args += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    suffix = f"-spec-{'-'.join(variant.label.lower().replace('+', '').split())}" if variant.config else ""
    if variant.label:
        print(f"  -- {variant.label}: --speculative-config '{json.dumps(variant.config)}'", flush=True)
    server = flashhead_server(
        model,
        args.work_dir / "logs" / f"serve-{name}{suffix}.log",
        max_model_len=args.max_tokens + 64,
        max_num_seqs=max(32, max_c),
        extra_args=extra_args,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    t0 = time.perf_counter()
    with server:
        print(f"  server ready in {time.perf_counter() - t0:.0f} s (log: {server.log_path})", flush=True)
        admin = Admin(server.url)
        try:
            # The head may be built on the first decode step; n_probes can be set only after that.
            for traffic in args.traffic:
                run_load(server.url, server.model, concurrency=1, max_tokens=4, seconds=0, traffic=traffic)
            settings = {}
            if args.n_probes is not None:
                settings["n_probes"] = args.n_probes
            if args.dense_batch_threshold is not None:
                settings["dense_batch_threshold"] = args.dense_batch_threshold
            status = admin.update(**settings) if settings else admin.status()
            result = ShapeResult(
                shape,
                status["n_probes"],
                status.get("sampled_n_probes"),
                status.get("probe_sampling"),
                status["num_clusters"],
                status.get("dense_batch_threshold"),
                status.get("backend"),
                variant=variant,
                sampled_estimate=(
                    f"{status.get('sampled_estimate')} rank-{status.get('sampled_rank')} estimate, "
                    f"{status.get('sampled_rescore')} best-estimated tokens exact"
                ),
            )
            print(
                f"  FlashHead: {result.num_clusters:,} clusters, n_probes {result.n_probes} "
                f"(sampled rows {result.sampled_n_probes}, {result.sampled_estimate}, "
                f"probe_sampling {result.probe_sampling}), "
                f"dense_batch_threshold {result.threshold}, backend {result.backend}",
                flush=True,
            )
            for c in args.concurrency:
                for traffic in args.traffic:  # warm-up
                    run_load(server.url, server.model, concurrency=c, max_tokens=4, seconds=0, traffic=traffic)
                for rnd in range(args.rounds):
                    for i, traffic in enumerate(args.traffic):
                        order = MODES if (rnd + i) % 2 == 0 else MODES[::-1]
                        result.runs.setdefault((traffic, c), []).extend(
                            measure(server.url, server.model, admin, mode, traffic, rnd, args, c, variant)
                            for mode in order
                        )
                for traffic in args.traffic:
                    key = (traffic, c)
                    dense, flash = result.tokens_per_s(key, "dense"), result.tokens_per_s(key, "flashhead")
                    acceptance = (
                        f"; acceptance dense {result.acceptance(key, 'dense'):.3f}, "
                        f"FlashHead {result.acceptance(key, 'flashhead'):.3f}"
                        if variant.config
                        else ""
                    )
                    print(
                        f"  C={c} {traffic}: dense {dense:.1f} tok/s, FlashHead {flash:.1f} tok/s, "
                        f"x{result.median_ratio(key):.2f} (median of rounds){acceptance}",
                        flush=True,
                    )
            admin.update(enabled=True)
        finally:
            admin.close()
    return result


def _keys(result: ShapeResult) -> list[tuple[str, int]]:
    order = {t: i for i, t in enumerate(TRAFFIC)}
    return sorted(result.runs, key=lambda k: (k[1], order.get(k[0], len(order))))


def table(result: ShapeResult) -> list[str]:
    spec = bool(result.variant.config)
    lines = [
        "| concurrency | traffic | dense tok/s | FlashHead tok/s | FlashHead / dense (median) | spread over rounds | "
        "FlashHead rows in FlashHead rounds | "
        + ("acceptance dense | acceptance FlashHead | " if spec else "")
        + "check |",
        "|---:|:---|---:|---:|---:|:---:|---:|" + ("---:|---:|" if spec else "") + ":---:|",
    ]
    for key in _keys(result):
        traffic, c = key
        dense, flash = result.tokens_per_s(key, "dense"), result.tokens_per_s(key, "flashhead")
        ratios = result.ratios(key)
        median = f"{statistics.median(ratios):.2f}x" if ratios else "n/a"
        spread = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "n/a"
        acceptance = (
            f"{result.acceptance(key, 'dense'):.3f} | {result.acceptance(key, 'flashhead'):.3f} | " if spec else ""
        )
        lines.append(
            f"| {c} | {traffic} | {dense:.1f} | {flash:.1f} | {median} | {spread} | "
            f"{100 * result.flash_share(key):.0f}% | {acceptance}{'ok' if result.all_checked(key) else 'FAILED'} |"
        )
    return lines


def targets(results: list[ShapeResult]) -> list[tuple[str, str, bool]]:
    """`(target, measured, met)` for every target that the measured shapes cover."""
    out = []
    for r in results:
        goal = C1_TARGETS.get(r.shape.key)
        keys = [k for k in _keys(r) if k[1] == 1]
        if goal is not None and keys:
            got = {k[0]: r.median_ratio(k) for k in keys}
            out.append(
                (
                    f"≥ {goal:.1f}x dense at C = 1, {r.shape.key}",
                    ", ".join(f"{t} {v:.2f}x" for t, v in got.items()),
                    all(v >= goal for v in got.values()),
                )
            )
    every = [(r.shape.key, k, r.median_ratio(k)) for r in results for k in _keys(r)]
    if every:
        worst = min(every, key=lambda x: x[2] if not math.isnan(x[2]) else -math.inf)
        out.append(
            (
                f"≥ {FLOOR:.1f}x dense at every concurrency, greedy and sampled",
                f"lowest {worst[2]:.2f}x ({worst[0]}, {worst[1][0]}, C = {worst[1][1]})",
                all(v >= FLOOR for _, _, v in every),
            )
        )
    return out


def to_markdown(results: list[ShapeResult], args: argparse.Namespace) -> str:
    traffic = " and ".join(f"{t} ({', '.join(f'{k} {v:g}' for k, v in TRAFFIC[t].items())})" for t in args.traffic)
    out = [
        "### Serving: decode throughput, FlashHead vs dense (vLLM server, float32)",
        "",
        f"Machine: {machine_description()}",
        "",
        f"Command: `{command_line()}`",
        "",
        "One vLLM server per shape serves the FlashHead-converted random checkpoint; dense and FlashHead "
        'are measured on the same server by switching `PUT /plugins/my_pkg/flashhead {"enabled": ...}` '
        f"between measurements, in {args.rounds} paired round(s): in each round, for each traffic, a dense and "
        "a FlashHead measurement back to back, the order alternating (dense first, then FlashHead first). "
        f"Traffic: {traffic}. Each measurement: C clients, each sending completions of exactly "
        f"{args.max_tokens} tokens (`ignore_eos`) back to back for {args.seconds:g} s (at least one each); "
        "tokens/s = completion tokens / wall time until the last answer (prefill included, same for both "
        "modes); dense and FlashHead tok/s pool the rounds, the ratio is the median of the rounds' ratios "
        "with their spread (lowest..highest). Clusters come from "
        f"{args.iterations} balanced k-means iteration(s) only: cluster quality changes which tokens are "
        'chosen, not the time per step. "FlashHead rows" = share of head rows that the status route\'s '
        "counters show served by FlashHead during the FlashHead rounds (the rest went dense, e.g. a batch "
        "above `dense_batch_threshold`); the counters do not split greedy from sampled rows, but each "
        "measurement sends one traffic only, so the rows counted for a sampled line are sampled rows. "
        '"check" = no errors; in every FlashHead round FlashHead rows counted and no row sent dense for '
        "what its request asked (a `DenseReason`); no FlashHead row in any dense round.",
        "",
    ]
    for r in results:
        spec = r.shape.spec
        variant = (
            f" Speculative decoding, {r.variant.label} (`--speculative-config '{json.dumps(r.variant.config)}'`)."
            if r.variant.config
            else ""
        )
        out += [
            f"**{r.shape.title}**: V = {spec.vocab_size:,}, H = {spec.hidden_size:,}, "
            f"{spec.num_hidden_layers} layers, intermediate {spec.intermediate_size:,}, "
            f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads, tied embeddings; "
            f"{r.num_clusters:,} clusters of 16, n_probes {r.n_probes} (sampled rows: {r.sampled_n_probes} probes, "
            f"{r.sampled_estimate}, probe_sampling {r.probe_sampling}), dense_batch_threshold {r.threshold} "
            f"(server default unless the command sets it), backend {r.backend}.{variant}",
            "",
        ]
        out += table(r)
        out.append("")
    met = targets([r for r in results if not r.variant.config])  # the targets are set without speculation
    if met:
        out += ["Targets (median FlashHead / dense over rounds):", ""]
        out += ["| target | measured | met |", "|:---|:---|:---:|"]
        out += [f"| {goal} | {got} | {'yes' if ok else '**no**'} |" for goal, got, ok in met]
        out.append("")
    return "\n".join(out)


def planned_seconds(args: argparse.Namespace, num_shapes: int) -> float:
    """Lower bound of the measuring time: every measurement lasts at least ``--seconds``."""
    servers = len(spec_variants(getattr(args, "spec", None), Path(), Path()))
    return num_shapes * servers * len(args.concurrency) * len(args.traffic) * args.rounds * len(MODES) * args.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that depend on `--quick` and `--spec` filled in."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["head-heavy", "llama-1b", "all"], default="all")
    ap.add_argument("--llama-layers", type=int, default=4, help="layers of the Llama-3.2-1B-like shape (real: 16)")
    ap.add_argument("--concurrency", type=int_list, default=None, help="default 1,8,32 (quick: 1,8)")
    ap.add_argument("--traffic", type=_traffics, default=list(TRAFFIC), help="greedy, sampled or both (default)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 64; quick: 16)")
    ap.add_argument("--seconds", type=float, default=None, help="per measurement (default 30; quick: 4)")
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds (default 3; quick: 2)")
    ap.add_argument("--n-probes", type=int, default=None, help="set via PUT (default: the model's)")
    ap.add_argument("--dense-batch-threshold", type=int, default=None, help="set via PUT (default: the server's)")
    ap.add_argument("--iterations", type=int, default=None, help="k-means iterations (default 2; quick: 1)")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="checkpoint cache and server logs")
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs (smoke test)")
    ap.add_argument("--write-docs", action="store_true", help="write the serve section of docs/benchmarks.md")
    ap.add_argument(
        "--spec",
        choices=SPEC_METHODS,
        default=None,
        help="speculative decoding: ngram (FlashHead verify), draft (FlashHead verify, then verify + draft) or "
        "eagle (verify + draft with an EAGLE head), each against dense; concurrency 1,8 by default; prints only",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM's --tensor-parallel-size (one core per rank: VLLM_CPU_OMP_THREADS_BIND 0|1|...); prints only",
    )
    args = ap.parse_args(argv)
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be >= 1")
    if args.tensor_parallel_size > 1 and args.write_docs:
        ap.error("--tensor-parallel-size prints its tables only; --write-docs writes the TP=1 serve section")
    if args.spec is not None and args.write_docs:
        ap.error("--spec prints its tables only; --write-docs writes the serve section without speculation")
    args.concurrency = args.concurrency or ([1, 8] if args.quick or args.spec else [1, 8, 32])
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.seconds = args.seconds if args.seconds is not None else (4.0 if args.quick else 30.0)
    args.iterations = args.iterations or (1 if args.quick else 2)
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    table_shapes = shapes(args.llama_layers)
    keys = ["quick"] if args.quick else (["head-heavy", "llama-1b"] if args.shape == "all" else [args.shape])
    print(machine_description())
    print(
        f"measuring at least {planned_seconds(args, len(keys)) / 60:.0f} min "
        f"({len(keys)} shape(s) x {len(spec_variants(args.spec, Path(), Path()))} server(s) x "
        f"{len(args.concurrency)} concurrencies x {len(args.traffic)} traffics x "
        f"{args.rounds} rounds x 2 modes x {args.seconds:g} s), plus model builds and server starts",
        flush=True,
    )
    results = [result for k in keys for result in bench_shape(table_shapes[k], args)]
    md = to_markdown(results, args)
    print()
    print(md)
    if args.write_docs:
        print(f"wrote the serve section of {write_section('serve', md)}")
    failed = [r.shape.key for r in results for key in r.runs if not r.all_checked(key)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
