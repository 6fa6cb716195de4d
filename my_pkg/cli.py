"""Command line interface: ``my-pkg flashhead build|eval``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]


class CliError(Exception):
    """An error reported to the user as one line on stderr."""


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("probe counts must be >= 1")
    return vals


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="my-pkg", description="my_pkg tools")
    sub = p.add_subparsers(dest="command", required=True)
    fh = sub.add_parser("flashhead", help="FlashHead assets: build and evaluate")
    fsub = fh.add_subparsers(dest="action", required=True)

    b = fsub.add_parser("build", help="cluster the LM head and write flash_head_assets/ + config.json")
    b.add_argument("model_dir", type=Path)
    b.add_argument("--cluster-size", type=_positive, default=16)
    b.add_argument("--n-probes", type=_positive, default=None,
                   help="probes written to config.json (default: about 1/32 of the clusters)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--iterations", type=_positive, default=20)
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    b.add_argument("--output", type=Path, default=None, help="write a converted copy here instead of editing in place")
    b.add_argument("--no-progress", action="store_true")

    e = fsub.add_parser("eval", help="agreement of FlashHead with the dense head per n_probes")
    e.add_argument("model_dir", type=Path)
    e.add_argument("--hidden-states", type=Path, default=None, help="safetensors file with [N, hidden] states")
    e.add_argument("--text", type=Path, default=None, help="text file: capture states by running the model")
    e.add_argument("--probes", type=_int_list, default=[8, 16, 32, 64, 128, 256, 512])
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


def _build(args) -> int:
    from .flashhead import default_n_probes
    from .flashhead.assets import (load_lm_head, prepare_output_dir, read_config, save_clustering_cache,
                                   text_config, update_config)
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
    target = prepare_output_dir(args.model_dir, args.output) if args.output else args.model_dir
    print(f"head {key}: {v:,} x {weight.shape[1]:,} ({weight.dtype}); {n_clusters:,} clusters of "
          f"{args.cluster_size} on {device}")
    t0 = time.perf_counter()
    res = balanced_kmeans(weight, args.cluster_size, iterations=args.iterations, seed=args.seed,
                          device=device, progress=not args.no_progress)
    dt = time.perf_counter() - t0
    path = save_clustering_cache(target, res.centroids, res.assignments)
    update_config(target, n_probes)
    if v % args.cluster_size:
        print(f"note: vocab {v} is not a multiple of {args.cluster_size}; cluster sizes differ by one "
              "(loads here, not in the public FlashHead plugin)")
    print(f"clustered in {dt:.1f} s; wrote {path} and config.json (n_probes={n_probes})")
    return 0


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _eval(args) -> int:
    from .flashhead import FlashHead
    from .flashhead.assets import load_assets, load_lm_head, read_config
    from .flashhead.evaluate import (capture_hidden_states, dense_agreement, evaluate, format_table,
                                     load_hidden_states, synthetic_hidden_states)

    device = _device(args.device)
    config = read_config(args.model_dir)
    cent, assign = load_assets(args.model_dir, config)
    weight, _ = load_lm_head(args.model_dir, config)
    v = assign.numel()
    if args.hidden_states and args.text:
        raise CliError("give --hidden-states or --text, not both")
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
        source = ("SYNTHETIC hidden states (aligned with random head rows plus noise; "
                  "pass --hidden-states or --text for real ones)")
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise CliError(f"hidden states must be [N, {weight.shape[1]}], got {tuple(hidden.shape)}")
    hidden = hidden[: args.samples].to(device)
    head = FlashHead(weight.to(device), cent, assign, vocab_size=v, n_probes=1)
    probes = sorted({min(p, head.num_clusters) for p in args.probes})
    rows, dense_ms = evaluate(head, hidden, probes)
    print(f"{source}; {hidden.shape[0]} samples; vocab {v:,}, {head.num_clusters:,} clusters of "
          f"{head.cluster_size}, backend {head.backend}, device {device}")
    print(f"reference: dense head in float32 (hidden states {_dtype_name(hidden.dtype)}); FlashHead "
          f"chooses clusters in {_dtype_name(weight.dtype)}, as served; a tie with the maximum agrees")
    if weight.is_floating_point() and weight.element_size() < 4:
        print(f"for comparison, the dense head in {_dtype_name(weight.dtype)} picks a float32 argmax on "
              f"{dense_agreement(head, hidden):.2%} of rows (rounding, not FlashHead)")
    print(format_table(rows, dense_ms, v))
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
