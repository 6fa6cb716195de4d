"""Sampled rows' tail estimate: the weight-only and the data-aware fits, their tables, and the assets file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.assets import (
    CACHE_DIR_NAME,
    TAIL_FILE_NAME,
    FlashHeadAssetError,
    load_tail_factors,
    save_tail_factors,
)
from my_pkg.flashhead.tail_estimate import (
    TailFactors,
    TailTables,
    build_tail_tables,
    fit_tail_factors,
    top_k_ids,
)
from tests.support.heads import random_head

VOCAB, HIDDEN, RANK = 640, 48, 6


def _weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, HIDDEN, generator=g) * torch.linspace(1.5, 0.2, HIDDEN)


def _states(rows: int, seed: int) -> torch.Tensor:
    """Anisotropic decode-like states: most of their energy in a few directions the head's top singular
    vectors do not favour, plus a common offset."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.full((HIDDEN,), 0.1)
    scale[-8:] = 3.0  # the head's weakest directions carry the states
    return torch.randn(rows, HIDDEN, generator=g) * scale + 0.5


def _logit_error(weight: torch.Tensor, tables: TailTables, states: torch.Tensor) -> float:
    return float(((tables.estimates(states) - states @ weight.T) ** 2).mean())


def test_the_data_aware_fit_estimates_unseen_states_of_the_same_kind_better_than_the_weight_only_fit():
    weight, fit_on, unseen = _weight(), _states(2000, seed=1), _states(500, seed=2)
    plain = build_tail_tables(weight, VOCAB, RANK)
    aware = TailTables.from_factors(weight, VOCAB, fit_tail_factors(weight, VOCAB, RANK, fit_on))
    assert _logit_error(weight, aware, unseen) < 0.5 * _logit_error(weight, plain, unseen)
    # At full rank both are exact.
    full = TailTables.from_factors(weight, VOCAB, fit_tail_factors(weight, VOCAB, HIDDEN, fit_on))
    torch.testing.assert_close(full.estimates(unseen), unseen @ weight.T, rtol=1e-3, atol=1e-3)


def test_weight_only_factors_are_the_tables_the_head_built_before():
    weight = _weight()
    factors = fit_tail_factors(weight, VOCAB, RANK)
    assert torch.equal(factors.left, factors.right)
    tables = build_tail_tables(weight, VOCAB, RANK)
    assert torch.equal(tables.basis, factors.left) and torch.equal(tables.projected, weight @ factors.right)


def test_truncated_factors_keep_the_leading_columns():
    factors = fit_tail_factors(_weight(), VOCAB, RANK, _states(300, seed=3))
    low = factors.truncated(2)
    assert low.rank == 2 and torch.equal(low.left, factors.left[:, :2]) and torch.equal(low.right, factors.right[:, :2])
    with pytest.raises(ValueError, match="rank must lie in"):
        factors.truncated(RANK + 1)


@pytest.mark.parametrize(
    "states, message",
    [
        (torch.randn(10, HIDDEN + 1), "states must be"),
        (torch.empty(0, HIDDEN), "states must be"),
        (torch.full((4, HIDDEN), float("nan")), "non-finite"),
    ],
)
def test_bad_states_are_refused(states, message):
    with pytest.raises(ValueError, match=message):
        fit_tail_factors(_weight(), VOCAB, RANK, states)


def test_a_head_uses_fitted_factors_up_to_their_rank_and_the_weight_only_fit_above():
    head, _ = random_head(VOCAB, HIDDEN, n_probes=2, spectrum=True)
    factors = fit_tail_factors(head.weight, VOCAB, RANK, _states(400, seed=4))
    fitted = FlashHead(
        head.weight, head.centroids, _assignments(head), n_probes=2, sampled_rank=RANK - 2, tail_factors=factors
    )
    assert fitted.tail_fitted
    hidden = _states(3, seed=5)
    expected = TailTables.from_factors(head.weight, VOCAB, factors.truncated(RANK - 2)).estimates(hidden)
    fitted.sampled_n_probes, fitted.sampled_rescore = 1, 0  # estimates everywhere outside one cluster
    logits = fitted.step_logits(hidden, sampled=np.ones(3, bool))
    probed = fitted.members[fitted.select_probes(hidden, n_probes=1)].reshape(3, -1)
    outside = torch.ones_like(logits, dtype=torch.bool).scatter_(1, probed, False)
    torch.testing.assert_close(logits[outside], expected[outside])
    fitted.sampled_rank = 0  # no estimate at all
    assert not fitted.tail_fitted
    fitted.sampled_rank = RANK + 1
    assert not fitted.tail_fitted
    assert fitted._tail_tables().rank == RANK + 1  # the weight-only fit at the higher rank
    torch.testing.assert_close(fitted._tail_tables().basis, build_tail_tables(head.weight, VOCAB, RANK + 1).basis)


def _assignments(head: FlashHead) -> torch.Tensor:
    cluster = torch.empty(head.vocab_size, dtype=torch.long)
    cluster[head.members.flatten()] = torch.arange(head.num_clusters).repeat_interleave(head.cluster_size)
    return cluster


def test_assets_round_trip_and_a_missing_file_means_weight_only(tmp_path):
    config = {"hidden_size": HIDDEN, "flash_head_cache_dir": CACHE_DIR_NAME}
    assert load_tail_factors(tmp_path, config) is None
    factors = fit_tail_factors(_weight(), VOCAB, RANK, _states(300, seed=6))
    path = save_tail_factors(tmp_path, factors)
    assert path == tmp_path / CACHE_DIR_NAME / TAIL_FILE_NAME
    loaded = load_tail_factors(tmp_path, config)
    assert isinstance(loaded, TailFactors) and torch.equal(loaded.left, factors.left)
    assert torch.equal(loaded.right, factors.right)


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({"left": torch.zeros(HIDDEN, 2)}, "missing tensor"),
        ({"left": torch.zeros(HIDDEN, 2), "right": torch.zeros(HIDDEN, 3)}, "must both be"),
        ({"left": torch.zeros(HIDDEN + 1, 2), "right": torch.zeros(HIDDEN + 1, 2)}, "hidden size"),
        ({"left": torch.full((HIDDEN, 2), float("inf")), "right": torch.zeros(HIDDEN, 2)}, "non-finite"),
    ],
)
def test_a_bad_tail_file_is_an_asset_error(tmp_path, tensors, message):
    (tmp_path / CACHE_DIR_NAME).mkdir()
    save_file(tensors, str(tmp_path / CACHE_DIR_NAME / TAIL_FILE_NAME))
    with pytest.raises(FlashHeadAssetError, match=message):
        load_tail_factors(tmp_path, {"hidden_size": HIDDEN})


@pytest.mark.parametrize("width", [4, 7, 640, 643])
@pytest.mark.parametrize("k", [1, 3, 100, 400])
def test_top_k_ids_picks_the_values_topk_picks(width, k):
    k = min(k, width)
    values = torch.randn(5, width, generator=torch.Generator().manual_seed(width + k))
    values[1, : width // 2] = float("-inf")  # excluded tokens (a row's candidates)
    values[2, -1] = 100.0  # the best value in the last, partial block
    k = min(k, width - width // 2)
    got = top_k_ids(values, k)
    assert got.shape == (5, k) and all(len(set(row.tolist())) == k for row in got)
    want = torch.topk(values, k, dim=1).values
    assert torch.equal(values.gather(1, got).sort(dim=1, descending=True).values, want)


def test_the_tables_do_not_depend_on_torchs_default_dtype():
    """vLLM loads a model with its dtype as torch's default, and the head may be built then."""
    weight = _weight().bfloat16()
    want = build_tail_tables(weight, VOCAB, RANK)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = build_tail_tables(weight, VOCAB, RANK)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(got.basis, want.basis) and torch.equal(got.projected, want.projected)
