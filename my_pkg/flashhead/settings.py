"""FlashHead's serving settings and their defaults at start-up (environment, then config.json).

The engine's controller starts from them in every worker, and `my-pkg flashhead eval` measures with
them, so the eval sees what a server would do; neither half imports the other for it. What they give a
head of given sizes is `my_pkg.flashhead.spec.HeadSpec.resolve`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from my_pkg import env

from .spec import default_n_probes

__all__ = [
    "FlashHeadSettings",
    "default_settings",
]

logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class FlashHeadSettings:
    enabled: bool
    n_probes: int
    dense_batch_threshold: int | None  # steps with more rows go dense; None: never, per request only
    # The environment left the threshold unset: the head measures where the dense head is faster
    # (`my_pkg.flashhead.step_costs`): on CPU such steps take the masked way, on a GPU a slower head stands down.
    measure_step_costs: bool
    probe_sampling: bool  # sampled rows get estimated logits, the best-estimated tokens and sampled_n_probes exact
    sampled_n_probes: int | None  # clusters a sampled row probes; None: spec.default_sampled_n_probes
    sampled_rank: int | None  # rank of the residual term of sampled rows' estimates; None: the head's default
    backend: str
    cluster_rows: bool | None  # the head's `cluster_rows`: None where it helps (a CPU head), False never
    fidelity_every: int  # check one FlashHead row in this many against the dense head; 0 = off
    # Sampled rows drawn by the plugin from the compact law (`my_pkg.flashhead.compact_law`) where they qualify.
    compact_sampling: bool = True


def default_settings(config: dict[str, Any], num_clusters: int | None) -> FlashHeadSettings:
    """Settings at start-up: environment overrides config.json, which overrides defaults."""
    configured_probes = config.get("n_probes")
    fallback_probes = default_n_probes(num_clusters) if num_clusters else 1
    n_probes = env.MY_PKG_FLASHHEAD_N_PROBES
    if n_probes is None:
        n_probes = (
            int(configured_probes) if isinstance(configured_probes, int) and configured_probes > 0 else fallback_probes
        )
    if num_clusters is not None and n_probes > num_clusters:
        logger.warning("my_pkg: n_probes=%d exceeds %d clusters; using %d", n_probes, num_clusters, num_clusters)
        n_probes = num_clusters
    threshold = env.MY_PKG_FLASHHEAD_DENSE_BATCH_THRESHOLD
    return FlashHeadSettings(
        enabled=env.MY_PKG_FLASHHEAD,
        n_probes=n_probes,
        dense_batch_threshold=None if threshold == "never" else threshold,
        measure_step_costs=threshold is None,
        probe_sampling=env.MY_PKG_FLASHHEAD_PROBE_SAMPLING,
        sampled_n_probes=_sampled_probes_from_env(num_clusters),
        sampled_rank=env.MY_PKG_FLASHHEAD_SAMPLED_RANK,
        backend=env.MY_PKG_FLASHHEAD_BACKEND,
        cluster_rows=None if env.MY_PKG_FLASHHEAD_CLUSTER_ROWS else False,
        fidelity_every=env.MY_PKG_FLASHHEAD_FIDELITY_EVERY,
        compact_sampling=env.MY_PKG_FLASHHEAD_COMPACT_SAMPLING,
    )


def _sampled_probes_from_env(num_clusters: int | None) -> int | None:
    value = env.MY_PKG_FLASHHEAD_SAMPLED_N_PROBES
    if value is not None and num_clusters is not None and value > num_clusters:
        logger.warning("my_pkg: sampled_n_probes=%d exceeds %d clusters; using %d", value, num_clusters, num_clusters)
        value = num_clusters
    return value
