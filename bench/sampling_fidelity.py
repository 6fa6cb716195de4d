"""Sampling fidelity of FlashHead's sampled-row designs on the trained-LM fixture.

The fixture's head is written as a tied checkpoint in a temporary directory and built by
``my-pkg flashhead build``, weight-only and with ``--calibration-hidden`` on the fixture's
calibration states.  For each, prints a markdown table of the
total-variation distance between the dense sampling distribution and the one a sampled row gets,
in vLLM's semantics (``my_pkg.flashhead.fidelity.sampling_distribution``): mean, 90th percentile
and maximum over the held-out states, with the scored fraction of a sampled row.  Rows:

* clusters drawn in proportion to the softmax of the centroid scores (the design before; its
  expectation estimated from ``--draws`` draws per state), ``-inf`` elsewhere;
* the top ``n_probes`` clusters, ``-inf`` elsewhere (what greedy rows get);
* serving's sampled rows (``FlashHead.step_logits``) at the defaults (no cluster probed: the estimate
  chooses the exact tokens), with twice the exact tokens, twice the rank, and the greedy rows' clusters
  probed too (``--variants P:R[:K],...`` adds more: probes (0: none), estimate rank, rescored tail tokens
  (default: the head's); ``P`` may be ``n`` for the greedy rows' ``n_probes``; with ``--shifted`` they are
  settings of the default build, ``K`` given, the fitted estimate or with ``P:R:K:w`` the weight-only one).

With ``--shifted`` it instead measures sampled rows on text the build never saw, as the default build
serves them: the fixture's head clustered, its stage 1 calibrated on the model's own samples and on each
source's calibration states (``calibrate_stage1``, as ``build`` does), each with the weight-only tail
estimate and with the one fitted to the same calibration states (each at the head's default rank); for the
default build also the fitted estimate at ``ceil(H / 8)`` (the default before the rows budget), half and a
quarter of it, the sampled rows of the design before (the greedy rows' clusters probed, ``V / 32`` rescored) and as many
exact tokens chosen by the estimate alone; TV on the held-out states of every other source (mean / p90 / max).

With ``--speed VxH`` it instead times one decode step at batch 1 on a random head of that shape
(random balanced clusters, builder-default ``n_probes``, the estimate fitted as a default build fits it):
the dense logits, a greedy row and a sampled row of ``FlashHead.step_logits``, and the one-time build of the
sampled rows' tables.

    python -m bench.sampling_fidelity                       # the committed fixture, every held-out state
    python -m bench.sampling_fidelity --rows 1024 --draws 8
    python -m bench.sampling_fidelity --shifted --threads 1          # fitted vs weight-only estimate
    python -m bench.sampling_fidelity --shifted --threads 1 --variants 0:28:288,0:21:512:w
    python -m bench.sampling_fidelity --speed 128256x2048 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from bench._report import command_line, fitted_tail_factors, machine_description, median_ms
from my_pkg.cli import main as cli
from my_pkg.flashhead import FlashHead, default_n_probes
from my_pkg.flashhead.assets import load_assets, read_config
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.fidelity import SAMPLING_SETTINGS, sampling_distribution, serving_fidelity, total_variation
from tests.support.trained_fixture import TrainedFixture, load_trained_fixture


def _drawn_clusters_tv(
    head: FlashHead, hidden: torch.Tensor, pinned: torch.Tensor, draws: int, seed: int
) -> list[float]:
    """TV of the earlier design: ``n_probes`` clusters drawn without replacement with probability
    ``softmax(score)`` (Gumbel top-k), exact logits of their members and the pinned ids, ``-inf`` elsewhere."""
    dense = hidden @ head.weight[: head.vocab_size].float().T
    scores = hidden @ head.centroids.float().T
    generator = torch.Generator().manual_seed(seed)
    expected = [torch.zeros_like(dense) for _ in SAMPLING_SETTINGS]
    for _ in range(draws):
        uniform = torch.rand(scores.shape, generator=generator).clamp(1e-20, 1 - 1e-7)
        probes = torch.topk(scores - torch.log(-torch.log(uniform)), head.n_probes, dim=1).indices
        ids = head.members[probes].reshape(hidden.shape[0], -1)
        logits = torch.full_like(dense, float("-inf")).scatter_(1, ids, dense.gather(1, ids))
        logits[:, pinned] = dense[:, pinned]
        for i, (temperature, top_p) in enumerate(SAMPLING_SETTINGS):
            expected[i] += sampling_distribution(logits, temperature, top_p) / draws
    return [
        float(total_variation(sampling_distribution(dense, t, p), q).mean())
        for (t, p), q in zip(SAMPLING_SETTINGS, expected)
    ]


def _built(fx: TrainedFixture, root: Path, calibrated: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(centroids, assignments, n_probes)`` that ``my-pkg flashhead build`` writes for the fixture's head."""
    path = root / ("calibrated" if calibrated else "weight-only")
    path.mkdir()
    save_file({"model.embed_tokens.weight": fx.weight.contiguous()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**fx.meta["model_config"], "architectures": ["LlamaForCausalLM"]}))
    special = {str(i): {"content": token, "special": True} for token, i in fx.special_ids.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": special}))
    extra = []
    if calibrated:
        save_file({"hidden_states": fx.calibration}, str(root / "calibration.safetensors"))
        extra = ["--calibration-hidden", str(root / "calibration.safetensors")]
    if cli(["flashhead", "build", str(path), "--no-progress", *extra]) != 0:
        raise RuntimeError("my-pkg flashhead build failed")
    config = read_config(path)
    centroids, assignments = load_assets(path, config)
    return centroids, assignments, int(config["n_probes"])


def speed(vocab: int, hidden: int, rounds: int = 5) -> None:
    """Batch-1 step times on a random head of ``vocab x hidden`` (fp32, CPU), in paired rounds."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=generator)
    assignments = random_balanced_assignment(vocab, 16)
    clusters = int(assignments.max()) + 1
    head = FlashHead(
        weight,
        torch.randn(clusters, hidden, generator=generator),
        assignments,
        n_probes=default_n_probes(clusters),
        tail_factors=fitted_tail_factors(weight, vocab),  # as a default build
    )
    h = torch.randn(1, hidden, generator=generator)
    pins, sampled = torch.tensor([0, 1, 2]), np.ones(1, bool)
    t0 = time.perf_counter()
    head.step_logits(h, sampled=sampled, pinned=pins)  # builds the tables
    build = time.perf_counter() - t0
    print(
        f"{vocab:,} x {hidden:,}: {clusters:,} clusters, n_probes {head.n_probes}, sampled rows "
        f"{head.sampled_n_probes} probes, rank {head.sampled_rank} and {head.sampled_rescore:,} best-estimated tokens; "
        f"tables built in {build:.2f} s"
    )
    steps = {
        "dense logits": lambda: torch.nn.functional.linear(h, weight),
        "greedy row": lambda: head.step_logits(h, pinned=pins),
        "sampled row": lambda: head.step_logits(h, sampled=sampled, pinned=pins),
    }
    for fn in steps.values():
        fn()
    runs: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            runs[name].append(median_ms(fn, 10))
    dense = runs["dense logits"]
    for name, ms in runs.items():
        ratios = [d / m for d, m in zip(dense, ms)]
        print(
            f"  {name}: {statistics.median(ms):.2f} ms, x{statistics.median(ratios):.2f} of dense "
            f"({min(ratios):.2f}..{max(ratios):.2f} over {rounds} paired rounds)"
        )


def shifted(fx: TrainedFixture, rows: int, extra: list[tuple[str, int, int, bool]] = ()) -> None:
    """Sampled rows' TV on shifted text, weight-only vs fitted tail estimate (see the module docstring);
    ``extra``: more ``(probes, rank, rescored, fitted)`` settings of the default build (``probes`` ``n``: the
    greedy rows' ``n_probes``)."""
    from my_pkg.flashhead.calibration import calibrate_stage1
    from my_pkg.flashhead.clustering import balanced_kmeans
    from my_pkg.flashhead.spec import default_sampled_rescore
    from my_pkg.flashhead.tail_estimate import default_tail_rank, fit_tail_factors

    cluster_size = 16
    res = balanced_kmeans(fx.weight, cluster_size, iterations=20, seed=0, progress=False)
    pinned = sorted({fx.eos_id, *fx.special_ids.values()})
    vocab, hidden_size = fx.weight.shape
    settings = " | ".join(f"TV T={t:g} top_p={p:g}" for t, p in SAMPLING_SETTINGS)
    print(f"| stage 1 calibrated on | estimate | held-out source | scored | {settings} |")
    print("|---|---|---|---:|" + "---:|" * len(SAMPLING_SETTINGS))
    builds = {"model samples": fx.generated, "docstrings": fx.calibration, "code": fx.code_calibration}
    for build, states in builds.items():
        cal = calibrate_stage1(fx.weight, res.assignments, res.centroids, states, pinned_ids=pinned, seed=0)
        factors = fit_tail_factors(fx.weight, vocab, default_tail_rank(hidden_size), states)
        # (estimate, fitted factors, rank, sampled_n_probes, sampled_rescore); None: the head's default
        variants = [
            ("weight-only", None, None, None, None),
            ("fitted to the calibration states", factors, None, None, None),
        ]
        if build == "model samples":  # the default build: other ranks, and the design before
            ranks = (factors.rank, factors.rank // 2, factors.rank // 4)  # ceil(H / 8): the default before the budget
            variants += [("fitted", factors, r, None, None) for r in ranks]
            before, exact_members = default_sampled_rescore(vocab), cal.n_probes * cluster_size
            rank = factors.rank
            variants += [
                (f"fitted; greedy rows' clusters + {before} rescored (before)", factors, rank, cal.n_probes, before),
                ("fitted; as many exact tokens, all best-estimated", factors, rank, 0, before + exact_members),
            ]
            for probes, r, k, fitted in extra:
                probes = cal.n_probes if probes == "n" else int(probes)
                kind = "fitted" if fitted else "weight-only"
                name = f"{kind}; top {probes} clusters, {k} best-estimated tokens exact"
                variants.append((name, factors if fitted else None, r, probes, k))
        for estimate, fitted, rank, probes, rescore in variants:
            head = FlashHead(
                fx.weight,
                cal.centroids,
                res.assignments,
                n_probes=cal.n_probes,
                sampled_rank=rank,
                tail_factors=fitted,
                sampled_n_probes=probes,
            )
            head.sampled_rescore = rescore
            label = f"{build} ({cal.n_probes} probes) | {estimate}, rank {head.sampled_rank}"
            for source in ("docstrings", "code"):
                if source != build:
                    (result,) = serving_fidelity(head, fx.source(source)[1][:rows], [cal.n_probes], pinned=pinned)
                    fraction = result.sampling[0].scored_fraction
                    print(_row(f"{label} | {source}", fraction, result.sampling), flush=True)


def _shifted_variants(text: str) -> list[tuple[str, int, int, bool]]:
    """``--variants`` for ``--shifted``: ``P:R:K`` items (``K`` is needed: the rescored tokens), ``P:R:K:w`` with
    the weight-only estimate."""
    out = []
    for item in filter(None, text.split(",")):
        probes, rank, rescore, *estimate = item.split(":")
        out.append((probes, int(rank), int(rescore), estimate != ["w"]))
    return out


def _variant_label(probes: int, rank: int, rescore: int) -> str:
    clusters = f"top {probes} clusters and " if probes else "no cluster, "
    return f"{clusters}the {rescore} best-estimated tokens exact, rank-{rank} estimate elsewhere"


def _row(name: str, fraction: float, tv: list) -> str:
    """One table row; ``tv`` holds a mean per setting, or a ``SamplingFidelity`` (mean / p90 / max)."""
    cells = [
        f"{x:.4f}" if isinstance(x, float) else f"{x.tv_distance:.4f} / {x.tv_p90:.3f} / {x.tv_max:.3f}" for x in tv
    ]
    return f"| {name} | {fraction:.1%} | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", type=Path, default=None, help="fixture directory (default: the committed one)")
    ap.add_argument("--rows", type=int, default=None, help="held-out states used (default: all)")
    ap.add_argument("--draws", type=int, default=16, help="draws per state for the drawn-clusters design")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drawn-clusters design")
    ap.add_argument("--speed", default=None, metavar="VxH", help="time a step on a random VxH head instead")
    ap.add_argument(
        "--variants",
        default="",
        metavar="P:R[:K],...",
        help="more sampled-row settings: probes (or n: the greedy rows' n_probes), estimate rank and "
        "rescored tail tokens (default: the head's)",
    )
    ap.add_argument("--shifted", action="store_true", help="fitted vs weight-only estimate on shifted text instead")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed:
        vocab, hidden = (int(x) for x in args.speed.lower().split("x"))
        print(machine_description())
        speed(vocab, hidden)
        return 0
    fx = load_trained_fixture(args.fixture)
    if args.shifted:
        print(machine_description())
        print(f"Command: `{command_line()}`\n")
        shifted(fx, args.rows or 2048, _shifted_variants(args.variants))
        return 0
    hidden = fx.heldout if args.rows is None else fx.heldout[: args.rows]
    pinned = sorted({fx.eos_id, *fx.special_ids.values()})
    pins = torch.tensor(pinned)
    vocab = fx.weight.shape[0]
    print(machine_description())
    print(f"Command: `{command_line()}`; {hidden.shape[0]} held-out states, vocabulary {vocab:,}\n")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        stages = [(name, *_built(fx, Path(tmp), name == "calibrated")) for name in ("weight-only", "calibrated")]
    print(f"\nbuilt in {time.perf_counter() - t0:.0f} s\n")
    settings = " | ".join(f"TV T={t:g} top_p={p:g} (mean / p90 / max)" for t, p in SAMPLING_SETTINGS)
    for name, centroids, assignments, n_probes in stages:
        head = FlashHead(fx.weight, centroids, assignments, n_probes=n_probes)
        default_probes, default_rank, default_rescore = head.sampled_n_probes, head.sampled_rank, head.sampled_rescore
        print(
            f"**{name} stage 1**, n_probes {n_probes} (defaults for sampled rows: {default_probes} probes, "
            f"rank {default_rank}, {default_rescore} rescored tokens)\n"
        )
        print(f"| sampled rows get | scored | {settings} |")
        print("|---|---:|" + "---:|" * len(SAMPLING_SETTINGS))
        greedy_fraction = head.scored_rows_per_step(sampled=False, pinned=len(pinned)) / vocab
        print(
            _row(
                f"{n_probes} clusters drawn ∝ softmax(score), −inf elsewhere (before)",
                greedy_fraction,
                _drawn_clusters_tv(head, hidden, pins, args.draws, args.seed),
            ),
            flush=True,
        )
        variants = [(n_probes, 0, 0, f"top {n_probes} clusters, −inf elsewhere (as greedy rows)")]
        variants += [
            (
                p,
                r,
                k,
                _variant_label(p, r, k)
                + (" **(default)**" if (p, r, k) == (default_probes, default_rank, default_rescore) else ""),
            )
            for p, r, k in (
                (default_probes, default_rank, default_rescore),
                (default_probes, default_rank, 2 * default_rescore),
                (default_probes, 2 * default_rank, default_rescore),
                (n_probes, default_rank, default_rescore),
            )
        ]
        for item in filter(None, args.variants.split(",")):
            probes_text, rank_text, *rest = item.split(":")
            probes = n_probes if probes_text == "n" else min(int(probes_text), head.num_clusters)  # 0: no stage 1
            rescore = int(rest[0]) if rest else default_rescore
            label = _variant_label(probes, int(rank_text), rescore)
            variants.append((probes, int(rank_text), rescore, label))
        for probes, rank, rescore, label in variants:
            head.sampled_n_probes, head.sampled_rank, head.sampled_rescore = probes, rank, rescore
            (result,) = serving_fidelity(head, hidden, [n_probes], pinned=pinned)
            print(_row(label, result.sampling[0].scored_fraction, result.sampling), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
