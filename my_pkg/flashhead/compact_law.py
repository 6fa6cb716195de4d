"""The law a compact sampled row is drawn from, and the draw.

A compact row (:mod:`~my_pkg.flashhead.compact`) has exact logits on its exact set ``E`` and, for every other
cluster ``c``, one *atom*: the cluster's estimated mass ``M̂_c``.  Its law before filters gives a token of ``E``
its exact weight ``exp(z_v / T)`` and a token ``v`` of an atom ``M̂_c · exp(z_v / T) / M_c``: the cluster's total
is estimated, its split among the members is exact.  vLLM's filters act on it in vLLM's order (min_p, then top_k,
then top_p renormalised over what is left; a token is kept by top_p iff the mass before it is below ``p``; top_k
keeps ties with the k-th value):

* **top_k or min_p** (with or without top_p): every atom whose largest estimated member weight, times
  ``e^margin``, reaches the filter's cutoff is scored exactly (*resolved*), at most ``budget`` clusters, the
  heaviest first, the cutoff computed again as resolved tokens raise it; the other atoms are dropped.  The
  filtered law is then vLLM's dense one unless a dropped token's weight was underestimated by more than
  ``e^margin`` (a *miss*); a row that needed more than the budget is counted.  (Bounding every member by the
  cluster's whole mass makes a miss need the mass underestimated instead, but resolved 3–6 times as many clusters
  on the trained fixture, and missed more often there because the budget ran out.)
* **top_p alone**: atoms near the nucleus's cutoff (computed over tokens and atoms) are resolved the same way;
  the nucleus is then taken over the exact tokens and the remaining atoms, by weight.  Its error is measured,
  not certified (the cutoff depends on the estimated normaliser).
* **temperature only**: no filter; the total variation distance to the dense law equals that of the atom
  masses, and ``B = Σ_c |M_c − M̂_c| / Ẑ`` bounds it.  ``|M_c / M̂_c − 1|`` of a drawn atom (0 when a token of
  ``E`` is drawn) is an unbiased estimate of ``B``, reported per row (:attr:`Drawn.bound_sum`).

The draw is a Gumbel-max over the kept tokens and atoms with vLLM's CPU noise (:mod:`~my_pkg.flashhead.gumbel`:
a token of ``E`` gets the noise vLLM's kernel would give it; atom ``c`` the noise of id ``V + c``); a drawn atom
is resolved and its token drawn from the exact conditional with a second stream.  Given the seed, the draw is a
function of the row alone: a seeded request's text does not depend on its batch.

Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .gumbel import derived_keys, gumbel

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_MARGIN",
    "DEFAULT_OPTIONS",
    "Drawn",
    "LawOptions",
    "RowFilter",
    "RowLaw",
    "draw",
    "nucleus",
    "row_law",
]

#: ``ln 4``: no miss in 2,048 held-out rows of each of 8 top_k / min_p settings on the trained fixture
#: (docs/research/sampling.md).
DEFAULT_MARGIN = math.log(4.0)
#: Clusters resolved per row at most.
DEFAULT_BUDGET = 64
#: Entries :func:`nucleus` sorts at most (the heaviest, or those around the cut's weight).
_WINDOW = 1024
#: Atoms resolved at a time before the cutoff is computed again.
_RESOLVE_CHUNK = 16

Resolve = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LawOptions:
    margin: float = DEFAULT_MARGIN
    budget: int = DEFAULT_BUDGET


#: The defaults.
DEFAULT_OPTIONS = LawOptions()


class _RowDraw(NamedTuple):
    token: int
    resolved: int
    over_budget: bool
    from_atom: bool
    bound: float | None  # temperature-only rows: |M_c / M̂_c - 1| of the drawn atom, 0 for a token of E


class RowLaw(NamedTuple):
    """``probs`` ``[V]`` float64; the clusters resolved near the row's cutoff, and whether the budget stopped it."""

    probs: torch.Tensor
    resolved: int
    over_budget: bool


class RowFilter(NamedTuple):
    """One row's filters as vLLM's sampler holds them: ``top_k`` None or ``>= V`` for none, ``top_p`` 1 for none,
    ``min_p`` 0 for none."""

    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass
class Drawn:
    """A step's compact draws: the tokens, and what the draw did."""

    tokens: torch.Tensor
    resolved_clusters: int = 0
    over_budget_rows: int = 0
    atom_rows: int = 0
    bound_sum: float = 0.0
    bound_rows: int = 0


def draw(
    exact_ids: torch.Tensor,
    exact_logits: torch.Tensor,
    atom_log_mass: torch.Tensor,
    filters: list[RowFilter],
    keys: torch.Tensor,
    resolve: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    vocab_size: int,
    options: LawOptions = DEFAULT_OPTIONS,
    atom_log_size: torch.Tensor | None = None,
    atom_log_max: torch.Tensor | None = None,
) -> Drawn:
    """Draw one token per row.

    Args:
        exact_ids: ``[B, N]`` each row's exact set ``E``.
        exact_logits: ``[B, N]`` their logits as vLLM's sampler holds them (post-processed, divided by the
            temperature, min_p and min_tokens applied); ``-inf`` for a masked token or a repeated id.
        atom_log_mass: ``[B, C]`` ``log M̂_c / T`` per cluster outside ``E`` (``-inf``: no atom).
        filters: each row's :class:`RowFilter`.
        keys: ``[B]`` int64 noise keys (:func:`~my_pkg.flashhead.gumbel.row_keys` of the rows' seeds).
        resolve: ``(row, clusters [k]) -> (ids, logits)`` exact logits of a row's clusters' members, scaled as
            ``exact_logits`` (``-inf`` for ids already in ``E``).
        vocab_size: ``V``; atom ``c`` draws the noise of id ``V + c``.
        atom_log_size: ``[C]`` log of each cluster's member count (top_p orders an atom by its members' mean
            weight); None: by its mass.
        atom_log_max: ``[B, C]`` each atom's largest estimated member weight, as ``atom_log_mass`` (top_k and min_p
            resolve by it); None: by the mass.
    """
    drawn = Drawn(tokens=torch.empty(exact_ids.shape[0], dtype=torch.int64))
    for row, row_filter in enumerate(filters):
        one = _draw_row(
            exact_ids[row],
            exact_logits[row],
            atom_log_mass[row],
            row_filter,
            keys[row],
            lambda clusters, row=row: resolve(row, clusters),
            vocab_size,
            options,
            atom_log_size,
            atom_log_max[row] if atom_log_max is not None else None,
        )
        drawn.tokens[row] = one.token
        drawn.resolved_clusters += one.resolved
        drawn.over_budget_rows += int(one.over_budget)
        drawn.atom_rows += int(one.from_atom)
        if one.bound is not None:
            drawn.bound_rows += 1
            drawn.bound_sum += one.bound
    return drawn


def nucleus(values: torch.Tensor, top_p: float, keys: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask of the entries of ``values`` (log weights) that top-p keeps: sorted by weight (or by ``keys``, the
    same shape), those whose mass before them is below ``top_p`` (the first always; among equal values, which come
    first is arbitrary, as in vLLM's sort).

    Without a sort of every entry: the ``_WINDOW`` heaviest decide when the cut falls among them; otherwise the
    cut's weight is found by bisection on the weight (the mass above a weight only grows as the weight falls),
    until few enough entries lie between the bounds to sort them."""
    count = values.numel()
    probs = torch.softmax(values.double(), dim=0)
    keys = probs if keys is None else keys.double()
    window = min(count, _WINDOW)
    top = keys.topk(window).indices
    mass = probs[top]
    before = mass.cumsum(0) - mass
    inside = before < top_p
    inside[0] = True
    mask = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    if window == count or not bool(inside[-1]):
        mask[top[inside]] = True
        return mask
    # The mass keyed above `high` is below top_p (the window's last entry is in); above `low`, not.
    low, high = float(keys.min()) - 1.0, float(keys[top[-1]])
    while True:
        between = (keys > low) & (keys < high)
        if int(between.sum()) <= _WINDOW:
            break
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if float(probs[keys > middle].sum()) < top_p:
            high = middle
        else:
            low = middle
    kept = keys >= high
    rest = torch.nonzero(between).flatten()
    order = rest[keys[rest].argsort(descending=True)]
    before = float(probs[kept].sum()) + probs[order].cumsum(0) - probs[order]
    mask[kept] = True
    mask[order[before < top_p]] = True
    return mask


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


def _filtered(values: torch.Tensor, row_filter: RowFilter, vocab_size: int) -> torch.Tensor:
    """Bool mask of ``values`` kept by min_p, top_k, then top_p over the survivors."""
    kept = values >= _filter_cutoff(values, row_filter, vocab_size)
    if row_filter.top_p < 1.0:
        inside = torch.nonzero(kept).flatten()
        kept = torch.zeros_like(kept)
        kept[inside[nucleus(values[inside], row_filter.top_p)]] = True
    return kept


def _is_certified(row_filter: RowFilter, vocab_size: int) -> bool:
    return (row_filter.top_k is not None and row_filter.top_k < vocab_size) or row_filter.min_p > 0.0


class _Kept(NamedTuple):
    """A row's items after resolution and filters: exact tokens and atoms."""

    ids: torch.Tensor
    logits: torch.Tensor
    atoms: torch.Tensor
    masses: torch.Tensor
    resolved: int
    over_budget: bool


def _kept(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atom_log_mass: torch.Tensor,
    atom_log_size: torch.Tensor | None,
    atom_log_max: torch.Tensor | None,
    row_filter: RowFilter,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions,
) -> _Kept:
    """Resolve the atoms near the row's cutoff, the heaviest first, recomputing the cutoff after each
    ``_RESOLVE_CHUNK`` (it only rises as tokens are added for top_k / min_p), then apply the filters."""
    finite = torch.isfinite(logits)
    ids, logits = ids[finite], logits[finite]
    atoms = torch.nonzero(torch.isfinite(atom_log_mass)).flatten()
    masses = atom_log_mass[atoms]
    certified = _is_certified(row_filter, vocab_size)
    resolved, over = 0, False
    while (certified or row_filter.top_p < 1.0) and atoms.numel():
        # top_k / min_p: an atom's place is its heaviest member's estimated weight. top_p alone: its members' mean
        # weight, and its mass counts whole.
        if certified:
            keys = atom_log_max[atoms] if atom_log_max is not None else masses
        else:
            keys = _atom_keys(atoms, masses, atom_log_size)
        if certified:
            cut = _filter_cutoff(logits, row_filter, vocab_size)
        else:
            order_keys = torch.cat([logits, keys])
            cut = float(order_keys[nucleus(torch.cat([logits, masses]), row_filter.top_p, order_keys)].min())
        near = torch.nonzero(keys + options.margin >= cut).flatten()
        if not near.numel():
            break
        if resolved >= options.budget:
            over = True
            break
        near = near[keys[near].topk(min(near.numel(), _RESOLVE_CHUNK, options.budget - resolved)).indices]
        new_ids, new_logits = resolve(atoms[near])
        keep = torch.isfinite(new_logits)
        ids, logits = torch.cat([ids, new_ids[keep]]), torch.cat([logits, new_logits[keep]])
        rest = torch.ones(atoms.numel(), dtype=torch.bool, device=atoms.device)
        rest[near] = False
        atoms, masses = atoms[rest], masses[rest]
        resolved += int(near.numel())
    if certified:
        kept = _filtered(logits, row_filter, vocab_size)
        ids, logits = ids[kept], logits[kept]
        atoms, masses = atoms[:0], masses[:0]
    elif row_filter.top_p < 1.0:
        order_keys = torch.cat([logits, _atom_keys(atoms, masses, atom_log_size)])
        kept = nucleus(torch.cat([logits, masses]), row_filter.top_p, order_keys)
        tokens_kept, atoms_kept = kept[: logits.numel()], kept[logits.numel() :]
        ids, logits = ids[tokens_kept], logits[tokens_kept]
        atoms, masses = atoms[atoms_kept], masses[atoms_kept]
    if ids.numel() + atoms.numel() == 0:
        raise ValueError("a compact row with nothing to draw from")
    return _Kept(ids, logits, atoms, masses, resolved, over)


def _atom_keys(atoms: torch.Tensor, masses: torch.Tensor, atom_log_size: torch.Tensor | None) -> torch.Tensor:
    """An atom's place in the top_p order: its members' mean weight (its mass without sizes)."""
    return masses if atom_log_size is None else masses - atom_log_size[atoms]


def _members(resolve: Resolve, atom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    member_ids, member_logits = resolve(atom.view(1))
    keep = torch.isfinite(member_logits)
    if not bool(keep.any()):
        raise ValueError(f"cluster {int(atom)} has no member to draw")
    return member_ids[keep], member_logits[keep]


def _draw_row(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atom_log_mass: torch.Tensor,
    row_filter: RowFilter,
    key: torch.Tensor,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions,
    atom_log_size: torch.Tensor | None,
    atom_log_max: torch.Tensor | None,
) -> _RowDraw:
    """One row's draw."""
    kept = _kept(ids, logits, atom_log_mass, atom_log_size, atom_log_max, row_filter, resolve, vocab_size, options)
    ids, atoms = kept.ids, kept.atoms
    scores = torch.cat([kept.logits, kept.masses]).double() + gumbel(key, torch.cat([ids, atoms + vocab_size]))
    winner = int(scores.argmax())
    temperature_only = not _is_certified(row_filter, vocab_size) and row_filter.top_p >= 1.0
    if winner < ids.numel():
        return _RowDraw(int(ids[winner]), kept.resolved, kept.over_budget, False, 0.0 if temperature_only else None)
    atom = winner - ids.numel()
    member_ids, member_logits = _members(resolve, atoms[atom])
    inner = member_logits.double() + gumbel(derived_keys(key), member_ids)
    token = int(member_ids[int(inner.argmax())])
    bound = None
    if temperature_only:
        exact_mass = float(torch.logsumexp(member_logits.double(), 0))
        bound = abs(math.expm1(exact_mass - float(kept.masses[atom])))
    return _RowDraw(token, kept.resolved + 1, kept.over_budget, True, bound)


def row_law(
    ids: torch.Tensor,
    logits: torch.Tensor,
    atom_log_mass: torch.Tensor,
    row_filter: RowFilter,
    resolve: Resolve,
    vocab_size: int,
    options: LawOptions = DEFAULT_OPTIONS,
    atom_log_size: torch.Tensor | None = None,
    atom_log_max: torch.Tensor | None = None,
) -> RowLaw:
    """The law :func:`draw` draws one row from (every kept atom resolved to spread its mass by the exact
    conditional); the reference the tests and the fidelity measurements compare with."""
    kept = _kept(ids, logits, atom_log_mass, atom_log_size, atom_log_max, row_filter, resolve, vocab_size, options)
    weights = torch.softmax(torch.cat([kept.logits, kept.masses]).double(), dim=0)
    law = torch.zeros(vocab_size, dtype=torch.float64, device=ids.device)
    law.index_add_(0, kept.ids, weights[: kept.ids.numel()])
    if kept.atoms.numel():
        member_ids, member_logits = resolve(kept.atoms)  # the atoms' members, cluster after cluster
        per_atom = member_logits.double().view(kept.atoms.numel(), -1)
        shares = torch.softmax(per_atom, dim=1) * weights[kept.ids.numel() :].view(-1, 1)
        finite = torch.isfinite(per_atom).view(-1)
        law.index_add_(0, member_ids[finite], shares.view(-1)[finite])
    return RowLaw(law, kept.resolved, kept.over_budget)
