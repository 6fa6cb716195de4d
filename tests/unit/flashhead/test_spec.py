"""`HeadSpec.resolve`: the settings and the assets' sizes give the values a head serves with."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.clustering import random_balanced_assignment
from my_pkg.flashhead.spec import HeadSpec, default_n_probes, default_sampled_rank
from my_pkg.flashhead.tail_estimate import fit_tail_factors

VOCAB, HIDDEN, CLUSTERS = 512, 32, 32


@dataclasses.dataclass
class _Settings:
    n_probes: int = 4
    probe_sampling: bool = True
    sampled_n_probes: int | None = None
    sampled_rank: int | None = None
    backend: str = "torch"
    cluster_rows: bool | None = None


def test_default_n_probes():
    assert default_n_probes(8016) == 251
    assert default_n_probes(5) == 5
    assert 1 <= default_n_probes(1) <= 1


def _assets(fitted: bool):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    assignments = random_balanced_assignment(VOCAB, VOCAB // CLUSTERS, seed=0)
    centroids = torch.randn(CLUSTERS, HIDDEN, generator=generator)
    factors = fit_tail_factors(weight, VOCAB, 4, torch.randn(64, HIDDEN, generator=generator)) if fitted else None
    return weight, centroids, assignments, factors


@pytest.mark.parametrize("fitted", [False, True])
@pytest.mark.parametrize(
    "settings",
    [
        _Settings(),
        _Settings(sampled_rank=0),
        _Settings(sampled_rank=10_000),  # above the hidden size: clamped
        _Settings(sampled_n_probes=3),
        _Settings(probe_sampling=False),
        _Settings(n_probes=CLUSTERS),
    ],
)
def test_the_spec_is_what_the_head_serves(settings, fitted):
    weight, centroids, assignments, factors = _assets(fitted)
    fitted_rank = factors.rank if factors is not None else 0
    spec = HeadSpec.resolve(
        settings, num_clusters=CLUSTERS, vocab_size=VOCAB, hidden_size=HIDDEN, fitted_rank=fitted_rank
    )
    head = FlashHead.from_settings(weight, centroids, assignments, settings=settings, tail_factors=factors)
    assert (head.n_probes, head.sampled_rank, head.backend) == (spec.n_probes, spec.sampled_rank, spec.backend)
    assert head.sampled_rescore == spec.sampled_rescore
    if settings.probe_sampling:
        assert head.sampled_n_probes == spec.sampled_n_probes
    else:  # sampled rows are served as greedy ones
        assert spec.sampled_n_probes == settings.n_probes
    if settings.sampled_rank is None:
        assert spec.sampled_rank == default_sampled_rank(VOCAB, HIDDEN, fitted_rank=fitted_rank)


def test_an_unset_sampled_probe_count_follows_the_greedy_one():
    weight, centroids, assignments, _ = _assets(False)
    head = FlashHead.from_settings(weight, centroids, assignments, settings=_Settings(sampled_rank=0))
    head.n_probes = 7
    assert head.sampled_n_probes == 7
