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
  *exactly* from the softmax of ``{z_v : z_v >= τ}`` by rejection: the proposal weighs a token of ``E`` by
  ``exp(z_v)`` and an atom's member by its bound ``exp(ẑ_v + δ)``; a proposed member is scored with its cluster
  (*resolved*) and kept with probability ``exp(z_v - ẑ_v - δ)`` if ``z_v >= τ``; otherwise the cluster's members
  join the exact tokens and the proposal is drawn again.  Only proposed clusters are scored.  Without a miss the
  law is vLLM's dense one (top_p: at the estimated ``τ``).
* **Certified rows** (top_k; min_p with top_p): every atom whose largest member estimate plus ``δ`` reaches the
  filter's cutoff is resolved, the heaviest first, ``_RESOLVE_CHUNK`` at a time, with the cutoff computed again as
  resolved tokens raise it, up to ``budget`` clusters; the rest are dropped and vLLM's filters run on the exact
  tokens.  Without a miss the law is vLLM's dense one.

A row that needs more than ``budget`` clusters is counted; its unresolved atoms are dropped.  Each threshold row
reports an estimate of the mass its margin missed (:attr:`Drawn.bound_sum`): for the cluster the first proposal
drew (0 when it drew a token of ``E``), ``Σ_v (exp z_v − exp(ẑ_v + δ))⁺ / (exp(ẑ + δ) mass of the cluster)``, times
the proposal's total over ``E``'s kept mass, whose mean over rows is at least the missed mass over ``Z``.

The noise is vLLM's CPU noise (:mod:`~my_pkg.flashhead.gumbel`): the first proposal is a Gumbel-max that gives a
token of ``E`` the noise vLLM's kernel would give it (an atom ``c`` the noise of id ``V + c``); later proposals, the
member inside a cluster and the acceptance take further streams of the same key.  Given the seed, the draw is a
function of the row alone: a seeded request's text does not depend on its batch.

Imports torch only.
"""

from __future__ import annotations

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
#: Atoms (by their largest member estimate) the top_p cut reads first; four times as many while the cut is unsure.
_CUT_ATOMS = 64

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
    for row, row_filter in enumerate(filters):
        one = _draw_row(
            exact_ids[row],
            exact_logits[row],
            atoms.row(row),
            row_filter,
            keys[row],
            lambda clusters, row=row: resolve(row, clusters),
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
        return RowLaw(law, resolved, False)
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
    atom member ``v`` the cut keeps, ``b_v = exp(ẑ_v + δ)`` where that reaches the cut and 0 elsewhere.  0 when no
    member is missed (the draw's law is then :func:`row_law`'s); the mean of the draw's estimate otherwise.  Scores
    every atom: for measurements and tests."""
    if not _is_threshold(row_filter, vocab_size):
        raise ValueError(f"{row_filter} is no threshold row")
    pool = _threshold_pool(ids, logits, atoms, row_filter, resolve, options)
    if not pool.unscored.numel():
        return 0.0
    _, member_logits = resolve(pool.unscored)
    kept = torch.where(member_logits >= pool.cut, member_logits.double(), float("-inf"))
    bounds = _bounds(atoms, pool.unscored, pool.cut, options.margin).reshape(-1)
    missed = float((kept.exp() - bounds.exp()).clamp(min=0).sum())
    exact = pool.logits[pool.logits >= pool.cut].double()
    return missed / float(torch.logsumexp(exact, 0).exp()) if missed else 0.0


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
    clusters: torch.Tensor
    log_bound: torch.Tensor
    resolved: int
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
    resolved = 0
    cut = float("-inf")
    if row_filter.min_p > 0.0:
        # The cut is the largest logit's: score first every atom that could hold a larger one than E's.
        while logits.numel() or clusters.numel():
            top = float(logits.max()) if logits.numel() else float("-inf")
            higher = largest + options.margin > top
            if not bool(higher.any()):
                break
            new_ids, new_logits = resolve(clusters[higher])
            keep = torch.isfinite(new_logits)
            ids, logits = torch.cat([ids, new_ids[keep]]), torch.cat([logits, new_logits[keep]])
            resolved += int(higher.sum())
            clusters, largest = clusters[~higher], largest[~higher]
        cut = float(logits.max()) + math.log(row_filter.min_p)
    elif row_filter.top_p < 1.0:
        log_total = torch.logsumexp(torch.cat([logits, atoms.log_mass[clusters]]).double(), 0)
        cut = _nucleus_cut(logits, atoms.estimates, clusters, largest, float(log_total), row_filter.top_p)
    unscored = clusters
    clusters = clusters[largest + options.margin >= cut]
    if cut == float("-inf"):  # every member counts: the bounds' total is the estimated mass's
        log_bound = atoms.log_mass[clusters].double() + options.margin
    elif clusters.numel():
        log_bound = torch.logsumexp(_bounds(atoms, clusters, cut, options.margin), 1)
    else:
        log_bound = atoms.log_mass.new_empty(0, dtype=torch.float64)
    return _Pool(ids, logits, cut, clusters, log_bound, resolved, unscored)


def _nucleus_cut(
    logits: torch.Tensor,
    estimates: torch.Tensor,
    clusters: torch.Tensor,
    largest: torch.Tensor,
    log_total: float,
    top_p: float,
) -> float:
    """The last weight top_p keeps over ``E``'s exact logits and the member estimates of every atom in ``clusters``
    (``largest``: each one's largest), normalised by ``log_total``.  Reads the atoms with the largest members first:
    the cut is final once it is at least the largest member left unread."""
    count = clusters.numel()
    take = min(count, _CUT_ATOMS)
    while True:
        top = largest.topk(min(count, take + 1))
        read = clusters[top.indices[:take]]
        values = torch.cat([logits, estimates[read].reshape(-1)]).double()
        values = values[torch.isfinite(values)]
        ordered = values.topk(min(values.numel(), _WINDOW)).values
        mass = torch.exp(ordered - log_total)
        kept = int(((mass.cumsum(0) - mass) < top_p).sum())
        if kept == ordered.numel() < values.numel():
            ordered = values.sort(descending=True).values
            mass = torch.exp(ordered - log_total)
            kept = int(((mass.cumsum(0) - mass) < top_p).sum())
        unread = float(top.values[take]) if take < count else float("-inf")
        if take == count or (kept < ordered.numel() and float(ordered[kept - 1]) >= unread):
            return float(ordered[max(kept, 1) - 1])
        take = min(count, take * 4)


def _threshold_draw(
    pool: _Pool, atoms: Atoms, key: torch.Tensor, resolve: Resolve, vocab_size: int, options: LawOptions
) -> _RowDraw:
    """The rejection draw of the module docstring."""
    ids, logits, cut, clusters, log_bound = pool.ids, pool.logits, pool.cut, pool.clusters, pool.log_bound
    resolved, over, bound, first, from_e = pool.resolved, False, 0.0, True, ids.numel()
    while True:
        exact = torch.where(logits >= cut, logits.double(), float("-inf"))
        if resolved >= options.budget and clusters.numel():
            over, clusters, log_bound = True, clusters[:0], log_bound[:0]
        scores = torch.cat([exact + gumbel(key, ids), log_bound + gumbel(key, clusters + vocab_size)])
        if not bool(torch.isfinite(scores).any()):
            raise ValueError("a compact row with nothing to draw from")
        winner = int(scores.argmax())
        if winner < ids.numel():
            return _RowDraw(int(ids[winner]), resolved, over, winner >= from_e, bound)
        atom = winner - ids.numel()
        member_key = derived_keys(key)
        bounds = _bounds(atoms, clusters[atom], cut, options.margin)
        slot = int((bounds + gumbel(member_key, atoms.members[clusters[atom]])).argmax())
        new_ids, new_logits = resolve(clusters[atom].view(1))
        resolved += 1
        z = float(new_logits[slot])
        if first:
            bound = _missed_mass(exact, new_logits, bounds, log_bound, cut)
        if z >= cut and float(uniform(derived_keys(member_key), new_ids[slot])) < math.exp(z - float(bounds[slot])):
            return _RowDraw(int(new_ids[slot]), resolved, over, True, bound)
        keep = torch.isfinite(new_logits)
        ids, logits = torch.cat([ids, new_ids[keep]]), torch.cat([logits, new_logits[keep]])
        rest = torch.ones(clusters.numel(), dtype=torch.bool, device=clusters.device)
        rest[atom] = False
        clusters, log_bound = clusters[rest], log_bound[rest]
        key, first = derived_keys(member_key + 1), False


def _missed_mass(
    exact: torch.Tensor, member_logits: torch.Tensor, member_bounds: torch.Tensor, log_bound: torch.Tensor, cut: float
) -> float:
    """The first proposal's missed-mass estimate (module docstring) for the cluster it drew."""
    kept = torch.where(member_logits >= cut, member_logits.double(), float("-inf"))
    missed = (kept.exp() - member_bounds.exp()).clamp(min=0).sum()
    if not bool(missed > 0):
        return 0.0
    proposal = torch.logsumexp(torch.cat([exact, log_bound]), 0)
    exact_mass = torch.logsumexp(exact, 0) if bool(torch.isfinite(exact).any()) else proposal
    scale = torch.exp(proposal - torch.logsumexp(member_bounds, 0) - exact_mass)
    return float(missed * scale)


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
    kept = _certified(ids, logits, atoms, row_filter, resolve, vocab_size, options)
    winner = int((kept.logits.double() + gumbel(key, kept.ids)).argmax())
    return _RowDraw(int(kept.ids[winner]), kept.resolved, kept.over_budget, False, None)
