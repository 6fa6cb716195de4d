"""Random FlashHead heads for the unit tests: one builder instead of a copy per test file."""

from __future__ import annotations

from typing import Any, Literal

import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.clustering import random_balanced_assignment


def random_head(
    vocab: int,
    hidden: int,
    *,
    pad: int = 0,
    n_probes: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    assignment_seed: int | None = None,
    centroids: Literal["mean", "random"] = "mean",
    spectrum: bool = False,
    backend: str = "torch",
    cluster_size: int = 16,
    **kwargs: Any,
) -> tuple[FlashHead, torch.Generator]:
    """A head over a random `[vocab + pad, hidden]` weight (`pad` rows past the vocabulary, as vLLM
    pads), clusters of `cluster_size` assigned at random, and the generator that drew it (to draw
    hidden states from the same stream).

    `centroids`: the mean of each cluster's rows, or random vectors (stage 1 then ranks clusters
    arbitrarily, which stresses the candidate logic). `spectrum`: scale the hidden dimensions by a
    decaying spectrum, as trained LM heads have.
    """
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab + pad, hidden, generator=generator)
    if spectrum:
        weight = weight * (torch.arange(hidden) + 1.0) ** -0.5
    weight = weight.to(dtype)
    assignments = random_balanced_assignment(
        vocab, cluster_size, seed=seed if assignment_seed is None else assignment_seed
    )
    clusters = int(assignments.max()) + 1
    if centroids == "random":
        cent = torch.randn(clusters, hidden, generator=generator)
    else:
        rows = weight[:vocab].float()
        cent = torch.stack([rows[assignments == c].mean(0) for c in range(clusters)])
    head = FlashHead(
        weight, cent, assignments, vocab_size=vocab, n_probes=min(n_probes, clusters), backend=backend, **kwargs
    )
    return head, generator
