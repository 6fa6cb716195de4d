"""The head's parameters: the default policy of greedy and sampled rows, resolved once into a :class:`HeadSpec`.

Contract: :meth:`HeadSpec.resolve` turns the serving settings (:mod:`~my_pkg.flashhead.settings`) and the
assets' sizes (clusters ``C``, vocabulary ``V``, hidden size ``H``, the rank of the fitted tail estimate)
into the values a :class:`~my_pkg.flashhead.head.FlashHead` serves with; :meth:`HeadSpec.head_options` are
its constructor's arguments.  The head, the controller's status, the eval and the benchmarks take their
defaults from the functions here, so the values reported are the values served.

Imports only the tail estimate's default rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from .tail_estimate import default_tail_rank

__all__ = [
    "SAMPLED_ROW_BUDGET",
    "HeadSettings",
    "HeadSpec",
    "default_n_probes",
    "default_sampled_n_probes",
    "default_sampled_rank",
    "default_sampled_rescore",
    "resolve_sampled_n_probes",
    "rows_scored",
]


def default_n_probes(num_clusters: int) -> int:
    """Probe count of a greedy row when the assets give none: about 1/32 of the clusters (256 of 8,016
    for a 128k vocabulary), at least 8.  The builder writes it (or its calibrated choice) into
    ``config.json``; serving falls back to it for assets without ``n_probes``."""
    return max(1, min(num_clusters, max(8, math.ceil(num_clusters / 32))))


def rows_scored(
    num_clusters: int,
    n_probes: int,
    cluster_size: int,
    *,
    pinned: int = 0,
    rank: int = 0,
    hidden_size: int = 1,
    vocab_size: int = 0,
) -> int:
    """Head rows scored for one row of a step: ``C`` centroids and ``P * cluster_size`` candidates (neither
    when ``P`` is 0: no stage 1), and the ``pinned`` ids; a rank-``rank`` tail estimate (sampled rows) adds
    its ``rank * (H + V)`` multiply-adds counted in rows of ``H``.  The one formula behind every "rows
    scored" figure."""
    estimate = math.ceil(rank * (hidden_size + vocab_size) / hidden_size) if rank else 0
    return (num_clusters if n_probes else 0) + n_probes * cluster_size + pinned + estimate


def default_sampled_n_probes(n_probes: int, num_clusters: int, sampled_rank: int) -> int:
    """Clusters a sampled row probes when not set: none while the row has an estimate (``sampled_rank`` > 0),
    which then chooses the row's exact tokens by itself, so the row skips stage 1; without an estimate, or
    when greedy rows probe every cluster (every row then gets the dense logits), the greedy rows'
    ``n_probes`` (at most ``C``).  On the trained fixture the estimate's best tokens, scored exactly, gave the
    TV on shifted text of as many exact tokens split between probed clusters and rescored ones (a little
    lower) at fewer rows scored (docs/research/sampling.md, "Sampled rows on shifted text")."""
    probes = max(1, min(num_clusters, n_probes))
    return 0 if sampled_rank and probes < num_clusters else probes


def resolve_sampled_n_probes(configured: int | None, n_probes: int, num_clusters: int, sampled_rank: int) -> int:
    """The clusters a sampled row probes: ``configured``, but :func:`default_sampled_n_probes` when it is None,
    or 0 without an estimate to choose the row's exact tokens (``sampled_rank`` 0)."""
    if configured is None or (configured == 0 and not sampled_rank):
        return default_sampled_n_probes(n_probes, num_clusters, sampled_rank)
    return configured


def default_sampled_rescore(vocab_size: int, *, fitted: bool = True) -> int:
    """Tokens a sampled row scores exactly besides its candidates when not set: the best-estimated
    ``ceil(V / 32)`` (4,008 for a 128k vocabulary), or ``ceil(V / 16)`` when the estimate is the weight-only
    one (not ``fitted`` to calibration states), which ranks the tokens worse.  On the trained fixture both
    met TV <= 0.01 at T=0.7/top_p=0.9 and <= 0.02 at T=1 on shifted text without any probed cluster, where
    the weight-only estimate with ``V / 32`` missed T=1 (docs/research/sampling.md, "Sampled rows on shifted text")."""
    return math.ceil(vocab_size / (32 if fitted else 16))


#: Share of the dense head's multiply-adds that a sampled row spends at most by default when its estimate is
#: fitted (pinned ids aside): the estimate's rank is lowered where ``ceil(H / 8)`` and the exact tokens would
#: cost more (:func:`default_sampled_rank`).
SAMPLED_ROW_BUDGET = 0.15


def default_sampled_rank(vocab_size: int, hidden_size: int, *, fitted_rank: int = 0) -> int:
    """Rank of a sampled row's estimate when not set: ``ceil(H / 8)``, at most 64
    (:func:`~my_pkg.flashhead.tail_estimate.default_tail_rank`).  With fitted factors of rank ``fitted_rank``
    it is lowered, where needed, so that the estimate (``r * (H + V) / H`` rows) and its
    :func:`default_sampled_rescore` exact tokens stay within :data:`SAMPLED_ROW_BUDGET` of the ``V`` rows:
    never at 2,048-wide heads (64 of at most 239 at 128,256 x 2,048), 29 instead of 32 on the trained fixture's
    8,192 x 256.  The weight-only estimate (no factors) keeps ``ceil(H / 8)``: it ranks the tokens worse, and on
    the fixture no rank within the budget met the TV targets with it (docs/research/sampling.md, "Sampled rows on
    shifted text")."""
    rank = default_tail_rank(hidden_size)
    spare = SAMPLED_ROW_BUDGET * vocab_size - default_sampled_rescore(vocab_size)
    within = max(1, min(rank, math.floor(spare * hidden_size / (hidden_size + vocab_size))))
    return within if within <= fitted_rank else rank


def tail_fitted(sampled_rank: int, vocab_size: int, fitted_rank: int) -> bool:
    """Whether a rank-``sampled_rank`` estimate is the fitted one: factors of ``fitted_rank`` >= it exist."""
    return 0 < min(sampled_rank, vocab_size) <= fitted_rank


class HeadSettings(Protocol):
    """The serving settings a head is resolved from (:class:`~my_pkg.flashhead.settings.FlashHeadSettings`)."""

    n_probes: int
    probe_sampling: bool
    sampled_n_probes: int | None
    sampled_rank: int | None
    backend: str
    cluster_rows: bool | None


@dataclass(frozen=True)
class HeadSpec:
    """A head's resolved parameters (see :meth:`resolve`).

    Attributes:
        n_probes: clusters a greedy row probes.
        sampled_n_probes: clusters a sampled row probes as served: the greedy rows' count without probe
            sampling, else :func:`resolve_sampled_n_probes`.
        sampled_rank: rank of a sampled row's estimate: the configured one at most ``H``, else
            :func:`default_sampled_rank`.
        sampled_rescore: a sampled row's best-estimated tokens scored exactly (:func:`default_sampled_rescore`).
        configured_sampled_n_probes: the setting itself; None lets the head follow ``n_probes`` as it changes.
        backend: the kernels' backend name (``"auto"`` resolves on the head's device).
        cluster_rows: the head's ``cluster_rows`` argument (None: where it helps).
    """

    n_probes: int
    sampled_n_probes: int
    sampled_rank: int
    sampled_rescore: int
    configured_sampled_n_probes: int | None
    backend: str
    cluster_rows: bool | None

    @classmethod
    def resolve(
        cls,
        settings: HeadSettings,
        *,
        num_clusters: int,
        vocab_size: int,
        hidden_size: int,
        fitted_rank: int = 0,
    ) -> HeadSpec:
        """The parameters `settings` give a head of ``num_clusters`` clusters over ``vocab_size`` tokens (a
        tensor-parallel rank's shard) of ``hidden_size``, whose fitted tail estimate has rank ``fitted_rank``
        (0: none)."""
        configured_rank = settings.sampled_rank
        if configured_rank is None:
            rank = default_sampled_rank(vocab_size, hidden_size, fitted_rank=fitted_rank)
        else:  # the head refuses a rank above its hidden size
            rank = min(configured_rank, hidden_size)
        if settings.probe_sampling:
            sampled_probes = resolve_sampled_n_probes(settings.sampled_n_probes, settings.n_probes, num_clusters, rank)
        else:
            sampled_probes = min(settings.n_probes, num_clusters)
        fitted = tail_fitted(rank, vocab_size, fitted_rank)
        return cls(
            n_probes=settings.n_probes,
            sampled_n_probes=sampled_probes,
            sampled_rank=rank,
            sampled_rescore=default_sampled_rescore(vocab_size, fitted=fitted),
            configured_sampled_n_probes=settings.sampled_n_probes,
            backend=settings.backend,
            cluster_rows=settings.cluster_rows,
        )

    def head_options(self) -> dict[str, Any]:
        """The :class:`~my_pkg.flashhead.head.FlashHead` keyword arguments of this spec."""
        return {
            "n_probes": self.n_probes,
            "backend": self.backend,
            "cluster_rows": self.cluster_rows,
            "sampled_n_probes": self.configured_sampled_n_probes,
            "sampled_rank": self.sampled_rank,
        }
