"""Command line interface: ``my-pkg flashhead build|eval``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]


class CliError(Exception):
    """An error reported to the user as one line on stderr."""


def _parsed(text: str, convert, what: str):
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _int_list(text: str) -> list[int]:
    vals = _parsed(text, lambda t: [int(x) for x in t.split(",") if x.strip()], "comma-separated integers")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("probe counts must be >= 1")
    return vals


def _positive(text: str) -> int:
    v = _parsed(text, int, "an integer")
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


DEFAULT_EVAL_PROBES = (8, 16, 32, 64, 128, 256, 512)


def _nonnegative(text: str) -> int:
    v = _parsed(text, int, "an integer")
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _margin(text: str) -> float:
    v = _parsed(text, float, "a number")
    if v < 1.0:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def _agreement(text: str) -> float:
    v = _parsed(text, float, "a number")
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError("must lie in (0, 1]")
    return v


def _confidence(text: str) -> float:
    v = _parsed(text, float, "a number")
    if not 0.5 <= v < 1.0:
        raise argparse.ArgumentTypeError("must lie in [0.5, 1)")
    return v


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


_MIN_CALIBRATION_STATES = 20


def _calibration_states(args: argparse.Namespace, hidden_size: int, device: str):
    """``(hidden [N, H] float32, source)`` from ``--calibration`` / ``--calibration-hidden``; None without either.

    Runs before anything is written, so bad input leaves the model directory untouched.
    """
    import torch

    from .flashhead.evaluate import capture_hidden_states, load_hidden_states

    if args.calibration is not None:
        try:
            text = args.calibration.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read calibration text {args.calibration}: {e}") from None
        if not text.strip():
            raise CliError(f"calibration text {args.calibration} is empty")
        print(f"running the model on {args.calibration} (at most {args.calibration_max_tokens:,} tokens) on {device}")
        hidden = capture_hidden_states(
            args.model_dir, text, max_tokens=args.calibration_max_tokens, device=device, progress=not args.no_progress
        )
        source = "text"
    elif args.calibration_hidden is not None:
        if not args.calibration_hidden.is_file():
            raise CliError(f"calibration hidden states {args.calibration_hidden} not found")
        try:
            hidden = load_hidden_states(args.calibration_hidden)
        except Exception as e:  # noqa: BLE001 - safetensors reports a malformed file with its own types
            raise CliError(f"cannot read calibration hidden states {args.calibration_hidden}: {e}") from None
        source = "hidden_states"
    elif args.no_calibration:
        return None
    else:
        return _self_calibration_states(args, device)
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise CliError(
            f"calibration hidden states must be [N, {hidden_size}] (the head's hidden size), got {tuple(hidden.shape)}"
        )
    if hidden.shape[0] < _MIN_CALIBRATION_STATES:
        raise CliError(f"calibration needs at least {_MIN_CALIBRATION_STATES} hidden states, got {hidden.shape[0]}")
    if not bool(torch.isfinite(hidden).all()):
        raise CliError("calibration hidden states contain non-finite values")
    return hidden.float(), source


def _self_calibration_states(args: argparse.Namespace, device: str):
    """``(hidden, "self", record)`` from the model's own samples, or ``None`` (weight-only, with a warning)
    when the checkpoint cannot be run (no ``transformers``, a head-only file, an unknown architecture)."""
    from .flashhead.calibration import SELF_CALIBRATION_PROMPTS, generate_calibration_states, load_causal_lm

    try:
        model, tokenizer = load_causal_lm(args.model_dir, device)
    except RuntimeError as e:
        args.weight_only_reason = f"cannot run the model: {e}"
        print(
            f"warning: no self-calibration, {args.weight_only_reason}; building weight-only "
            "(pass --calibration TEXT_FILE, or --no-calibration to skip this attempt)"
        )
        return None
    print(
        f"self-calibration: sampling the model from {len(SELF_CALIBRATION_PROMPTS)} prompts"
        f" (at most {args.self_calibration_states:,} states, {args.self_calibration_seconds} s) on {device}"
    )
    sample = generate_calibration_states(
        model,
        tokenizer,
        max_states=args.self_calibration_states,
        time_budget_s=float(args.self_calibration_seconds),
        seed=args.seed,
        progress=not args.no_progress,
    )
    del model
    print(
        f"sampled {sample.hidden.shape[0]:,} states in {sample.seconds:.1f} s"
        + (" (time budget reached)" if sample.stopped_by_time else "")
    )
    if sample.hidden.shape[0] < _MIN_CALIBRATION_STATES:
        args.weight_only_reason = f"self-calibration sampled only {sample.hidden.shape[0]} states"
        print(f"warning: {args.weight_only_reason}; building weight-only")
        return None
    args.self_calibration_record = sample.record()
    return sample.hidden.float(), "self"


def _validation_states(args: argparse.Namespace, device: str) -> dict:
    """States of the model's own samples to validate a text calibration's n_probes on (empty when it cannot run)."""
    from .flashhead.calibration import generate_calibration_states, load_causal_lm

    if args.validation_states == 0:
        return {}
    try:
        model, tokenizer = load_causal_lm(args.model_dir, device)
    except RuntimeError as e:
        print(f"note: n_probes is validated on the held-out calibration states only ({e})")
        return {}
    sample = generate_calibration_states(
        model,
        tokenizer,
        max_states=args.validation_states,
        seed=args.seed + 1,
        time_budget_s=float(args.self_calibration_seconds),
        progress=not args.no_progress,
    )
    if sample.hidden.shape[0] < _MIN_CALIBRATION_STATES:
        return {}
    return {"model samples": sample.hidden}


def _build(args) -> int:
    from .flashhead import default_n_probes
    from .flashhead.assets import (
        load_lm_head,
        prepare_output_dir,
        read_config,
        save_clustering_cache,
        stop_and_special_token_ids,
        text_config,
        update_config,
    )
    from .flashhead.clustering import balanced_kmeans, cluster_capacities

    device = _device(args.device)
    config = read_config(args.model_dir)
    weight, key = load_lm_head(args.model_dir, config)
    vocab = text_config(config).get("vocab_size", config.get("vocab_size"))
    v = weight.shape[0] if vocab is None else int(vocab)
    if v > weight.shape[0]:
        raise CliError(f"config vocab_size {v} exceeds the {weight.shape[0]} rows of {key}")
    weight = weight[:v]
    n_clusters = cluster_capacities(v, args.cluster_size).numel()
    n_probes = args.n_probes if args.n_probes is not None else default_n_probes(n_clusters)
    if n_probes > n_clusters:
        raise CliError(f"--n-probes {n_probes} exceeds the {n_clusters} clusters")
    calibration = _calibration_states(args, weight.shape[1], device)
    target = prepare_output_dir(args.model_dir, args.output) if args.output else args.model_dir
    print(
        f"head {key}: {v:,} x {weight.shape[1]:,} ({weight.dtype}); {n_clusters:,} clusters of "
        f"{args.cluster_size} on {device}"
    )
    t0 = time.perf_counter()
    res = balanced_kmeans(
        weight,
        args.cluster_size,
        iterations=args.iterations,
        seed=args.seed,
        device=device,
        progress=not args.no_progress,
    )
    print(f"clustered in {time.perf_counter() - t0:.1f} s")
    centroids = res.centroids
    record = {"source": "none", "reason": getattr(args, "weight_only_reason", "--no-calibration")}
    tail = None
    if calibration is not None:
        centroids, n_probes, record = _calibrate(
            args, weight, res, calibration, stop_and_special_token_ids(args.model_dir, config), device
        )
        tail = _fit_tail(weight, calibration[0], device)
        record["tail_estimate"] = {"rank": tail.rank, "states": int(calibration[0].shape[0])}
    path = save_clustering_cache(target, centroids, res.assignments)
    _write_tail(target, tail)
    update_config(target, n_probes, calibration=record)
    if v % args.cluster_size:
        print(
            f"note: vocab {v} is not a multiple of {args.cluster_size}; cluster sizes differ by one "
            "(loads here, not in the public FlashHead plugin)"
        )
    print(f"wrote {path} and config.json (n_probes={n_probes})")
    return 0


def _calibrate(
    args: argparse.Namespace, weight, clustering, calibration: tuple, pinned: list[int], device: str
) -> tuple:
    """Fit the stage-1 vectors to the calibration states; returns ``(centroids, n_probes, config record)``."""
    from .flashhead.calibration import calibrate_stage1

    hidden, source = calibration
    validation = _validation_states(args, device) if source != "self" else {}
    t0 = time.perf_counter()
    cal = calibrate_stage1(
        weight,
        clustering.assignments,
        clustering.centroids,
        hidden,
        pinned_ids=pinned,
        target_agreement=args.target_agreement,
        confidence=args.target_confidence,
        n_probes=args.n_probes,
        seed=args.seed,
        margin=args.probe_margin,
        validation=validation,
        device=device,
        progress=not args.no_progress,
    )
    held, choice, target = int(cal.fit.heldout_rows.numel()), cal.choice, args.target_agreement
    print(
        f"calibrated stage 1 on {hidden.shape[0]:,} hidden states ({source}) in {time.perf_counter() - t0:.1f} s; "
        f"{held:,} held out"
    )
    variants = cal.variants
    if variants:
        print(
            "stage 1 under the probe rule: "
            + ", ".join(
                f"{name.replace('_', '-')} needs n_probes={rule.n_probes}"
                + ("" if rule.meets else " (does not meet the target)")
                for name, rule in variants.items()
            )
            + f"; {cal.stage1_reason}"
        )
    other = "weight-only" if cal.stage1 == "calibrated" else "calibrated"
    other_agreement = (
        cal.weight_only_same_probes if cal.stage1 == "calibrated" else cal.calibrated_same_probes
    ).agreement
    print(
        f"held-out top-1 agreement at n_probes={cal.n_probes} ({choice.scored_fraction:.1%} of the vocabulary "
        f"scored, {cal.num_pinned} pinned ids): {cal.stage1.replace('_', '-')} {choice.agreement:.4f} "
        f"(>= {choice.agreement_lower:.4f} with {args.target_confidence:.0%} confidence), {other} "
        f"{other_agreement:.4f}"
    )
    for name, (rows, alone, at) in cal.validation.items():
        print(
            f"validation on {rows:,} states of {name}: agreement {at.agreement:.4f} at n_probes={cal.n_probes} "
            f"(alone it needs n_probes={alone.n_probes})"
        )
    if args.n_probes is not None:
        if not choice.certified:
            print(f"warning: --n-probes {args.n_probes} does not show agreement {target} on the held-out states")
    elif not choice.reached:
        print(
            f"warning: no n_probes below all {clustering.num_clusters:,} clusters reaches top-1 agreement {target} "
            f"on the held-out states; writing n_probes={cal.n_probes} (lower --target-agreement or pass --n-probes)"
        )
    elif not choice.certified:
        print(
            f"warning: {held} held-out states cannot show agreement {target} with {args.target_confidence:.0%} "
            f"confidence below all clusters; n_probes={cal.n_probes} is the smallest whose held-out estimate "
            "reaches it (give more calibration text)"
        )
    record = {**cal.record(), "source": source}
    if source == "self":
        record["self_calibration"] = args.self_calibration_record
    return cal.centroids, cal.n_probes, record


def _fit_tail(weight, hidden, device: str):
    """Sampled rows' tail estimate fitted to the calibration states (``tail_estimate.safetensors``)."""
    from .flashhead.tail_estimate import default_tail_rank, fit_tail_factors

    t0 = time.perf_counter()
    rank = min(default_tail_rank(weight.shape[1]), *weight.shape)
    factors = fit_tail_factors(weight.to(device), weight.shape[0], rank, hidden.to(device))
    print(
        f"fitted the rank-{rank} tail estimate of sampled rows to the calibration states in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return factors


def _write_tail(target, factors) -> None:
    """Write the fitted tail estimate, or remove a stale one (a weight-only build serves the weight-only estimate)."""
    from .flashhead.assets import CACHE_DIR_NAME, TAIL_FILE_NAME, save_tail_factors

    if factors is not None:
        save_tail_factors(target, factors)
    else:
        (Path(target) / CACHE_DIR_NAME / TAIL_FILE_NAME).unlink(missing_ok=True)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _calibration_summary(record) -> str:
    """One line on how the assets' stage 1 was built, from config.json's ``flash_head_calibration``."""
    if not isinstance(record, dict):
        return "weight-only (no calibration record: built before calibration was recorded)"
    source = record.get("source")
    if source == "none":
        return f"weight-only ({record.get('reason', 'no reason recorded')})"
    what = {
        "self": "the model's own samples (self-calibration)",
        "text": "a calibration text",
        "hidden_states": "calibration hidden states",
    }.get(source, str(source))
    kept = record.get("stage1", "calibrated")
    summary = (
        f"calibrated on {record.get('rows', '?'):,} states of {what}; n_probes {record.get('n_probes')} chosen "
        f"for top-1 agreement {record.get('target_agreement')}"
    )
    if kept == "weight_only":
        summary += "; the weight-only stage 1 was kept (it needs fewer probes)"
    return summary


def _eval(args) -> int:
    import json

    from .flashhead import FlashHead
    from .flashhead.assets import (
        CALIBRATION_KEY,
        load_assets,
        load_lm_head,
        load_tail_factors,
        read_config,
        stop_and_special_token_ids,
    )
    from .flashhead.evaluate import (
        capture_hidden_states,
        dense_agreement,
        evaluate,
        format_fidelity_table,
        format_table,
        load_hidden_states,
        logit_postprocess,
        serving_fidelity,
        synthetic_hidden_states,
    )
    from .flashhead.settings import default_settings

    if args.plot is not None:
        from .flashhead.plot import require_matplotlib

        require_matplotlib()  # before any work: a missing extra fails at once
    device = _device(args.device)
    config = read_config(args.model_dir)
    cent, assign = load_assets(args.model_dir, config)
    weight, _ = load_lm_head(args.model_dir, config)
    v = assign.numel()
    if args.hidden_states and args.text:
        raise CliError("give --hidden or --text, not both")
    if args.hidden_states:
        hidden = load_hidden_states(args.hidden_states)
        source = f"hidden states from {args.hidden_states}"
    elif args.text:
        try:
            text = args.text.read_text()
        except OSError as e:
            raise CliError(f"cannot read {args.text}: {e}") from None
        hidden = capture_hidden_states(args.model_dir, text, max_tokens=args.samples, device=device)
        source = f"hidden states captured by running the model on {args.text}"
    else:
        hidden = synthetic_hidden_states(weight, args.samples, seed=args.seed, vocab_size=v)
        source = (
            "SYNTHETIC hidden states (aligned with random head rows plus noise; pass --hidden or --text for real ones)"
        )
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise CliError(f"hidden states must be [N, {weight.shape[1]}], got {tuple(hidden.shape)}")
    hidden = hidden[: args.samples].to(device)
    # Serving's settings (config.json, then the environment): the eval measures what a server would do.
    settings = default_settings(config, int(cent.shape[0]))
    head = FlashHead.from_settings(
        weight.to(device),
        cent,
        assign,
        vocab_size=v,
        tail_factors=load_tail_factors(args.model_dir, config),
        settings=settings,
    )
    if args.probes is not None:
        probes = sorted({min(p, head.num_clusters) for p in args.probes})
    else:
        probes = [settings.n_probes] if args.json else sorted({min(p, head.num_clusters) for p in DEFAULT_EVAL_PROBES})
    pinned = stop_and_special_token_ids(args.model_dir, config)
    fidelity = serving_fidelity(head, hidden, probes, pinned=pinned, postprocess=logit_postprocess(config))
    if args.plot is not None:
        _plot(args, head, hidden, probes, pinned, config)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model_dir),
                    "hidden_states": int(hidden.shape[0]),
                    "dtype": _dtype_name(weight.dtype),
                    "calibration": config.get(CALIBRATION_KEY),
                    "tail_estimate": "fitted" if head.tail_fitted else "weight-only",
                    "results": [r.as_dict() for r in fidelity],
                },
                indent=2,
            )
        )
        return 0
    rows, dense_ms = evaluate(head, hidden, probes)
    print(f"stage 1: {_calibration_summary(config.get(CALIBRATION_KEY))}")
    print(
        f"{source}; {hidden.shape[0]} samples; vocab {v:,}, {head.num_clusters:,} clusters of "
        f"{head.cluster_size}, backend {head.backend}, device {device}"
    )
    print(
        f"reference: dense head in float32 (hidden states {_dtype_name(hidden.dtype)}); FlashHead "
        f"chooses clusters in {_dtype_name(weight.dtype)}, as served; a tie with the maximum agrees"
    )
    if weight.is_floating_point() and weight.element_size() < 4:
        print(
            f"for comparison, the dense head in {_dtype_name(weight.dtype)} picks a float32 argmax on "
            f"{dense_agreement(head, hidden):.2%} of rows (rounding, not FlashHead)"
        )
    print(format_table(rows, dense_ms, v))
    print()
    print(
        f"serving fidelity: the logits a server hands to vLLM's sampler ({len(pinned)} pinned ids scored on "
        "every row; sampled rows estimate the logits outside the clusters they probe with the "
        + ("estimate fitted to the calibration states)" if head.tail_fitted else "weight-only estimate)")
    )
    print(format_fidelity_table(fidelity))
    return 0


#: The builder's default ``--target-agreement``: the promise drawn on a plot of assets without a calibration record.
DEFAULT_TARGET_AGREEMENT = 0.995


def _plot(args, head, hidden, probes: list[int], pinned, config: dict) -> None:
    """``eval --plot``: the agreement and sampled-TV curves as a PNG (message on stderr under ``--json``)."""
    from .flashhead.assets import CALIBRATION_KEY
    from .flashhead.evaluate import fidelity_curves, logit_postprocess, plot_probe_counts
    from .flashhead.plot import plot_fidelity

    record = config.get(CALIBRATION_KEY)
    target = record.get("target_agreement") if isinstance(record, dict) else None
    target = float(target) if isinstance(target, (int, float)) else DEFAULT_TARGET_AGREEMENT
    curves = fidelity_curves(
        head,
        hidden,
        plot_probe_counts(head.num_clusters, head.n_probes, probes),
        pinned=pinned,
        postprocess=logit_postprocess(config),
    )
    title = (
        f"{Path(args.model_dir).name}: FlashHead vs the dense head on {hidden.shape[0]:,} hidden states "
        f"(vocab {head.vocab_size:,}, {head.num_clusters:,} clusters of {head.cluster_size})"
    )
    path = plot_fidelity(args.plot, curves, served_n_probes=head.n_probes, target_agreement=target, title=title)
    print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)


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
