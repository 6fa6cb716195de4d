"""Command line interface: ``my-pkg flashhead build|eval``: parse, call the library, print its reports.

The work is :func:`my_pkg.flashhead.build.build_assets` and :func:`my_pkg.flashhead.eval_assets.evaluate_assets`;
they are imported when a command runs, so that parsing (and ``--help``) does not load torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .flashhead.build_report import BuildOptions, CalibrationFit, HeadShape
    from .flashhead.calibration import SelfCalibration

__all__ = ["main", "build_parser"]

T = TypeVar("T")

DEFAULT_EVAL_PROBES = (8, 16, 32, 64, 128, 256, 512)


class CliError(Exception):
    """An error reported to the user as one line on stderr."""


def _checked(convert: Callable[[str], T], what: str, ok: Callable[[T], bool], bound: str) -> Callable[[str], T]:
    """An argparse type: ``convert``, then ``ok`` or the error ``bound``."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(bound)
        return value

    return parse


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


_int_list = _checked(_ints, "comma-separated integers", lambda v: bool(v) and min(v) >= 1, "probe counts must be >= 1")
_positive = _checked(int, "an integer", lambda v: v >= 1, "must be >= 1")
_nonnegative = _checked(int, "an integer", lambda v: v >= 0, "must be >= 0")
_margin = _checked(float, "a number", lambda v: v >= 1.0, "must be >= 1")
_agreement = _checked(float, "a number", lambda v: 0.0 < v <= 1.0, "must lie in (0, 1]")
_confidence = _checked(float, "a number", lambda v: 0.5 <= v < 1.0, "must lie in [0.5, 1)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="my-pkg", description="my_pkg tools")
    sub = p.add_subparsers(dest="command", required=True)
    fh = sub.add_parser("flashhead", help="FlashHead assets: build and evaluate")
    fsub = fh.add_subparsers(dest="action", required=True)

    b = fsub.add_parser("build", help="cluster the LM head and write flash_head_assets/ + config.json")
    b.add_argument("model_dir", type=Path)
    b.add_argument("--cluster-size", type=_positive, default=16)
    b.add_argument(
        "--n-probes",
        type=_positive,
        default=None,
        help="probes written to config.json (default: about 1/32 of the clusters; with calibration, "
        "the smallest reaching --target-agreement)",
    )
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--iterations", type=_positive, default=20)
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    b.add_argument("--output", type=Path, default=None, help="write a converted copy here instead of editing in place")
    b.add_argument("--no-progress", action="store_true")
    calibration = b.add_mutually_exclusive_group()
    calibration.add_argument(
        "--calibration",
        type=Path,
        default=None,
        metavar="TEXT_FILE",
        help="fit the stage-1 vectors to hidden states of the model run on this text",
    )
    calibration.add_argument(
        "--calibration-hidden",
        type=Path,
        default=None,
        metavar="FILE",
        help="fit the stage-1 vectors to these hidden states (safetensors, key hidden_states)",
    )
    calibration.add_argument(
        "--no-calibration",
        action="store_true",
        help="weight-only stage 1 (default without --calibration*: self-calibrate on the model's own samples)",
    )
    b.add_argument(
        "--self-calibration-states",
        type=_positive,
        default=8192,
        help="self-calibration: hidden states of the model's own samples to collect",
    )
    b.add_argument(
        "--self-calibration-seconds",
        type=_positive,
        default=600,
        help="self-calibration: time budget of the sampling (states collected so far are used)",
    )
    b.add_argument(
        "--validation-states",
        type=_nonnegative,
        default=4096,
        help="with --calibration*: also validate n_probes on this many states of the model's own samples "
        "(0: only on the held-out calibration states)",
    )
    b.add_argument(
        "--probe-margin",
        type=_margin,
        default=2.0,
        help="n_probes: the held-out estimate must show at most 1/margin of the misses the target allows",
    )
    b.add_argument(
        "--calibration-max-tokens",
        type=_positive,
        default=16384,
        help="tokens of --calibration text run through the model",
    )
    b.add_argument(
        "--target-agreement",
        type=_agreement,
        default=0.995,
        help="with calibration, the default n_probes is the smallest whose held-out top-1 agreement reaches this",
    )
    b.add_argument(
        "--target-confidence",
        type=_confidence,
        default=0.95,
        help="one-sided confidence that the held-out agreement reaches the target (0.5: the estimate)",
    )

    e = fsub.add_parser("eval", help="agreement of FlashHead with the dense head per n_probes")
    e.add_argument("model_dir", type=Path)
    e.add_argument(
        "--hidden",
        "--hidden-states",
        dest="hidden_states",
        type=Path,
        default=None,
        help="safetensors file with [N, hidden] states (key hidden_states)",
    )
    e.add_argument("--text", type=Path, default=None, help="text file: capture states by running the model")
    e.add_argument(
        "--probes",
        type=_int_list,
        default=None,
        help=f"probe counts to sweep (default {','.join(map(str, DEFAULT_EVAL_PROBES))}; "
        "with --json: the n_probes serving uses)",
    )
    e.add_argument(
        "--json",
        action="store_true",
        help="print the serving fidelity (agreement, stop-token recall, sampling TV) as JSON",
    )
    e.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="also write a PNG of top-1 agreement and sampled TV against the share of rows scored "
        "(needs matplotlib: pip install 'my-pkg[plot]')",
    )
    e.add_argument("--samples", type=_positive, default=1000)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda requested but CUDA is not available")
    return name


class _BuildPrinter:
    """A build's progress (:class:`~my_pkg.flashhead.build_report.BuildProgress`), one line per step as it happens."""

    def __init__(self, options: BuildOptions) -> None:
        self.options = options
        self.num_clusters = 0

    def capturing(self, text_file: Path) -> None:
        o = self.options
        print(f"running the model on {text_file} (at most {o.calibration_max_tokens:,} tokens) on {o.device}")

    def cannot_self_calibrate(self, reason: str) -> None:
        print(
            f"warning: no self-calibration, {reason}; building weight-only "
            "(pass --calibration TEXT_FILE, or --no-calibration to skip this attempt)"
        )

    def sampling(self, prompts: int) -> None:
        o = self.options
        print(
            f"self-calibration: sampling the model from {prompts} prompts"
            f" (at most {o.self_calibration_states:,} states, {o.self_calibration_seconds} s) on {o.device}"
        )

    def sampled(self, sample: SelfCalibration) -> None:
        print(
            f"sampled {sample.hidden.shape[0]:,} states in {sample.seconds:.1f} s"
            + (" (time budget reached)" if sample.stopped_by_time else "")
        )

    def too_few_samples(self, reason: str) -> None:
        print(f"warning: {reason}; building weight-only")

    def validating_on_heldout_only(self, reason: str) -> None:
        print(f"note: n_probes is validated on the held-out calibration states only ({reason})")

    def clustering(self, head: HeadShape) -> None:
        self.num_clusters = head.num_clusters
        print(
            f"head {head.key}: {head.vocab_size:,} x {head.hidden_size:,} ({head.dtype}); {head.num_clusters:,} "
            f"clusters of {head.cluster_size} on {head.device}"
        )

    def clustered(self, seconds: float) -> None:
        print(f"clustered in {seconds:.1f} s")

    def calibrated(self, fit: CalibrationFit) -> None:
        cal, o = fit.result, self.options
        held, choice, target = int(cal.fit.heldout_rows.numel()), cal.choice, o.target_agreement
        seconds = f"{fit.seconds:.1f} s"
        print(f"calibrated stage 1 on {fit.states:,} hidden states ({fit.source}) in {seconds}; {held:,} held out")
        if cal.variants:
            rules = ", ".join(
                f"{name.replace('_', '-')} needs n_probes={rule.n_probes}"
                + ("" if rule.meets else " (does not meet the target)")
                for name, rule in cal.variants.items()
            )
            print(f"stage 1 under the probe rule: {rules}; {cal.stage1_reason}")
        other = "weight-only" if cal.stage1 == "calibrated" else "calibrated"
        other_at = cal.weight_only_same_probes if cal.stage1 == "calibrated" else cal.calibrated_same_probes
        print(
            f"held-out top-1 agreement at n_probes={cal.n_probes} ({choice.scored_fraction:.1%} of the vocabulary "
            f"scored, {cal.num_pinned} pinned ids): {cal.stage1.replace('_', '-')} {choice.agreement:.4f} "
            f"(>= {choice.agreement_lower:.4f} with {o.target_confidence:.0%} confidence), {other} "
            f"{other_at.agreement:.4f}"
        )
        for name, (rows, alone, at) in cal.validation.items():
            print(
                f"validation on {rows:,} states of {name}: agreement {at.agreement:.4f} at n_probes={cal.n_probes} "
                f"(alone it needs n_probes={alone.n_probes})"
            )
        if o.n_probes is not None:
            if not choice.certified:
                print(f"warning: --n-probes {o.n_probes} does not show agreement {target} on the held-out states")
        elif not choice.reached:
            print(
                f"warning: no n_probes below all {self.num_clusters:,} clusters reaches top-1 agreement {target} "
                f"on the held-out states; writing n_probes={cal.n_probes} (lower --target-agreement or pass --n-probes)"
            )
        elif not choice.certified:
            print(
                f"warning: {held} held-out states cannot show agreement {target} with {o.target_confidence:.0%} "
                f"confidence below all clusters; n_probes={cal.n_probes} is the smallest whose held-out estimate "
                "reaches it (give more calibration text)"
            )

    def tail_fitted(self, rank: int, seconds: float) -> None:
        print(f"fitted the rank-{rank} tail estimate of sampled rows to the calibration states in {seconds:.1f} s")


def _build(args: argparse.Namespace) -> int:
    from .flashhead.build import build_assets
    from .flashhead.build_report import BuildOptions

    options = BuildOptions(
        cluster_size=args.cluster_size,
        n_probes=args.n_probes,
        seed=args.seed,
        iterations=args.iterations,
        device=_device(args.device),
        output=args.output,
        progress=not args.no_progress,
        calibration_text=args.calibration,
        calibration_hidden=args.calibration_hidden,
        self_calibration=not args.no_calibration,
        self_calibration_states=args.self_calibration_states,
        self_calibration_seconds=args.self_calibration_seconds,
        validation_states=args.validation_states,
        probe_margin=args.probe_margin,
        calibration_max_tokens=args.calibration_max_tokens,
        target_agreement=args.target_agreement,
        target_confidence=args.target_confidence,
    )
    report = build_assets(args.model_dir, options, _BuildPrinter(options))
    if report.uneven_clusters:
        print(
            f"note: vocab {report.head.vocab_size} is not a multiple of {report.head.cluster_size}; cluster sizes "
            "differ by one (loads here, not in the public FlashHead plugin)"
        )
    print(f"wrote {report.cache_path} and config.json (n_probes={report.n_probes})")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from .flashhead.eval_assets import EvalOptions, calibration_summary, dtype_name, evaluate_assets
    from .flashhead.evaluate import format_table
    from .flashhead.fidelity import format_fidelity_table

    probes = args.probes if args.probes is not None else (None if args.json else DEFAULT_EVAL_PROBES)
    options = EvalOptions(
        hidden_states=args.hidden_states,
        text=args.text,
        probes=None if probes is None else tuple(probes),
        samples=args.samples,
        seed=args.seed,
        device=_device(args.device),
        sweep=not args.json,
        plot=args.plot,
    )
    report = evaluate_assets(args.model_dir, options)
    if report.plot is not None:
        print(f"wrote {report.plot}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report.fidelity_record(), indent=2))
        return 0
    source = {
        "file": f"hidden states from {report.source_path}",
        "text": f"hidden states captured by running the model on {report.source_path}",
    }.get(
        report.source,
        "SYNTHETIC hidden states (aligned with random head rows plus noise; pass --hidden or --text for real ones)",
    )
    weight_dtype = dtype_name(report.dtype)
    print(f"stage 1: {calibration_summary(report.calibration)}")
    print(
        f"{source}; {report.hidden_states} samples; vocab {report.vocab_size:,}, {report.num_clusters:,} clusters of "
        f"{report.cluster_size}, backend {report.backend}, device {report.device}"
    )
    print(
        f"reference: dense head in float32 (hidden states {dtype_name(report.hidden_dtype)}); FlashHead "
        f"chooses clusters in {weight_dtype}, as served; a tie with the maximum agrees"
    )
    if report.dense_agreement is not None:
        print(
            f"for comparison, the dense head in {weight_dtype} picks a float32 argmax on "
            f"{report.dense_agreement:.2%} of rows (rounding, not FlashHead)"
        )
    print(format_table(report.sweep or [], report.dense_ms or 0.0, report.vocab_size))
    print()
    print(
        f"serving fidelity: the logits a server hands to vLLM's sampler ({len(report.pinned)} pinned ids scored on "
        "every row; sampled rows estimate the logits outside the clusters they probe with the "
        + ("estimate fitted to the calibration states)" if report.tail_fitted else "weight-only estimate)")
    )
    print(format_fidelity_table(report.fidelity))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .flashhead.assets import FlashHeadAssetError

    try:
        if args.command == "flashhead" and args.action == "build":
            return _build(args)
        if args.command == "flashhead" and args.action == "eval":
            return _eval(args)
    except (CliError, FlashHeadAssetError, ValueError, OSError, RuntimeError) as e:
        print(f"my-pkg: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("my-pkg: interrupted", file=sys.stderr)
        return 130
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
