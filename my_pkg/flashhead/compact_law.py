"""The law a compact sampled row is drawn from, and the draw.

A compact row (:mod:`~my_pkg.flashhead.compact`) has exact logits ``z`` on its exact set ``E`` and, for every other
cluster ``c``, an *atom*: its members' rank-``r`` estimates ``ẑ_v`` and their sum ``M̂_c = Σ exp(ẑ_v)``.  The
*margin* ``δ`` is the assumption the law rests on: no member's exact logit exceeds its estimate by more than ``δ``
(``z_v <= ẑ_v + δ``; a member that does is a *miss*).  vLLM's filters act in vLLM's order (min_p, then top_k, then
top_p renormalised over what is left; top_p keeps a token iff the mass before it is below ``p``; top_k keeps ties):

* **Threshold rows** (temperature only, min_p alone, top_p alone): vLLM keeps the tokens with ``z_v >= τ``
  (``τ = -inf``; ``max z + ln min_p``; the nucleus's last weight).  For min_p, ``τ`` is exact once every atom that
  could hold a larger logit than ``E``'s is scored; for top_p, ``τ`` is the nucleus over ``E``'s exact logits and
  every atom member's estimate (normalised by ``Z_E + Σ M̂_c``), the one estimated quantity.  The row is drawn
  *exactly* from the softmax of ``{z_v : z_v >= τ}`` by rejection: the proposal weighs a kept token of ``E`` by
  ``exp(z_v)`` and an atom's member by its bound ``exp(ẑ_v + δ)`` (0 below ``τ`` where few atoms reach it); a
  proposed member is scored with its cluster (*resolved*) and accepted with probability ``exp(z_v - ẑ_v - δ)`` if
  ``z_v >= τ``, else the next proposal is taken.  Only proposed clusters are scored.  Without a miss the law is
  vLLM's dense one (top_p: at the estimated ``τ``).  A row still drawing after ``_PROPOSAL_BATCHES`` batches of
  proposals (bounds far above its logits) scores its heaviest atoms within the budget and draws from what is scored.
* **top_k rows** (top_k, alone or with top_p): the same rejection draw at the cut ``low``, the ``k``-th largest logit
  of ``E`` (the row's cutoff is at least that; with top_p, at least the largest exact logit whose exact mass above
  already reaches ``p`` times the most the top ``k`` can weigh), where a proposal with exact logit ``z`` is kept only
  if fewer than ``k`` tokens lie above it and, with top_p, if the mass above ``z`` is below ``p`` times the top
  ``k``'s mass.  Both are decided from the known logits and the unscored members' bounds where these settle them,
  else after scoring the atoms that could change the answer, ``_SCORE_CHUNK`` at a time, the largest bounds first.
  A proposal near the top of the row needs no cluster.  Without a miss the law is vLLM's dense one.  A row with no
  atom near ``low`` is drawn as a certified row with none to score; a flat row (more than twice the budget of atoms
  near ``low``), one whose decisions need more than the budget, or with no proposal kept after
  ``_PROPOSAL_BATCHES`` batches, is drawn as a certified row.
* **Certified rows** (min_p with top_k or top_p): every atom whose largest member estimate plus
  ``δ`` reaches the filter's cutoff is resolved, the heaviest first, ``_RESOLVE_CHUNK`` at a time, with the cutoff
  computed again as resolved tokens raise it, up to ``budget`` clusters; the rest are dropped and vLLM's filters run
  on the exact tokens.  Without a miss the law is vLLM's dense one.

A row that needs more than ``budget`` clusters is counted; its unresolved atoms are dropped.  Each threshold row
reports an estimate of the mass its margin missed (:attr:`Drawn.bound_sum`): for the cluster the first proposal
drew (0 when it drew a token of ``E``), ``Σ_v (exp z_v − exp(ẑ_v + δ))⁺ / (exp(ẑ + δ) mass of the cluster)``, times
the proposal's total over ``E``'s kept mass, whose mean over rows is at least the missed mass over ``Z``.

The randomness comes from the row's key (:mod:`~my_pkg.flashhead.gumbel`, SplitMix64 of vLLM's seed): a row with
no atom left to propose (every certified row; a threshold or top_k row whose atoms all lie below its cut) is a
Gumbel-max over its kept exact tokens with the noise vLLM's CPU kernel gives them, so it draws vLLM's own token; a
row drawn by rejection takes its proposals, the member inside a cluster and the acceptances from further streams of
the key.
Given the seed, the draw is a function of the row alone: a seeded request's text does not depend on its batch.

Imports torch only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .gumbel import derived_keys, gumbel, uniform

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_MARGIN",
    "DEFAULT_OPTIONS",
    "Atoms",
    "Drawn",
    "LawOptions",
    "RowFilter",
    "RowLaw",
    "draw",
    "missed_mass",
    "nucleus",
    "row_law",
]

#: ``ln 4``: no member of a resolved cluster above its estimate plus the margin in 2,048 held-out rows of each
#: setting on the trained fixture (docs/benchmarks.md, compact fidelity).
DEFAULT_MARGIN = math.log(4.0)
#: Clusters resolved per row at most.
DEFAULT_BUDGET = 64
#: Entries :func:`nucleus` sorts at most (the heaviest, or those around the cut's weight).
_WINDOW = 1024
#: Atoms a certified row resolves at a time before its cutoff is computed again.
_RESOLVE_CHUNK = 16
#: Atoms a top_k row scores at a time while a proposal's count or top_p mass is undecided.
_SCORE_CHUNK = 4
#: Atoms (by their largest member estimate) the top_p cut reads first; four times as many while the cut is unsure,
#: up to ``_CUT_ATOMS``; then every atom, into ``_CUT_BUCKETS`` buckets of weight.
_CUT_FIRST_ATOMS = 64
_CUT_ATOMS = 256
_CUT_BUCKETS = 4096
_CUT_RANGE = 40.0
#: Proposals a threshold row draws at a time (all rejected: about 1 % of rows at the default margin, which accepts at
#: least one in four).
_PROPOSALS = 16
#: Batches of proposals before a row stops proposing and scores its heaviest atoms instead.
_PROPOSAL_BATCHES = 1
#: A pool of more atoms than this bounds each by its whole estimated mass rather than by its members above the cut.
_MASKED_BOUND_ATOMS = 64

Resolve = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LawOptions:
    margin: float = DEFAULT_MARGIN
    budget: int = DEFAULT_BUDGET


#: The defaults.
DEFAULT_OPTIONS = LawOptions()


class Atoms(NamedTuple):
    """The clusters outside a row's exact set (with a leading row dimension for a batch).

    ``log_mass`` ``[C]``: ``log M̂_c`` (``-inf``: not an atom); ``largest`` ``[C]``: its largest member estimate;
    ``estimates`` ``[C, cap]``: each member's estimated logit, scaled as the exact logits (``-inf``: a padding slot or
    a pinned id); ``members`` ``[C, cap]``: their ids, in the order :data:`Resolve` returns a cluster's members.
    """

    log_mass: torch.Tensor
    largest: torch.Tensor
    estimates: torch.Tensor
    members: torch.Tensor

    def row(self, index: int) -> Atoms:
        return Atoms(self.log_mass[index], self.largest[index], self.estimates[index], self.members)


class RowFilter(NamedTuple):
    """One row's filters as vLLM's sampler holds them: ``top_k`` None or ``>= V`` for none, ``top_p`` 1 for none,
    ``min_p`` 0 for none."""

    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0


class RowLaw(NamedTuple):
    """``probs`` ``[V]`` float64; the clusters scored to state it, and whether the budget stopped it."""

    probs: torch.Tensor
    resolved: int
    over_budget: bool


@dataclass
class Drawn:
    """A step's compact draws: the tokens, and what the draw did."""

    tokens: torch.Tensor
    resolved_clusters: int = 0
    over_budget_rows: int = 0
    atom_rows: int = 0
    bound_sum: float = 0.0
    bound_rows: int = 0


class _RowDraw(NamedTuple):
    token: int
    resolved: int
    over_budget: bool
    from_atom: bool
    bound: float | None  # threshold rows: the missed-mass estimate


def draw(
    exact_ids: torch.Tensor,
    exact_logits: torch.Tensor,
    atoms: Atoms,
    filters: list[RowFilter],
    keys: torch.Tensor,
    resolve: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    vocab_size: int,
    options: LawOptions = DEFAULT_OPTIONS,
) -> Drawn:
    """Draw one token per row.

    Args:
        exact_ids: ``[B, N]`` each row's exact set ``E``.
        exact_logits: ``[B, N]`` their logits as vLLM's sampler holds them (post-processed, divided by the
            temperature, min_p and min_tokens applied); ``-inf`` for a masked token or a repeated id.
        atoms: the rows' :class:`Atoms` (``[B, C]``, ``[B, C, cap]``), scaled as ``exact_logits``.
        filters: each row's :class:`RowFilter`.
        keys: ``[B]`` int64 noise keys (:func:`~my_pkg.flashhead.gumbel.row_keys` of the rows' seeds).
        resolve: ``(row, clusters [k]) -> (ids [k * cap], logits [k * cap])`` exact logits of a row's clusters'
            members in ``atoms.members`` order, scaled as ``exact_logits`` (``-inf`` at padding and pinned ids).
        vocab_size: ``V``; atom ``c`` draws the noise of id ``V + c``.
    """
    drawn = Drawn(tokens=torch.empty(exact_ids.shape[0], dtype=torch.int64))
    threshold = [row for row, row_filter in enumerate(filters) if _is_threshold(row_filter, vocab_size)]
    batched = _batched_threshold(exact_ids, exact_logits, atoms, filters, keys, threshold, options)
    for row, row_filter in enumerate(filters):
        row_resolve = functools.partial(resolve, row)
        one = batched.get(row)
        if isinstance(one, _Pool):
            one = _threshold_draw(one, atoms.row(row), keys[row], row_resolve, vocab_size, options)
        elif one is None:
            one = _draw_row(
                exact_ids[row],
                exact_logits[row],
                atoms.row(row),
                row_filter,
                keys[row],
                row_resolve,
                vocab_size,
                options,
            )
        drawn.tokens[row] = one.token
        drawn.resolved_clusters += one.resolved
        drawn.over_budget_rows += int(one.over_budget)
        drawn.atom_rows += int(one.from_atom)
        if one.bound is not None:
            drawn.bound_rows += 1
            drawn.bound_sum += one.bound
    return drawn


def row_law(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atoms: Atoms,
    row_filter: RowFilter,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions = DEFAULT_OPTIONS,
) -> RowLaw:
    """The law :func:`draw` draws one row from when no member is missed (threshold rows: every atom that could hold
    a kept token scored); the reference the tests and the fidelity measurements compare with."""
    law = torch.zeros(vocab_size, dtype=torch.float64, device=ids.device)
    if _is_threshold(row_filter, vocab_size):
        pool = _threshold_pool(ids, logits, atoms, row_filter, resolve, options)
        resolved = pool.resolved + int(pool.clusters.numel())
        if pool.clusters.numel():
            new_ids, new_logits = resolve(pool.clusters)
            pool = pool._replace(ids=torch.cat([pool.ids, new_ids]), logits=torch.cat([pool.logits, new_logits]))
        kept = pool.logits >= pool.cut
        law.index_add_(0, pool.ids[kept], torch.softmax(pool.logits[kept].double(), 0))
        return RowLaw(law, resolved, pool.over_budget)
    kept = _certified(ids, logits, atoms, row_filter, resolve, vocab_size, options)
    law.index_add_(0, kept.ids, torch.softmax(kept.logits.double(), 0))
    return RowLaw(law, kept.resolved, kept.over_budget)


def missed_mass(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atoms: Atoms,
    row_filter: RowFilter,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions = DEFAULT_OPTIONS,
) -> float:
    """A threshold row's mass above its members' bounds over ``E``'s kept mass: ``Σ (exp z_v − b_v)⁺`` over every
    atom member ``v`` the cut keeps, ``b_v`` the bound the draw's proposal gives it (``exp(ẑ_v + δ)``; 0 outside
    the atoms that could hold a kept token, and below the cut where the proposal masks it).  0 when no member is
    missed (the draw's law is then :func:`row_law`'s); the mean of the draw's estimate otherwise.  Scores every
    atom: for measurements and tests."""
    if not _is_threshold(row_filter, vocab_size):
        raise ValueError(f"{row_filter} is no threshold row")
    pool = _threshold_pool(ids, logits, atoms, row_filter, resolve, options)
    if not pool.unscored.numel():
        return 0.0
    _, member_logits = resolve(pool.unscored)
    kept = torch.where(member_logits >= pool.cut, member_logits.double(), float("-inf"))
    exact_mass = torch.logsumexp(pool.logits[pool.logits >= pool.cut].double(), 0)
    if not bool(torch.isfinite(exact_mass)):  # E keeps nothing: over the kept members' mass instead
        exact_mass = torch.logsumexp(kept, 0)
    kept = kept - exact_mass
    bounds = _bounds(atoms, pool.unscored, pool.bound_cut, options.margin)
    bounds[~torch.isin(pool.unscored, pool.clusters)] = float("-inf")  # atoms no proposal reaches
    return float((kept.exp() - (bounds.reshape(-1) - exact_mass).exp()).clamp(min=0).sum())


def nucleus(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the entries of ``values`` (log weights) that top-p keeps: sorted by weight, those whose mass
    before them is below ``top_p`` (the first always; among equal values, which come first is arbitrary, as in
    vLLM's sort).

    Without a sort of every entry: the ``_WINDOW`` heaviest decide when the cut falls among them; otherwise the
    cut's weight is found by bisection on the weight (the mass above a weight only grows as the weight falls),
    until few enough entries lie between the bounds to sort them."""
    count = values.numel()
    probs = torch.softmax(values.double(), dim=0)
    window = min(count, _WINDOW)
    top = probs.topk(window).indices
    mass = probs[top]
    before = mass.cumsum(0) - mass
    inside = before < top_p
    inside[0] = True
    mask = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    if window == count or not bool(inside[-1]):
        mask[top[inside]] = True
        return mask
    # The mass above `high` is below top_p (the window's last entry is in); above `low`, not.
    low, high = float(probs.min()) - 1.0, float(probs[top[-1]])
    while True:
        between = (probs > low) & (probs < high)
        if int(between.sum()) <= _WINDOW:
            break
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if float(probs[probs > middle].sum()) < top_p:
            high = middle
        else:
            low = middle
    kept = probs >= high
    rest = torch.nonzero(between).flatten()
    order = rest[probs[rest].argsort(descending=True)]
    before = float(probs[kept].sum()) + probs[order].cumsum(0) - probs[order]
    mask[kept] = True
    mask[order[before < top_p]] = True
    return mask


def _is_threshold(row_filter: RowFilter, vocab_size: int) -> bool:
    """Whether vLLM keeps the row's tokens above one weight known before the draw (no top_k; min_p and top_p not
    both: top_p over min_p's survivors needs their exact mass)."""
    no_top_k = row_filter.top_k is None or row_filter.top_k >= vocab_size
    return no_top_k and (row_filter.min_p <= 0.0 or row_filter.top_p >= 1.0)


class _Pool(NamedTuple):
    """A threshold row before its draw: the exact tokens, the cut, and the atoms that could hold a kept token with
    the log total of their members' bounds ``exp(ẑ + δ)`` above the cut."""

    ids: torch.Tensor
    logits: torch.Tensor
    cut: float
    bound_cut: float  # the members' bounds are -inf below it: the cut, or -inf
    clusters: torch.Tensor
    log_bound: torch.Tensor
    resolved: int
    over_budget: bool  # min_p: atoms that could hold a larger logit were left unscored
    unscored: torch.Tensor  # every atom not scored yet, near the cut or not


def _bounds(atoms: Atoms, clusters: torch.Tensor, cut: float, margin: float) -> torch.Tensor:
    """``[k, cap]`` float64 the members' bounds ``ẑ + δ`` of ``clusters``, ``-inf`` below ``cut``."""
    bounds = atoms.estimates[clusters].double() + margin
    return bounds.masked_fill_(bounds < cut, float("-inf"))


def _threshold_pool(
    ids: torch.Tensor, logits: torch.Tensor, atoms: Atoms, row_filter: RowFilter, resolve: Resolve, options: LawOptions
) -> _Pool:
    finite = torch.isfinite(logits)
    ids, logits = ids[finite], logits[finite]
    clusters = torch.nonzero(torch.isfinite(atoms.log_mass)).flatten()
    largest = atoms.largest[clusters]
    resolved, over = 0, False
    cut = float("-inf")
    if row_filter.min_p > 0.0:
        # The cut is the largest logit's: score first every atom that could hold a larger one than E's, the
        # largest first, within the budget.
        while clusters.numel():
            top = float(logits.max()) if logits.numel() else float("-inf")
            higher = torch.nonzero(largest + options.margin > top).flatten()
            if not higher.numel():
                break
            if resolved >= options.budget:
                over = True
                break
            higher = higher[largest[higher].topk(min(higher.numel(), options.budget - resolved)).indices]
            new_ids, new_logits = resolve(clusters[higher])
            keep = torch.isfinite(new_logits)
            ids, logits = torch.cat([ids, new_ids[keep]]), torch.cat([logits, new_logits[keep]])
            resolved += int(higher.numel())
            rest = torch.ones(clusters.numel(), dtype=torch.bool, device=clusters.device)
            rest[higher] = False
            clusters, largest = clusters[rest], largest[rest]
        cut = float(logits.max()) + math.log(row_filter.min_p) if logits.numel() else float("-inf")
    elif row_filter.top_p < 1.0:
        log_total = torch.logsumexp(torch.cat([logits, atoms.log_mass[clusters]]).double(), 0)
        cut = _nucleus_cut(logits, atoms, clusters, largest, float(log_total), row_filter.top_p)
    unscored = clusters
    clusters = clusters[largest + options.margin >= cut]
    if clusters.numel() <= _MASKED_BOUND_ATOMS:
        bound_cut = cut
        log_bound = torch.logsumexp(_bounds(atoms, clusters, cut, options.margin), 1)
    else:  # every member bounded (a larger bound: valid, cheaper than reading each member of many atoms)
        bound_cut = float("-inf")
        log_bound = atoms.log_mass[clusters].double() + options.margin
    return _Pool(ids, logits, cut, bound_cut, clusters, log_bound, resolved, over, unscored)


def _nucleus_cut(
    logits: torch.Tensor, atoms: Atoms, clusters: torch.Tensor, largest: torch.Tensor, log_total: float, top_p: float
) -> float:
    """The last weight top_p keeps over ``E``'s exact logits and the member estimates of the atoms ``clusters``
    (``largest``: each one's largest member), normalised by ``log_total``.  Reads the atoms with the largest members
    first: the cut is final once it is at least the largest member left unread.  A flat row (the cut not final after
    ``_CUT_ATOMS`` atoms) reads them all, into a histogram (:func:`_mass_cut`)."""
    count = clusters.numel()
    if not count and not logits.numel():
        return float("-inf")
    take = min(count, _CUT_FIRST_ATOMS)
    exact_mass = float(torch.logsumexp(logits.double(), 0)) if logits.numel() else float("-inf")
    while take <= _CUT_ATOMS:
        top = largest.topk(min(count, take + 1))
        read = clusters[top.indices[:take]]
        read_mass = torch.logsumexp(torch.cat([atoms.log_mass[read].double(), torch.tensor([exact_mass])]), 0)
        if float(read_mass) - log_total < math.log(top_p) and take < count:
            take = min(count, take * 4)  # these atoms and E hold less than top_p: the cut lies past them
            continue
        values = torch.cat([logits, atoms.estimates[read].reshape(-1)])
        values = values[torch.isfinite(values)].double()
        ordered = values.topk(min(values.numel(), _WINDOW)).values
        mass = torch.exp(ordered - log_total)
        kept = int(((mass.cumsum(0) - mass) < top_p).sum())
        unread_largest = float(top.values[take]) if take < count else float("-inf")
        if kept < ordered.numel() and float(ordered[kept - 1]) >= unread_largest:
            return float(ordered[max(kept, 1) - 1])
        if take == count:
            break
        take = min(count, take * 4)
    is_atom = torch.zeros(atoms.log_mass.shape, dtype=logits.dtype, device=clusters.device)
    is_atom[clusters] = 1.0
    high = max(float(logits.max()) if logits.numel() else float("-inf"), float(largest.max()))
    return _mass_cut(logits, atoms.estimates, is_atom, high, log_total, top_p)


def _mass_cut(
    logits: torch.Tensor, estimates: torch.Tensor, is_atom: torch.Tensor, high: float, log_total: float, top_p: float
) -> float:
    """The last weight top_p keeps among ``logits`` and the estimates ``[C, cap]`` of the clusters with ``is_atom``
    1 (``high``: the largest of them) normalised by ``log_total``, without a sort: the masses summed into
    ``_CUT_BUCKETS`` buckets of weight over the ``_CUT_RANGE`` nats below ``high`` (lighter values into the last),
    then only the bucket where the mass reaches ``top_p`` sorted."""
    scale = (_CUT_BUCKETS - 1) / _CUT_RANGE
    mass = torch.zeros(_CUT_BUCKETS, dtype=torch.float64)
    buckets = []
    for values, weight in ((logits, None), (estimates, is_atom.view(-1, 1))):
        shifted = values.float() - high
        bucket = shifted.mul(-scale).clamp_(0, _CUT_BUCKETS - 1).long()
        masses = shifted.add_(high - log_total).exp_()
        if weight is not None:
            masses.mul_(weight)
        mass += torch.bincount(bucket.reshape(-1), weights=masses.reshape(-1), minlength=_CUT_BUCKETS).double()
        buckets.append(bucket.reshape(-1))
    reached = mass.cumsum(0)
    crossing = min(int((reached < top_p).sum()), _CUT_BUCKETS - 1)
    in_logits = logits[buckets[0] == crossing]
    slots = torch.nonzero(buckets[1] == crossing).flatten()
    slots = slots[is_atom[slots // estimates.shape[-1]] > 0]
    inside = torch.cat([in_logits, estimates.reshape(-1)[slots]]).double()
    inside = inside[torch.isfinite(inside)].sort(descending=True).values
    inside_mass = torch.exp(inside - log_total)
    before = float(reached[crossing] - mass[crossing]) + inside_mass.cumsum(0) - inside_mass
    return float(inside[max(int((before < top_p).sum()), 1) - 1])


def _batched_threshold(
    exact_ids: torch.Tensor,
    exact_logits: torch.Tensor,
    atoms: Atoms,
    filters: list[RowFilter],
    keys: torch.Tensor,
    rows: list[int],
    options: LawOptions,
) -> dict[int, _RowDraw | _Pool]:
    """The threshold ``rows``' common case with batched tensor operations: each row's cut (temperature only; min_p
    with no atom that could hold a larger logit than ``E``'s; top_p decided by the ``_CUT_FIRST_ATOMS`` atoms with the
    largest members), its pool and its first proposal.  A row whose first proposal is a token of ``E`` (or that has
    no atom to propose) is drawn here; one whose first proposal is an atom gets its :class:`_Pool`, with the same
    proposal weights, for :func:`_threshold_draw` to go on; the rows missing from the result take :func:`_draw_row`.
    Each row's outcome depends on that row alone; a single row takes its own path (no faster alone)."""
    if len(rows) < 2:
        return {}
    index = torch.tensor(rows, dtype=torch.int64, device=exact_ids.device)
    ids, logits = exact_ids.index_select(0, index), exact_logits.index_select(0, index)
    log_mass = atoms.log_mass.index_select(0, index)
    is_atom = torch.isfinite(log_mass)
    largest = atoms.largest.index_select(0, index).masked_fill(~is_atom, float("-inf"))
    count, num_clusters = len(rows), log_mass.shape[1]
    min_p = torch.tensor([filters[row].min_p for row in rows], dtype=torch.float64)
    top_p = torch.tensor([filters[row].top_p for row in rows], dtype=torch.float64)
    cut = torch.full((count,), float("-inf"), dtype=torch.float64)
    decided = torch.ones(count, dtype=torch.bool)
    top_exact = logits.amax(1).double() if logits.shape[1] else torch.full((count,), float("-inf"), dtype=torch.float64)
    by_largest = largest.topk(min(num_clusters, _CUT_FIRST_ATOMS + 1), dim=1)
    uses_min_p = min_p > 0
    if bool(uses_min_p.any()):
        higher = by_largest.values[:, 0] + options.margin > top_exact.float()  # float32, as the row's own path
        decided &= ~(uses_min_p & higher)
        cut = torch.where(uses_min_p, top_exact + torch.log(min_p.clamp(min=1e-300)), cut)
    uses_top_p = ~uses_min_p & (top_p < 1)
    if bool(uses_top_p.any()):
        top_p_cut, top_p_decided = _batched_nucleus_cut(logits, log_mass, atoms, index, by_largest, top_p)
        cut = torch.where(uses_top_p, top_p_cut, cut)
        decided &= ~uses_top_p | top_p_decided
    # The pool: the atoms whose largest member plus the margin reaches the cut.  At most `_MASKED_BOUND_ATOMS` of
    # them are among the atoms with the largest members, and bounded by their members above the cut.
    # Compared in float32, as the row's own path compares its float32 tensors with the cut.
    cut32 = cut.float().view(-1, 1)
    in_pool = is_atom & (largest + options.margin >= cut32)
    pool_size = in_pool.sum(1)
    log_bound = torch.where(in_pool, log_mass.double() + options.margin, float("-inf"))
    small = (pool_size > 0) & (pool_size <= _MASKED_BOUND_ATOMS)
    if bool(small.any()):
        heaviest = largest.topk(min(num_clusters, _MASKED_BOUND_ATOMS), dim=1).indices
        members = atoms.estimates[index.view(-1, 1), heaviest].double() + options.margin  # [R, k, cap]
        members.masked_fill_(members < cut.view(-1, 1, 1), float("-inf"))
        masked = torch.logsumexp(members, 2).masked_fill_(~in_pool.gather(1, heaviest), float("-inf"))
        log_bound[small] = log_bound[small].scatter_(1, heaviest[small], masked[small])
    exact = torch.where(logits >= cut32, logits.double(), float("-inf"))
    weights = torch.cat([exact, log_bound], 1)
    cdf = torch.exp(weights - weights.amax(1, keepdim=True)).cumsum(1)
    first = uniform(derived_keys(keys.index_select(0, index)).view(-1, 1), torch.zeros(1, dtype=torch.int64))
    picks = torch.searchsorted(cdf, first * cdf[:, -1:]).clamp_(max=cdf.shape[1] - 1).view(-1)
    no_pool = torch.nonzero(pool_size == 0).flatten()  # drawn by vLLM's Gumbel-max over the exact tokens
    winners: dict[int, int] = {}
    if no_pool.numel():
        noise = gumbel(keys.index_select(0, index.index_select(0, no_pool)).view(-1, 1), ids.index_select(0, no_pool))
        winners = dict(zip(no_pool.tolist(), (exact.index_select(0, no_pool) + noise).argmax(1).tolist(), strict=True))
    result: dict[int, _RowDraw | _Pool] = {}
    num_exact = ids.shape[1]
    for i, (row, pick) in enumerate(zip(rows, picks.tolist(), strict=True)):
        if not bool(decided[i]):
            continue
        if not int(pool_size[i]):
            if not bool(torch.isfinite(exact[i]).any()):
                raise ValueError("a compact row with nothing to draw from")
            result[row] = _RowDraw(int(ids[i, winners[i]]), 0, False, False, 0.0)
        elif pick < num_exact:
            result[row] = _RowDraw(int(ids[i, pick]), 0, False, False, 0.0)
        else:
            clusters = torch.nonzero(in_pool[i]).flatten()
            unscored = torch.nonzero(is_atom[i]).flatten()
            bound_cut = float(cut[i]) if bool(small[i]) else float("-inf")
            result[row] = _Pool(
                ids[i], logits[i], float(cut[i]), bound_cut, clusters, log_bound[i, clusters], 0, False, unscored
            )
    return result


def _batched_nucleus_cut(
    logits: torch.Tensor,
    log_mass: torch.Tensor,
    atoms: Atoms,
    index: torch.Tensor,
    by_largest: torch.return_types.topk,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cut, decided)`` ``[R]``: :func:`_nucleus_cut`'s first reading (the ``_CUT_FIRST_ATOMS`` atoms with the
    largest members, ``by_largest``: the top of each row's atoms' largest member estimates, ``-inf`` past its atoms)
    for rows ``index`` of the batch; ``decided`` is False where that reading does not settle the cut."""
    take = min(by_largest.indices.shape[1], _CUT_FIRST_ATOMS)
    read = by_largest.indices[:, :take]
    read_valid = torch.isfinite(by_largest.values[:, :take])
    atom_count = torch.isfinite(log_mass).sum(1)
    log_total = torch.logsumexp(torch.cat([logits, log_mass], 1).double(), 1)
    exact_mass = torch.logsumexp(logits.double(), 1)
    read_mass = torch.logsumexp(
        torch.cat(
            [log_mass.gather(1, read).double().masked_fill(~read_valid, float("-inf")), exact_mass.view(-1, 1)], 1
        ),
        1,
    )
    enough = (read_mass - log_total >= torch.log(top_p)) | (atom_count <= take)
    estimates = atoms.estimates[index.view(-1, 1), read].masked_fill(~read_valid.unsqueeze(2), float("-inf"))
    values = torch.cat([logits, estimates.reshape(len(index), -1)], 1).double()
    ordered = values.topk(min(values.shape[1], _WINDOW), dim=1).values
    finite = torch.isfinite(ordered)
    mass = torch.exp(ordered - log_total.view(-1, 1))
    kept = (((mass.cumsum(1) - mass) < top_p.view(-1, 1)) & finite).sum(1)
    last = ordered.gather(1, (kept - 1).clamp(min=0).view(-1, 1)).view(-1)
    unread = by_largest.values[:, take] if by_largest.values.shape[1] > take else torch.full_like(last, float("-inf"))
    decided = enough & (kept < finite.sum(1)) & (kept > 0) & (last >= unread.double())
    return last, decided


def _proposals(cdf: torch.Tensor, key: torch.Tensor, batch: int) -> tuple[list[list[float]], list[int]]:
    """Batch ``batch`` of a row's proposals from its proposal ``cdf`` by inverse CDF: the uniforms (proposal, member,
    acceptance; ``_PROPOSALS`` each, from three streams of ``key``) and the picked positions."""
    streams = derived_keys(key + 3 * batch + torch.arange(3)).view(3, 1)
    draws = uniform(streams, torch.arange(_PROPOSALS)).tolist()
    picks = torch.searchsorted(cdf, torch.tensor(draws[0], dtype=cdf.dtype) * cdf[-1])
    return draws, picks.clamp_(max=cdf.numel() - 1).tolist()


def _member_slot(bounds: torch.Tensor, u: float) -> int:
    """The member of a proposed cluster that the uniform ``u`` picks, by the members' bounds (log weights)."""
    member_cdf = torch.exp(bounds - bounds.max()).cumsum(0)
    return min(int(torch.searchsorted(member_cdf, u * float(member_cdf[-1]))), bounds.numel() - 1)


def _threshold_draw(
    pool: _Pool, atoms: Atoms, key: torch.Tensor, resolve: Resolve, vocab_size: int, options: LawOptions
) -> _RowDraw:
    """The rejection draw of the module docstring: proposals drawn ``_PROPOSALS`` at a time from one fixed proposal
    (inverse CDF), the first accepted one kept.  With no atom to propose, vLLM's own Gumbel-max over the exact
    tokens."""
    ids, logits, cut, clusters, log_bound = pool.ids, pool.logits, pool.cut, pool.clusters, pool.log_bound
    exact = torch.where(logits >= cut, logits.double(), float("-inf"))
    if not clusters.numel():
        return _exact_draw(ids, exact, key, pool.resolved, pool.over_budget, None, 0.0)
    weights = torch.cat([exact, log_bound])
    cdf = torch.exp(weights - weights.max()).cumsum(0)
    resolved, bound, scored = pool.resolved, 0.0, {}
    member_bounds: dict[int, torch.Tensor] = {}
    for batch in range(_PROPOSAL_BATCHES):
        draws, picks = _proposals(cdf, key, batch)
        for proposal, pick in enumerate(picks):
            if pick < ids.numel():
                return _RowDraw(int(ids[pick]), resolved, pool.over_budget, False, bound)
            atom = pick - ids.numel()
            if atom not in scored:
                if resolved >= options.budget:
                    return _over_budget_draw(ids, exact, scored, cut, key, resolved, bound)
                scored[atom] = resolve(clusters[atom].view(1))
                member_bounds[atom] = _bounds(atoms, clusters[atom], pool.bound_cut, options.margin)
                resolved += 1
            new_ids, new_logits = scored[atom]
            bounds = member_bounds[atom]
            slot = _member_slot(bounds, draws[1][proposal])
            z = float(new_logits[slot])
            if batch == 0 and proposal == 0:
                bound = _missed_mass(exact, new_logits, bounds, log_bound, cut)
            if z >= cut and draws[2][proposal] < math.exp(z - float(bounds[slot])):
                return _RowDraw(int(new_ids[slot]), resolved, pool.over_budget, True, bound)
    # Bounds far above the exact logits accept too rarely: score the heaviest atoms left, within the budget.
    unscored = torch.ones(clusters.numel(), dtype=torch.bool, device=clusters.device)
    unscored[list(scored)] = False
    left = torch.nonzero(unscored).flatten()
    heaviest = left[log_bound[left].topk(min(left.numel(), max(0, options.budget - resolved))).indices]
    if heaviest.numel():
        scored[-1] = resolve(clusters[heaviest])
        resolved += int(heaviest.numel())
    over = pool.over_budget or left.numel() > heaviest.numel()
    return _over_budget_draw(ids, exact, scored, cut, key, resolved, bound, over)


def _exact_draw(
    ids: torch.Tensor,
    exact: torch.Tensor,
    key: torch.Tensor,
    resolved: int,
    over_budget: bool,
    from_atom_after: int | None,
    bound: float,
) -> _RowDraw:
    """Gumbel-max over exact tokens with vLLM's noise (``-inf``: not kept)."""
    scores = exact + gumbel(key, ids)
    if not bool(torch.isfinite(scores).any()):
        raise ValueError("a compact row with nothing to draw from")
    winner = int(scores.argmax())
    from_atom = from_atom_after is not None and winner >= from_atom_after
    return _RowDraw(int(ids[winner]), resolved, over_budget, from_atom, bound)


def _over_budget_draw(
    ids: torch.Tensor,
    exact: torch.Tensor,
    scored: dict[int, tuple[torch.Tensor, torch.Tensor]],
    cut: float,
    key: torch.Tensor,
    resolved: int,
    bound: float,
    over: bool = True,
) -> _RowDraw:
    """The draw from the exact tokens and the clusters scored so far, the rest dropped (``over``: the budget ran
    out before every atom that could hold a kept token was scored)."""
    count = ids.numel()
    for new_ids, new_logits in scored.values():
        ids = torch.cat([ids, new_ids])
        exact = torch.cat([exact, torch.where(new_logits >= cut, new_logits.double(), float("-inf"))])
    return _exact_draw(ids, exact, key, resolved, over, count, bound)


def _missed_mass(
    exact: torch.Tensor, member_logits: torch.Tensor, member_bounds: torch.Tensor, log_bound: torch.Tensor, cut: float
) -> float:
    """The first proposal's missed-mass estimate (module docstring) for the cluster it drew."""
    kept = torch.where(member_logits >= cut, member_logits.double(), float("-inf"))
    bound_mass = torch.logsumexp(member_bounds, 0)
    missed = ((kept - bound_mass).exp() - (member_bounds - bound_mass).exp()).clamp(min=0).sum()
    if not bool(missed > 0):
        return 0.0
    proposal = torch.logsumexp(torch.cat([exact, log_bound]), 0)
    exact_mass = torch.logsumexp(exact, 0) if bool(torch.isfinite(exact).any()) else proposal
    return float(missed * torch.exp(proposal - exact_mass))


def _filter_cutoff(values: torch.Tensor, row_filter: RowFilter, vocab_size: int) -> float:
    """The smallest log weight min_p and top_k keep among ``values`` (``-inf``: they keep all)."""
    cut = float("-inf")
    if values.numel() == 0:
        return cut
    if row_filter.min_p > 0.0:
        cut = float(values.max()) + math.log(row_filter.min_p)
    k = row_filter.top_k
    if k is not None and k < vocab_size:
        survivors = values[values >= cut]
        if survivors.numel() >= k:
            cut = max(cut, float(survivors.topk(k).values[-1]))
    return cut


class _Kept(NamedTuple):
    """A certified row's kept exact tokens after resolution and filters."""

    ids: torch.Tensor
    logits: torch.Tensor
    resolved: int
    over_budget: bool


def _certified(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atoms: Atoms,
    row_filter: RowFilter,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions,
) -> _Kept:
    """Resolve the atoms near the row's cutoff, the heaviest first, recomputing the cutoff after each
    ``_RESOLVE_CHUNK`` (it only rises as tokens are added), then apply vLLM's filters to the exact tokens."""
    finite = torch.isfinite(logits)
    ids, logits = ids[finite], logits[finite]
    clusters = torch.nonzero(torch.isfinite(atoms.log_mass)).flatten()
    largest = atoms.largest[clusters]
    resolved, over = 0, False
    while clusters.numel():
        near = torch.nonzero(largest + options.margin >= _filter_cutoff(logits, row_filter, vocab_size)).flatten()
        if not near.numel():
            break
        if resolved >= options.budget:
            over = True
            break
        near = near[largest[near].topk(min(near.numel(), _RESOLVE_CHUNK, options.budget - resolved)).indices]
        new_ids, new_logits = resolve(clusters[near])
        keep = torch.isfinite(new_logits)
        ids, logits = torch.cat([ids, new_ids[keep]]), torch.cat([logits, new_logits[keep]])
        rest = torch.ones(clusters.numel(), dtype=torch.bool, device=clusters.device)
        rest[near] = False
        clusters, largest = clusters[rest], largest[rest]
        resolved += int(near.numel())
    kept = logits >= _filter_cutoff(logits, row_filter, vocab_size)
    if row_filter.top_p < 1.0:
        inside = torch.nonzero(kept).flatten()
        kept = torch.zeros_like(kept)
        kept[inside[nucleus(logits[inside], row_filter.top_p)]] = True
    if not bool(kept.any()):
        raise ValueError("a compact row with nothing to draw from")
    return _Kept(ids[kept], logits[kept], resolved, over)


def _draw_row(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atoms: Atoms,
    row_filter: RowFilter,
    key: torch.Tensor,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions,
) -> _RowDraw:
    """One row's draw."""
    if _is_threshold(row_filter, vocab_size):
        pool = _threshold_pool(ids, logits, atoms, row_filter, resolve, options)
        return _threshold_draw(pool, atoms, key, resolve, vocab_size, options)
    spent = 0
    if _is_top_k_row(row_filter, vocab_size):
        attempt = _top_k_draw(ids, logits, atoms, int(row_filter.top_k), row_filter.top_p, key, resolve, options)
        if isinstance(attempt, _RowDraw):
            return attempt
        spent = attempt
    kept = _certified(ids, logits, atoms, row_filter, resolve, vocab_size, options)
    winner = int((kept.logits.double() + gumbel(key, kept.ids)).argmax())
    return _RowDraw(int(kept.ids[winner]), kept.resolved + spent, kept.over_budget, False, None)


def _is_top_k_row(row_filter: RowFilter, vocab_size: int) -> bool:
    """Whether the row asks for top_k, with or without top_p, and no min_p."""
    has_top_k = row_filter.top_k is not None and row_filter.top_k < vocab_size
    return has_top_k and row_filter.min_p <= 0.0


class _TopKRow:
    """A top_k row's known exact logits (``E``'s and the clusters scored so far) and the pool's unscored atoms, for
    the count of tokens above a logit."""

    def __init__(
        self, logits: torch.Tensor, atoms: Atoms, clusters: torch.Tensor, largest: torch.Tensor, margin: float
    ):
        self.known = logits.double()
        self.atoms, self.clusters, self.largest, self.margin = atoms, clusters, largest, margin
        self.unscored = torch.ones(clusters.numel(), dtype=torch.bool, device=clusters.device)
        self._unscored_bounds: torch.Tensor | None = None

    def add(self, position: int, member_logits: torch.Tensor) -> None:
        self.known = torch.cat([self.known, member_logits.double()])
        self.unscored[position] = False
        self._unscored_bounds = None

    def above(self, z: float) -> int:
        """Tokens known to be above ``z``."""
        return int((self.known > z).sum())

    def unscored_bounds(self) -> torch.Tensor:
        """Every unscored member's bound ``ẑ + δ`` (float64, ``-inf`` at padding), made again after each score."""
        if self._unscored_bounds is None:
            estimates = self.atoms.estimates[self.clusters[self.unscored]]
            self._unscored_bounds = (estimates.double() + self.margin).flatten()
        return self._unscored_bounds

    def could_be_above(self, z: float) -> torch.Tensor:
        """Positions of the unscored atoms with a member whose bound is above ``z``."""
        return torch.nonzero(self.unscored & (self.largest + self.margin > z)).flatten()

    def possibly_above(self, positions: torch.Tensor, z: float) -> int:
        """Members of the atoms at ``positions`` whose bound is above ``z``."""
        return int((self.atoms.estimates[self.clusters[positions]] + self.margin > z).sum())

    def could_be_in_top_k(self, k: int) -> torch.Tensor:
        """Positions of the unscored atoms with a member whose bound reaches the ``k``-th largest known logit."""
        known = self.known
        kth = float(known.topk(k).values[-1]) if known.numel() >= k else float("-inf")
        return torch.nonzero(self.unscored & (self.largest + self.margin >= kth)).flatten()

    def in_nucleus(self, z: float, k: int, top_p: float) -> bool | None:
        """Whether top_p keeps a token with logit ``z`` if it is among the top ``k``, decided from the known logits
        and the unscored members' bounds; None while the bounds leave it open.

        With ``A`` the mass above ``z`` and ``R`` the mass of the top ``k``'s tokens at or below ``z`` (all of ``A``
        is in the top ``k``), top_p keeps it iff ``A < p (A + R)``, i.e. ``(1 - p) A < p R``.  Keeping is hardest
        with every unscored member that could lie above ``z`` at its bound (``A`` largest, the fewest places left
        below ``z``, filled by known logits alone) and easiest with none above ``z`` and each at
        ``min(bound, z)``."""
        known = self.known
        if not bool(torch.isfinite(known).any()):
            return None
        bounds = self.unscored_bounds()
        top = float(torch.cat([known, bounds]).max())
        known_above, bound_above = known > z, bounds > z
        places = k - int(known_above.sum())
        if places <= 0:  # not among the top k
            return False
        above_low = float(torch.exp(known[known_above] - top).sum())
        above_high = above_low + float(torch.exp(bounds[bound_above] - top).sum())
        below = known[~known_above]
        rest_low = _top_mass(below, max(1, places - int(bound_above.sum())), top)
        rest_high = _top_mass(torch.cat([below, bounds.clamp(max=z)]), places, top)
        if (1.0 - top_p) * above_high < top_p * rest_low:
            return True
        if (1.0 - top_p) * above_low >= top_p * rest_high:
            return False
        return None


def _top_mass(values: torch.Tensor, count: int, top: float) -> float:
    """``Σ exp(v - top)`` over the ``count`` largest of ``values`` and every value tied with the last (vLLM's top_k
    keeps ties); 0 when there is none."""
    if not values.numel():
        return 0.0
    kth = values.topk(min(count, values.numel())).values[-1]
    return float(torch.exp(values[values >= kth] - top).sum())


def _top_p_floor(
    logits: torch.Tensor, atoms: Atoms, clusters: torch.Tensor, k: int, top_p: float, margin: float
) -> float:
    """The largest of a top_k row's exact ``logits`` that top_p surely drops, ``-inf`` if none: the exact mass above
    it is at least ``top_p`` times the largest mass the top ``k`` can have (``clusters``: every atom that could hold a
    token of the top ``k``, at its members' bounds).  top_p drops every token at or below it."""
    values = logits.double().sort().values
    if not values.numel():
        return float("-inf")
    every = torch.cat([values, (atoms.estimates[clusters].double() + margin).flatten()])
    top = float(every.max())
    top_k_high = _top_mass(every, k, top)
    mass = torch.exp(values - top).cumsum(0)
    above = mass[-1] - mass[torch.searchsorted(values, values, right=True) - 1]
    dropped = above >= top_p * top_k_high
    return float(values[dropped].max()) if bool(dropped.any()) else float("-inf")


def _top_k_draw(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atoms: Atoms,
    k: int,
    top_p: float,
    key: torch.Tensor,
    resolve: Resolve,
    options: LawOptions,
) -> _RowDraw | int:
    """A top_k row (``top_p`` 1 for none; no min_p) by rejection, or the clusters it resolved before giving up (a
    flat row; decisions past the budget; no proposal accepted): then :func:`_certified` draws it.  With no atom near
    the cutoff, the certified row's Gumbel-max over ``E``'s kept tokens (vLLM's token).

    The cutoff is at least ``low``, the ``k``-th largest exact logit of ``E`` (with top_p, at least
    :func:`_top_p_floor`): the proposal is the threshold rows' at the cut ``low`` (``E``'s tokens from ``low`` up by
    ``exp(z)``, the atoms that could reach it by their members' bounds), and a proposal with exact logit ``z`` (a
    member kept with probability ``exp(z - ẑ - δ)``) is kept iff fewer than ``k`` tokens lie above ``z`` (vLLM's
    top_k keeps ties) and, with top_p, the mass above ``z`` is below ``top_p`` times the top ``k``'s mass.  Neither
    needs a cluster scored while the known logits and the unscored members' bounds settle it, as for a proposal near
    the top of the row; otherwise the atoms that could change the answer are scored, the largest bounds first."""
    finite = torch.isfinite(logits)
    ids, logits = ids[finite], logits[finite]
    clusters = torch.nonzero(torch.isfinite(atoms.log_mass)).flatten()
    largest = atoms.largest[clusters]
    low = float(logits.topk(k).values[-1]) if logits.numel() >= k else float("-inf")
    near = largest + options.margin >= low
    clusters, largest = clusters[near], largest[near]  # every atom that could hold a token of the top k
    exact = torch.where(logits >= low, logits.double(), float("-inf"))
    if not clusters.numel():  # the certified row's draw, without its search for atoms near the cutoff
        if top_p < 1.0:
            inside = torch.nonzero(logits >= low).flatten()
            exact[inside[~nucleus(logits[inside], top_p)]] = float("-inf")
        return _exact_draw(ids, exact, key, 0, False, None, 0.0)._replace(bound=None)
    if clusters.numel() > 2 * options.budget:  # a flat row: a count near the cutoff would need more than the budget
        return 0
    if top_p < 1.0:
        low = max(low, _top_p_floor(logits, atoms, clusters, k, top_p, options.margin))
        exact = torch.where(logits >= low, logits.double(), float("-inf"))
    proposed = torch.nonzero(largest + options.margin >= low).flatten()  # positions in `clusters`
    if proposed.numel() <= _MASKED_BOUND_ATOMS:
        bound_cut = low
        log_bound = torch.logsumexp(_bounds(atoms, clusters[proposed], low, options.margin), 1)
    else:
        bound_cut = float("-inf")
        log_bound = atoms.log_mass[clusters[proposed]].double() + options.margin
    weights = torch.cat([exact, log_bound])
    cdf = torch.exp(weights - weights.max()).cumsum(0)
    row = _TopKRow(logits, atoms, clusters, largest, options.margin)
    scored: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    resolved = 0

    def score(positions: list[int]) -> bool:
        nonlocal resolved
        if resolved + len(positions) > options.budget:
            return False
        if positions:
            new_ids, new_logits = resolve(clusters[positions])
            for i, position in enumerate(positions):
                part = slice(i * atoms.members.shape[1], (i + 1) * atoms.members.shape[1])
                bounds = _bounds(atoms, clusters[position], bound_cut, options.margin)
                scored[position] = (new_ids[part], new_logits[part], bounds)
                row.add(position, new_logits[part])
            resolved += len(positions)
        return True

    def score_heaviest(positions: torch.Tensor) -> bool:
        return score(positions[largest[positions].topk(min(positions.numel(), _SCORE_CHUNK)).indices].tolist())

    def top_k_keeps(z: float) -> bool | None:
        """Whether fewer than ``k`` tokens lie above ``z``, scoring the atoms that could hold one (the largest bounds
        first) until the count is decided; None past the budget."""
        while row.above(z) < k:
            unsure = row.could_be_above(z)
            if not unsure.numel() or row.above(z) + row.possibly_above(unsure, z) < k:
                return True
            if not score_heaviest(unsure):
                return None
        return False

    def nucleus_keeps(z: float) -> bool | None:
        """Whether top_p keeps a token of the top ``k`` with logit ``z``, scoring what the bounds leave open: the atoms
        that could lie above ``z``, then those that could be in the top ``k``, the largest bounds first; None past
        the budget."""
        while (kept := row.in_nucleus(z, k, top_p)) is None:
            near = row.could_be_above(z)
            if not near.numel():
                near = row.could_be_in_top_k(k)
            if not near.numel():  # nothing left to score: the masses are exact, only a rounding tie gets here
                return False
            if not score_heaviest(near):
                return None
            if row.above(z) >= k:
                return False
        return kept

    for batch in range(_PROPOSAL_BATCHES):
        draws, picks = _proposals(cdf, key, batch)
        for proposal, pick in enumerate(picks):
            if pick < ids.numel():
                token, z, from_atom = int(ids[pick]), float(logits[pick]), False
            else:
                atom = int(proposed[pick - ids.numel()])
                if atom not in scored and not score([atom]):
                    return resolved
                new_ids, new_logits, bounds = scored[atom]
                slot = _member_slot(bounds, draws[1][proposal])
                z = float(new_logits[slot])
                if not (z >= low and draws[2][proposal] < math.exp(z - float(bounds[slot]))):
                    continue
                token, from_atom = int(new_ids[slot]), True
            in_nucleus = row.in_nucleus(z, k, top_p) if top_p < 1.0 else True  # scoring more keeps a True a True
            if in_nucleus is False:
                continue
            kept = top_k_keeps(z)
            if kept and in_nucleus is None:
                kept = nucleus_keeps(z)
            if kept is None:
                return resolved
            if kept:
                return _RowDraw(token, resolved, False, from_atom, None)
    return resolved
