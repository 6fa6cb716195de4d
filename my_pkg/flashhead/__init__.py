"""FlashHead: clustered two-stage LM head (independent of vLLM).

Imports only torch/safetensors/numpy/tqdm; Triton is imported lazily by the Triton backend.
"""

from __future__ import annotations

from .assets import FlashHeadAssetError, load_assets, load_lm_head
from .clustering import balanced_kmeans
from .head import FlashHead
from .spec import default_n_probes, rows_scored

__all__ = [
    "FlashHead",
    "FlashHeadAssetError",
    "load_assets",
    "load_lm_head",
    "balanced_kmeans",
    "default_n_probes",
    "rows_scored",
]
