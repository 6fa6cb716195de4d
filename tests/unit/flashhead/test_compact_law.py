"""The compact sampled row: its plan (exact set, atoms, placeholder), its law and its draw, against the dense law."""

from __future__ import annotations

import math

import pytest
import torch

from my_pkg.flashhead.compact import CompactHead, compact_clusters
from my_pkg.flashhead.compact_law import (
    DEFAULT_OPTIONS,
    Atoms,
    LawOptions,
    RowFilter,
    draw,
    missed_mass,
    nucleus,
    row_law,
)
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
        rows.atoms.row(row),
        row_filter,
        lambda clusters: compact.resolve(rows, row, clusters),
        compact.head.vocab_size,
        options,
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
    n = compact_clusters(head)
    assert n == 2  # 64 rescored tokens in clusters of 16, less the 2 left to the draw
    for row in range(3):
        ids = rows.exact_ids[row][rows.exact_valid[row]]
        union = torch.cat([rows.exact_ids[row, : n * 16], pinned_ids]).unique()
        assert ids.unique().numel() == ids.numel() == union.numel()  # each id once, pinned ids included
        torch.testing.assert_close(exact[row][rows.exact_valid[row]], dense[row, ids])
        # Every token is in E or in exactly one atom, and an atom's mass is its members' (full rank: exact).
        clusters = torch.nonzero(torch.isfinite(rows.atom_log_mass[row])).flatten()
        assert clusters.numel() == head.num_clusters - n
        masses = torch.stack([torch.logsumexp(compact.resolve(rows, row, c.view(1))[1], 0) for c in clusters])
        torch.testing.assert_close(masses, rows.atom_log_mass[row, clusters], atol=1e-3, rtol=1e-4)
        # The chosen clusters are the heaviest (full rank: by their exact mass, pinned ids left out).
        chosen = torch.logsumexp(exact[row, : n * 16].view(n, 16), dim=1)
        assert float(chosen.min()) >= float(rows.atom_log_mass[row, clusters].max()) - 1e-4


def test_a_row_planned_alone_or_in_a_batch_has_the_same_atoms():
    """One row reads the estimate's table stored hidden-major, a batch reads it row-major: the same estimates."""
    head, g = _head(rank=8)
    hidden = torch.randn(5, HIDDEN, generator=g)
    planner = CompactHead(head)

    def plan(rows):
        kwargs = {"pinned": None, "postprocess": lambda x: x, "clusters": 4}
        return planner.plan(rows, torch.full((rows.shape[0],), 0.7), **kwargs)[1]

    batch = plan(hidden)
    for row in range(5):
        alone = plan(hidden[row : row + 1])
        torch.testing.assert_close(alone.member_estimates[0], batch.member_estimates[row])
        torch.testing.assert_close(alone.atom_log_mass[0], batch.atom_log_mass[row])
        torch.testing.assert_close(alone.atom_log_max[0], batch.atom_log_max[row])
        assert torch.equal(alone.exact_ids[0], batch.exact_ids[row])
    assert set(planner._layouts) == {"hidden_major", "row_major"}
    assert planner.nbytes == 2 * head.vocab_size * 8 * 4  # two float32 copies of the rank-8 table


@pytest.mark.parametrize(
    "row_filter",
    [
        RowFilter(),
        RowFilter(top_p=0.9),
        RowFilter(top_k=20),
        RowFilter(min_p=0.05),
        RowFilter(top_k=50, top_p=0.8),
        RowFilter(min_p=0.1, top_p=0.9),
    ],
    ids=["temperature", "top_p", "top_k", "min_p", "top_k+top_p", "min_p+top_p"],
)
def test_with_an_exact_estimate_the_law_is_vllms_dense_law(row_filter):
    """Full rank: every estimate is exact, so no member is missed and top_p's cut is the dense one."""
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
    one = rows.atoms.row(row)
    return draw(
        rows.exact_ids[row].expand(n, -1),
        exact[row].expand(n, -1),
        Atoms(one.log_mass.expand(n, -1), one.largest.expand(n, -1), one.estimates.expand(n, -1, -1), one.members),
        [row_filter] * n,
        row_keys(seeds),
        lambda _, clusters: compact.resolve(rows, row, clusters),
        compact.head.vocab_size,
        options,
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


def _missed(compact, rows, exact, row, row_filter, options=DEFAULT_OPTIONS):
    resolve = lambda clusters: compact.resolve(rows, row, clusters)  # noqa: E731
    return missed_mass(rows.exact_ids[row], exact[row], rows.atoms.row(row), row_filter, resolve, VOCAB, options)


@pytest.mark.parametrize(
    "row_filter",
    [RowFilter(), RowFilter(top_p=0.9), RowFilter(min_p=0.02), RowFilter(top_k=30), RowFilter(top_k=30, top_p=0.8)],
    ids=["temperature", "top_p", "min_p", "top_k", "top_k+top_p"],
)
def test_draws_follow_the_law(row_filter, monkeypatch):
    """A low-rank estimate (atoms matter, proposals rejected): 4,000 seeds of one row against `row_law`, by χ²; the
    default margin covers every member of this head (its rank-28 estimate's largest error is 0.7 nats).  top_k rows,
    drawn by rejection, score fewer clusters than the certified draw of the same row."""
    head, g = _head(rank=28)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.3
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=4)
    options = DEFAULT_OPTIONS
    if row_filter.top_k is None:
        assert _missed(compact, rows, exact, 0, row_filter, options) == 0  # no member missed
    law = _law(compact, rows, exact, 0, row_filter, options)
    drawn = _draws(compact, rows, exact, 0, row_filter, torch.arange(4000), options)
    counts = torch.bincount(drawn.tokens, minlength=VOCAB)
    assert _chi_square_holds(counts, law)
    assert drawn.atom_rows > 0 and drawn.resolved_clusters > drawn.atom_rows  # drawn from atoms, some rejected
    if row_filter.top_k is None:
        assert drawn.bound_rows == 4000 and drawn.bound_sum == 0
    else:
        import my_pkg.flashhead.compact_law as law_module

        monkeypatch.setattr(law_module, "_is_top_k_row", lambda *args: False)
        certified = _draws(compact, rows, exact, 0, row_filter, torch.arange(4000), options)
        assert drawn.resolved_clusters < 0.8 * certified.resolved_clusters


@pytest.mark.parametrize(
    "row_filter",
    [RowFilter(), RowFilter(top_k=40), RowFilter(top_k=40, top_p=0.7)],
    ids=["temperature", "top_k", "top_k+top_p"],
)
def test_with_every_cluster_exact_the_draw_is_vllms_gumbel_max(row_filter):
    """No atom left: the draw adds to each token vLLM kernel's noise, so it picks vLLM's token among those kept."""
    head, g = _head(rank=4)
    hidden = torch.randn(1, HIDDEN, generator=g)
    compact, rows, exact = _plan(head, hidden, 0.8, clusters=head.num_clusters)
    seeds = torch.arange(200)
    tokens = _draws(compact, rows, exact, 0, row_filter, seeds).tokens
    dense = head.dense_logits(hidden)[0].double() / 0.8
    kept = torch.where(_dense_law(dense, row_filter) > 0, dense, -math.inf)
    expected = (kept + gumbel(row_keys(seeds)[:, None], torch.arange(VOCAB)[None])).argmax(1)
    assert torch.equal(tokens, expected)


def test_a_seed_gives_the_same_token_whatever_the_batch():
    head, g = _head(rank=4)
    hidden = torch.randn(6, HIDDEN, generator=g)
    compact, rows, exact = _plan(head, hidden, 0.9, clusters=4)
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    filters = [RowFilter(), RowFilter(top_p=0.9), RowFilter(top_k=5), RowFilter(min_p=0.1), RowFilter(top_p=0.5)]
    filters.append(RowFilter(top_k=20, top_p=0.8))
    batch = draw(
        rows.exact_ids,
        exact,
        rows.atoms,
        filters,
        row_keys(seeds),
        lambda row, clusters: compact.resolve(rows, row, clusters),
        VOCAB,
    ).tokens
    for row in range(6):
        _, alone_rows, alone_exact = _plan(head, hidden[row : row + 1], 0.9, clusters=4)
        alone = _draws(compact, alone_rows, alone_exact, 0, filters[row], seeds[row : row + 1]).tokens
        assert int(alone[0]) == int(batch[row])


def test_a_row_needing_more_clusters_than_the_budget_is_counted():
    head, g = _head(rank=2)
    hidden = torch.randn(1, HIDDEN, generator=g)
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=1)
    # A certified row (top_k with min_p) keeping more tokens than one cluster holds: every atom is near the cutoff.
    wide = RowFilter(top_k=400, min_p=1e-9)
    assert _draws(compact, rows, exact, 0, wide, torch.arange(3), LawOptions(budget=2)).over_budget_rows == 3
    drawn = _draws(compact, rows, exact, 0, wide, torch.arange(3), LawOptions(budget=head.num_clusters))
    # Without a budget: at least the 400 tokens' clusters, fewer than all once the 400th token's weight is known.
    assert drawn.over_budget_rows == 0 and 3 * 25 <= drawn.resolved_clusters <= 3 * (head.num_clusters - 1)


def test_a_top_k_row_scores_only_what_its_count_needs():
    """top_k alone is drawn by rejection: a proposal near the top of the row is kept without scoring a cluster (fewer
    than k tokens can lie above it).  With more atoms near the cutoff than the budget, the row is a certified row,
    counted past the budget."""
    head, g = _head(rank=2)
    hidden = torch.randn(1, HIDDEN, generator=g)
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=1)
    seeds = torch.arange(200)
    drawn = _draws(compact, rows, exact, 0, RowFilter(top_k=400), seeds, LawOptions(budget=head.num_clusters))
    assert drawn.over_budget_rows == 0 and drawn.resolved_clusters < 200  # the certified path: >= 25 a row
    law = _law(compact, rows, exact, 0, RowFilter(top_k=400), LawOptions(budget=head.num_clusters))
    assert float(law[drawn.tokens].min()) > 0
    few = _draws(compact, rows, exact, 0, RowFilter(top_k=400), seeds, LawOptions(budget=2))
    assert few.over_budget_rows == 200 and few.resolved_clusters == 200 * 2


def test_a_threshold_row_without_budget_draws_from_its_exact_set():
    head, g = _head(rank=2)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.3
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=2)
    drawn = _draws(compact, rows, exact, 0, RowFilter(), torch.arange(50), LawOptions(budget=0))
    # A row whose first proposal is a token of E needs no cluster; the others ran past the budget.
    assert 0 < drawn.over_budget_rows <= 50 and drawn.resolved_clusters == 0
    assert set(drawn.tokens.tolist()) <= set(rows.exact_ids[0][rows.exact_valid[0]].tolist())
    # min_p: more atoms could hold a larger logit than the exact set's (a wide margin) than the budget scores.
    wide = LawOptions(margin=10.0, budget=3)
    drawn = _draws(compact, rows, exact, 0, RowFilter(min_p=0.1), torch.arange(5), wide)
    assert drawn.over_budget_rows == 5 and drawn.resolved_clusters == 5 * 3


def test_the_missed_mass_estimate_is_unbiased():
    """With no margin, members above their estimates are missed: the rows' mean estimate is the missed mass over
    the exact set's kept mass, and 0 once the margin covers every member."""
    head, g = _head(rank=4)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.3
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=4)
    no_margin = LawOptions(margin=0.0)
    missed = _missed(compact, rows, exact, 0, RowFilter(), no_margin)
    assert missed > 0 and _missed(compact, rows, exact, 0, RowFilter(), LawOptions(margin=6.0)) == 0
    drawn = _draws(compact, rows, exact, 0, RowFilter(), torch.arange(6000), no_margin)
    assert drawn.bound_rows == 6000
    assert drawn.bound_sum / drawn.bound_rows == pytest.approx(missed, rel=0.2)


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


def _cut_case(clusters: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(300, generator=g) * scale + scale
    estimates = torch.randn(clusters, 16, generator=g) * scale
    estimates[torch.rand(clusters, 16, generator=g) < 0.05] = -math.inf
    atoms = Atoms(torch.logsumexp(estimates, 1), estimates.amax(1), estimates, torch.arange(clusters * 16).view(-1, 16))
    chosen = torch.arange(0, clusters, 2)  # every other cluster is an atom
    values = torch.cat([logits, estimates[chosen].reshape(-1)]).double()
    values = values[torch.isfinite(values)]
    ordered = values.sort(descending=True).values
    return logits, atoms, chosen, ordered, float(torch.logsumexp(values, 0))


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])
def test_the_top_p_cut_reads_the_atoms_it_needs_and_agrees_with_a_full_sort(top_p, scale):
    """The cut over exact logits and every member estimate (read by atom, the largest members first; a flat row into
    a histogram) is the weight of the last token a sort of all of them keeps."""
    from my_pkg.flashhead.compact_law import _nucleus_cut

    logits, atoms, chosen, ordered, log_total = _cut_case(4000, scale, int(scale * 100) + int(top_p * 10))
    mass = (ordered - log_total).exp()
    expected = float(ordered[int(((mass.cumsum(0) - mass) < top_p).sum()) - 1])
    assert _nucleus_cut(logits, atoms, chosen, atoms.largest[chosen], log_total, top_p) == expected


def test_a_row_whose_bounds_are_far_above_its_logits_stops_proposing():
    """A margin far above the estimate's error makes almost every proposal a rejection: after its proposal batches
    the row scores its heaviest atoms (here all of them, within the budget) and draws from them exactly."""
    head, g = _head(rank=28)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.3
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=4)
    wide = LawOptions(margin=30.0, budget=head.num_clusters)
    drawn = _draws(compact, rows, exact, 0, RowFilter(), torch.arange(40), wide)
    assert drawn.over_budget_rows == 0 and drawn.resolved_clusters <= 40 * (head.num_clusters - 4)
    dense = head.dense_logits(hidden)[0].double()
    expected = (dense + gumbel(row_keys(torch.arange(40))[:, None], torch.arange(VOCAB)[None])).argmax(1)
    assert torch.equal(drawn.tokens, expected)  # every atom scored: vLLM's own Gumbel-max


@pytest.mark.parametrize(
    "row_filter",
    [RowFilter(), RowFilter(top_p=0.9), RowFilter(top_p=0.5), RowFilter(min_p=0.1), RowFilter(min_p=0.02)],
    ids=["temperature", "top_p 0.9", "top_p 0.5", "min_p 0.1", "min_p 0.02"],
)
def test_the_batched_common_case_draws_what_each_rows_own_path_draws(row_filter, monkeypatch):
    """The batch's cut, pool and first proposal (`_batched_threshold`) are the row's own: the same tokens and counts
    as every row drawn alone by its own path.  Here the batch decides every row: some drawn at once (a first
    proposal in the exact set), the others handed on with their pool."""
    import my_pkg.flashhead.compact_law as law

    head, g = _head(rank=8)
    hidden = torch.randn(1, HIDDEN, generator=g) * 0.5
    compact, rows, exact = _plan(head, hidden, 1.0, clusters=3)
    n, one = 600, rows.atoms.row(0)
    decided = law._batched_threshold(
        rows.exact_ids.expand(n, -1),
        exact.expand(n, -1),
        Atoms(one.log_mass.expand(n, -1), one.largest.expand(n, -1), one.estimates.expand(n, -1, -1), one.members),
        [row_filter] * n,
        row_keys(torch.arange(n)),
        list(range(n)),
        DEFAULT_OPTIONS,
    )
    handed_on = sum(isinstance(outcome, law._Pool) for outcome in decided.values())
    assert len(decided) == n and 20 <= handed_on <= n - 20
    batched = _draws(compact, rows, exact, 0, row_filter, torch.arange(n))
    monkeypatch.setattr(law, "_batched_threshold", lambda *args: {})
    alone = _draws(compact, rows, exact, 0, row_filter, torch.arange(n))
    assert torch.equal(batched.tokens, alone.tokens)
    assert (batched.resolved_clusters, batched.atom_rows, batched.bound_rows, batched.over_budget_rows) == (
        alone.resolved_clusters,
        alone.atom_rows,
        alone.bound_rows,
        alone.over_budget_rows,
    )
    assert batched.bound_sum == pytest.approx(alone.bound_sum)


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_a_top_k_rows_nucleus_verdicts_and_floor_hold_for_every_logit_within_the_bounds(top_p):
    """top_k with top_p, by rejection: what the bounds decide (`in_nucleus` True or False for a token of the top k;
    the floor under which top_p drops every token) is what top_p does to the exact row, for member logits anywhere
    below their bounds; the bounds decide most proposals before all atoms are scored, and every one after."""
    import my_pkg.flashhead.compact_law as law

    g = torch.Generator().manual_seed(7)
    k, cap, count, margin = 24, 4, 12, 1.0
    decided = asked = 0
    for _ in range(40):
        exact_logits = torch.randn(20, generator=g) * 2
        estimates = torch.randn(count, cap, generator=g) * 2 - 1
        truth = estimates + margin - torch.rand(count, cap, generator=g) * 2 * margin  # none above its bound
        atoms = Atoms(
            torch.logsumexp(estimates, 1),
            estimates.max(1).values,
            estimates,
            torch.arange(count * cap).view(count, cap),
        )
        every = torch.cat([exact_logits, truth.flatten()]).double()
        top_k = every >= every.topk(k).values[-1]
        kept = torch.zeros_like(top_k)
        kept[torch.nonzero(top_k).flatten()[nucleus(every[top_k], top_p)]] = True
        clusters = torch.arange(count)
        floor = law._top_p_floor(exact_logits, atoms, clusters, k, top_p, margin)
        assert not bool((kept & (every <= floor)).any())
        row = law._TopKRow(exact_logits, atoms, clusters, atoms.largest, margin)
        for scored in range(count + 1):
            for z, is_kept in zip(every[top_k].tolist(), kept[top_k].tolist()):
                verdict = row.in_nucleus(z, k, top_p)
                assert verdict in (None, is_kept)
                assert verdict is not None or scored < count
                if scored < count:
                    asked += 1
                    decided += verdict is not None
            if scored < count:
                row.add(scored, truth[scored])
    # Before every atom is scored the bounds decide most proposals: 83 % at top_p 0.5, 57 % at 0.9 (52 % and 22 % with
    # the top k's mass bounded apart from the mass above the proposal).
    assert decided > 0.4 * asked
