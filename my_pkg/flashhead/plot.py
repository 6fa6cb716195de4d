"""A PNG of FlashHead's fidelity against the share of the head's rows it scores (``eval --plot``).

Left: top-1 agreement of greedy rows per probe count, with the promised agreement as a line and the
served probe count marked. Right: the sampled rows' total-variation distance to the dense sampling
distribution per (temperature, top-p), against the rows a sampled row scores (its estimate's rank
swept), with the served setting marked.

matplotlib is optional (``pip install 'my-pkg[plot]'``); it is imported only when a plot is drawn,
through its object API (no pyplot, no global backend change).
"""

from __future__ import annotations

from pathlib import Path

from .curves import FidelityCurves

__all__ = ["PlotUnavailable", "require_matplotlib", "plot_fidelity"]

INSTALL_HINT = "pip install 'my-pkg[plot]' (or: pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` (with how to install it) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as e:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed ({e}); {INSTALL_HINT}") from None


def plot_fidelity(
    path: str | Path,
    curves: FidelityCurves,
    *,
    served_n_probes: int,
    target_agreement: float | None = None,
    title: str = "",
) -> Path:
    """Draw ``curves`` (:func:`~my_pkg.flashhead.curves.fidelity_curves`) into a PNG at ``path``; returns it.

    ``served_n_probes``: the probe count marked on the agreement curve; ``target_agreement``: the promised
    top-1 agreement, drawn as a horizontal line (none when None).
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not curves.greedy:
        raise ValueError("no probe counts to plot")
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)

    greedy = sorted(curves.greedy, key=lambda r: r.scored_fraction)
    xs = [100 * r.scored_fraction for r in greedy]
    left.plot(xs, [100 * r.top1_agreement for r in greedy], marker="o", color="tab:blue", label="top-1 agreement")
    if target_agreement is not None:
        left.axhline(100 * target_agreement, color="tab:red", linestyle="--", label=f"promise {target_agreement:.1%}")
    served = [r for r in greedy if r.n_probes == served_n_probes]
    if served:
        s = served[0]
        left.plot(
            [100 * s.scored_fraction],
            [100 * s.top1_agreement],
            marker="*",
            markersize=16,
            color="tab:orange",
            linestyle="none",
            label=f"served: n_probes={s.n_probes} ({s.top1_agreement:.2%})",
        )
    for r in greedy:
        left.annotate(str(r.n_probes), (100 * r.scored_fraction, 100 * r.top1_agreement), fontsize=7,
                      textcoords="offset points", xytext=(3, -9))  # fmt: skip
    left.set_xlabel("rows scored per greedy row (% of the vocabulary)")
    left.set_ylabel("top-1 agreement with the dense head (%)")
    left.set_title("greedy rows (labels: n_probes)", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(loc="lower right", fontsize=8)

    sampled = sorted(curves.sampled, key=lambda r: r.sampling[0].scored_fraction if r.sampling else 0.0)
    settings = [(x.temperature, x.top_p) for x in sampled[0].sampling] if sampled and sampled[0].sampling else []
    for i, (temperature, top_p) in enumerate(settings):
        line = right.plot(
            [100 * r.sampling[i].scored_fraction for r in sampled],
            [r.sampling[i].tv_distance for r in sampled],
            marker="o",
            label=f"T={temperature:g}, top_p={top_p:g}",
        )[0]
        for r in sampled:
            if r.sampled_rank == curves.served_rank:
                right.plot(
                    [100 * r.sampling[i].scored_fraction],
                    [r.sampling[i].tv_distance],
                    marker="*",
                    markersize=16,
                    color=line.get_color(),
                    linestyle="none",
                )
    right.set_xlabel("rows scored per sampled row (% of the vocabulary)")
    right.set_ylabel("mean total-variation distance")
    right.set_title(f"sampled rows (estimate's rank swept; star: served, rank {curves.served_rank})", fontsize=10)
    right.grid(alpha=0.3)
    if settings:
        right.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    fig.savefig(str(path), format="png")
    return path
