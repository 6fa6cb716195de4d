"""The compact sampled row: its plan (exact set, atoms, placeholder), its law and its draw, against the dense law."""

from __future__ import annotations

import math

import pytest
import torch

from my_pkg.flashhead.compact import CompactHead, compact_clusters
from my_pkg.flashhead.compact_law import DEFAULT_OPTIONS, LawOptions, RowFilter, draw, nucleus, row_law
from my_pkg.flashhead.gumbel import gumbel, row_keys
from my_pkg.flashhead.head import PinnedIds
from tests.support.heads import random_head

VOCAB, HIDDEN = 512, 32


def _dense_law(logits: torch.Tensor, row_filter: RowFilter) -> torch.Tensor:
    """vLLM's law for one row of processed logits (min_p, top_k keeping ties, top_p over the rest)."""
    x = logits.double().clone()
    if row_filter.min_p > 0:
        probs = torch.softmax(x, 0)
        x[probs < row_filter.min_p * probs.max()] = -math.inf
    if row_filter.top_k is not None and row_filter.top_k < x.numel():
        x[x < x.topk(row_filter.top_k).values[-1]] = -math.inf
    if row_filter.top_p < 1.0:
        x[~nucleus(x, row_filter.top_p)] = -math.inf
    return torch.softmax(x, 0)


def _head(**kwargs):
    head, g = random_head(VOCAB, HIDDEN, sampled_rank=kwargs.pop("rank", HIDDEN), **kwargs)
    head.sampled_rescore = 64
    return head, g


def _plan(head, hidden, temperature, clusters=None, pinned=None):
    compact = CompactHead(head)
    placeholder, rows = compact.plan(
        hidden,
        torch.full((hidden.shape[0],), temperature),
        pinned=pinned,
        postprocess=lambda x: x,
        clusters=clusters or compact_clusters(head),
    )
    processed = placeholder.float() / temperature
    exact = processed.gather(1, rows.exact_ids).masked_fill_(~rows.exact_valid, -math.inf)
    return compact, rows, exact


def _law(compact, rows, exact, row, row_filter, options=DEFAULT_OPTIONS):
    return row_law(
        rows.exact_ids[row],
        exact[row],
        rows.atom_log_mass[row],
        row_filter,
        lambda clusters: compact.resolve(rows, row, clusters),
        compact.head.vocab_size,
        options,
        atom_log_size=rows.atom_log_size,
        atom_log_max=rows.atom_log_max[row],
    ).probs


def test_the_noise_is_vllms_cpu_kernels():
    """Gumbel-max with `gumbel` picks the token vLLM's `fused_gumbel_argmax` picks for the same seed."""
    pytest.importorskip("vllm")
    import vllm._custom_ops  # noqa: F401 - loads the CPU kernels

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 300, generator=g) * 2
    seeds = torch.randint(0, 2**31, (64,), generator=g)
    theirs = torch.ops._C.fused_gumbel_argmax(rows, seeds)
    ours = (rows.double() + gumbel(row_keys(seeds)[:, None], torch.arange(300)[None])).argmax(1)
    assert torch.equal(theirs, ours)


def test_the_plan_scores_the_heaviest_clusters_exactly_and_leaves_the_rest_as_atoms():
    head, g = _head()
    hidden = torch.randn(3, HIDDEN, generator=g)
    pinned_ids = torch.tensor([5, 77])
    pinned = PinnedIds(pinned_ids, head.weight.index_select(0, pinned_ids))
    compact, rows, exact = _plan(head, hidden, 0.7, pinned=pinned)
    dense = head.dense_logits(hidden).float() / 0.7
    assert compact_clusters(head) == 4  # 64 rescored tokens in clusters of 16
    for row in range(3):
        ids = rows.exact_ids[row][rows.exact_valid[row]]
        union = torch.cat([rows.exact_ids[row, : 4 * 16], pinned_ids]).unique()
        assert ids.unique().numel() == ids.numel() == union.numel()  # each id once, pinned ids included
        torch.testing.assert_close(exact[row][rows.exact_valid[row]], dense[row, ids])
        # Every token is in E or in exactly one atom, and an atom's mass is its members' (full rank: exact).
        clusters = torch.nonzero(torch.isfinite(rows.atom_log_mass[row])).flatten()
        assert clusters.numel() == head.num_clusters - 4
        masses = torch.stack([torch.logsumexp(compact.resolve(rows, row, c.view(1))[1], 0) for c in clusters])
        torch.testing.assert_close(masses, rows.atom_log_mass[row, clusters], atol=1e-3, rtol=1e-4)
        # The chosen clusters are the heaviest (full rank: by their exact mass, pinned ids left out).
        chosen = torch.logsumexp(exact[row, : 4 * 16].view(4, 16), dim=1)
        assert float(chosen.min()) >= float(rows.atom_log_mass[row, clusters].max()) - 1e-4


@pytest.mark.parametrize(
    "row_filter",
    [
        RowFilter(),
        RowFilter(top_k=20),
        RowFilter(min_p=0.05),
        RowFilter(top_k=50, top_p=0.8),
        RowFilter(min_p=0.1, top_p=0.9),
    ],
    ids=["temperature", "top_k", "min_p", "top_k+top_p", "min_p+top_p"],
)
def test_with_an_exact_estimate_the_law_is_vllms_dense_law(row_filter):
    """Full rank: every atom's mass is exact, so the compact law is the dense one (Theorem 1: TV 0; Theorem 2:
    no miss)."""
    head, g = _head()
    hidden = torch.randn(4, HIDDEN, generator=g) * 2
    compact, rows, exact = _plan(head, hidden, 0.8)
    dense = head.dense_logits(hidden).float() / 0.8
    for row in range(4):
        ours = _law(compact, rows, exact, row, row_filter)
        expected = _dense_law(dense[row], row_filter)
        assert float((ours - expected).abs().sum() / 2) < 1e-4, row


def _draws(compact, rows, exact, row, row_filter, seeds, options=DEFAULT_OPTIONS):
    """The draw of row `row` under each of `seeds` (the row repeated once per seed)."""
    n = seeds.numel()
    return draw(
        rows.exact_ids[row].expand(n, -1),
        exact[row].expand(n, -1),
        rows.atom_log_mass[row].expand(n, -1),
        [row_filter] * n,
        row_keys(seeds),
        lambda _, clusters: compact.resolve(rows, row, clusters),
        compact.head.vocab_size,
        options,
        atom_log_size=rows.atom_log_size,
        atom_log_max=rows.atom_log_max[row].expand(n, -1),
    )


def _chi_square_holds(counts: torch.Tensor, law: torch.Tensor) -> bool:
    """Pearson's χ² of `counts` against `law` (cells with expected count < 5 merged) below df + 6·sqrt(2·df)."""
    total = float(counts.sum())
    expected = law * total
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    df = int(keep.sum()) - 1
    assert counts[law == 0].sum() == 0, "a token the law never draws was drawn"
    return statistic < df + 6 * math.sqrt(2 * df)


@pytest.mark.parametrize(
    "row_filter", [RowFilter(), RowFilter(top_p=0.9), RowFilter(top_k=30)], ids=["temperature", "top_p", "top_k"]
)
def test_draws_follow_the_law(row_filter):
    """A low-rank estimate (atoms matter): 6,000 seeds of one row against `row_law`, by χ²."""
    head, g = _head(rank=4)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.3
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=4)
    law = _law(compact, rows, exact, 0, row_filter)
    drawn = _draws(compact, rows, exact, 0, row_filter, torch.arange(6000))
    counts = torch.bincount(drawn.tokens, minlength=VOCAB)
    assert _chi_square_holds(counts, law)
    if row_filter == RowFilter():
        assert drawn.atom_rows > 0  # the tail was drawn from, through an atom


def test_a_seed_gives_the_same_token_whatever_the_batch():
    head, g = _head(rank=4)
    hidden = torch.randn(5, HIDDEN, generator=g)
    compact, rows, exact = _plan(head, hidden, 0.9, clusters=4)
    seeds = torch.tensor([11, 22, 33, 44, 55])
    filters = [RowFilter(), RowFilter(top_p=0.9), RowFilter(top_k=5), RowFilter(min_p=0.1), RowFilter(top_p=0.5)]
    batch = draw(
        rows.exact_ids,
        exact,
        rows.atom_log_mass,
        filters,
        row_keys(seeds),
        lambda row, clusters: compact.resolve(rows, row, clusters),
        VOCAB,
        atom_log_size=rows.atom_log_size,
        atom_log_max=rows.atom_log_max,
    ).tokens
    for row in range(5):
        _, alone_rows, alone_exact = _plan(head, hidden[row : row + 1], 0.9, clusters=4)
        alone = _draws(compact, alone_rows, alone_exact, 0, filters[row], seeds[row : row + 1]).tokens
        assert int(alone[0]) == int(batch[row])


def test_a_row_needing_more_clusters_than_the_budget_is_counted():
    head, g = _head(rank=2)
    hidden = torch.randn(1, HIDDEN, generator=g)
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=1)
    wide = RowFilter(top_k=400)  # more tokens than one cluster holds: every atom is near the cutoff
    assert _draws(compact, rows, exact, 0, wide, torch.arange(3), LawOptions(budget=2)).over_budget_rows == 3
    drawn = _draws(compact, rows, exact, 0, wide, torch.arange(3), LawOptions(budget=head.num_clusters))
    # Without a budget: at least the 400 tokens' clusters, fewer than all once the 400th token's weight is known.
    assert drawn.over_budget_rows == 0 and 3 * 25 <= drawn.resolved_clusters <= 3 * (head.num_clusters - 1)


def test_the_bound_holds_and_its_estimate_is_unbiased():
    """Temperature-only rows: TV(compact law, dense law) <= B = Σ|M_c − M̂_c| / Ẑ, and the mean of the drawn
    atoms' |M_c / M̂_c − 1| (0 for a token of E) estimates B."""
    head, g = _head(rank=4)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.3
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=4)
    dense = _dense_law(head.dense_logits(hidden)[0].float(), RowFilter())
    law = _law(compact, rows, exact, 0, RowFilter())
    tv = float((law - dense).abs().sum() / 2)
    clusters = torch.nonzero(torch.isfinite(rows.atom_log_mass[0])).flatten()
    estimated = rows.atom_log_mass[0, clusters].double().exp()
    exact_mass = torch.stack(
        [torch.logsumexp(compact.resolve(rows, 0, c.view(1))[1].double(), 0) for c in clusters]
    ).exp()
    z_hat = float(exact[0][torch.isfinite(exact[0])].double().exp().sum() + estimated.sum())
    bound = float((exact_mass - estimated).abs().sum()) / z_hat
    assert 0 < tv <= bound
    drawn = _draws(compact, rows, exact, 0, RowFilter(), torch.arange(6000))
    assert drawn.bound_rows == 6000
    assert drawn.bound_sum / drawn.bound_rows == pytest.approx(bound, rel=0.2)


@pytest.mark.parametrize("count", [10, 1024, 5000, 30000])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])
def test_the_nucleus_is_vllms_keep_rule(count, top_p, scale):
    """Against a plain sort: kept iff the mass before a value (descending) is below top_p; flat rows take the bisection,
    peaked ones the window."""
    values = torch.randn(count, generator=torch.Generator().manual_seed(count)) * scale
    probs = torch.softmax(values.double(), 0)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    expected = torch.zeros(count, dtype=torch.bool)
    expected[order[before < top_p]] = True
    assert torch.equal(nucleus(values, top_p), expected)


@pytest.mark.parametrize("count", [10, 5000, 30000])
def test_the_nucleus_by_keys_orders_by_the_keys_and_counts_the_values_mass(count):
    """Atoms are ordered by their members' mean weight while their whole mass counts: keys apart from values."""
    g = torch.Generator().manual_seed(count)
    values = torch.randn(count, generator=g) * 0.5
    keys = values - torch.rand(count, generator=g) * 3
    probs = torch.softmax(values.double(), 0)
    order = keys.double().argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    expected = torch.zeros(count, dtype=torch.bool)
    expected[order[before < 0.9]] = True
    assert torch.equal(nucleus(values, 0.9, keys), expected)
