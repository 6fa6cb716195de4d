"""FlashHead: clustered two-stage LM head (independent of vLLM).

Imports only torch/safetensors/numpy/tqdm; Triton is imported lazily by the Triton backend.
"""

from __future__ import annotations

import math

from .assets import FlashHeadAssetError, load_assets, load_lm_head
from .clustering import balanced_kmeans
from .head import FlashHead

__all__ = ["FlashHead", "FlashHeadAssetError", "load_assets", "load_lm_head", "balanced_kmeans",
           "default_n_probes"]


def default_n_probes(num_clusters: int) -> int:
    """Recommended probe count: about 1/32 of the clusters (256 of 8,016 for a 128k vocabulary)."""
    return max(1, min(num_clusters, max(8, math.ceil(num_clusters / 32))))
