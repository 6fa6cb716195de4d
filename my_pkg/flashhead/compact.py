"""The head side of a compact sampled row: the clusters it scores exactly, the others as atoms, and the placeholder
row handed to the sampler.

Contract: for sampled rows at temperatures ``T``, :meth:`CompactHead.plan` scores a rank-``r`` estimate of every
token (:mod:`~my_pkg.flashhead.tail_estimate`), sums it per cluster into the cluster's estimated mass
``M̂_c = Σ exp(estimate_v / T)`` (members outside the pinned ids), scores exactly the members of the ``clusters``
clusters with the largest ``M̂_c`` and the pinned ids (the exact set ``E``), and returns

* the placeholder: ``[B, V]`` logits, exact on ``E`` and ``-inf`` elsewhere, for vLLM's own processing (min_tokens,
  temperature, min_p act on it as on any row);
* :class:`CompactRows`: ``E``'s ids and validity, and the atoms the draw (:mod:`~my_pkg.flashhead.compact_law`)
  proposes from: each other cluster's ``log M̂_c`` and its members' estimates (already divided by ``T``).

:meth:`CompactHead.resolve` scores a row's clusters exactly when the draw needs their members (a proposed atom, a
cluster near a filter's cutoff).  No ``[B, V]`` estimate is sorted or scattered, and no top-k runs over ``V``.

Imports torch only; the head reaches it as an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .compact_law import Atoms
from .layout import hidden_major, linear, prefers_hidden_major
from .tail_estimate import TailTables

if TYPE_CHECKING:
    from .head import FlashHead, PinnedIds

__all__ = ["CompactHead", "CompactRows", "compact_clusters"]

PostProcess = Callable[[torch.Tensor], torch.Tensor]


#: Clusters the exact set leaves to the draw: a row resolves 0.1–1.5 on average (trained fixture, every setting but
#: top_k with top_p), so that the set and the draw together score no more rows than today's sampled row.
_DRAW_RESERVE = 2
#: The same for a row with both top_k and top_p, whose draw resolves 4–6.5 clusters (the count of tokens above a
#: proposal and its top_p verdict both read the atoms near the k-th logit).
_TOP_K_TOP_P_RESERVE = 6


def compact_clusters(head: FlashHead, *, top_k_with_top_p: bool = False) -> int:
    """Clusters a compact row scores exactly: as many rows as a sampled row of today's law scores
    (``sampled_n_probes`` clusters and ``sampled_rescore`` tokens), in whole clusters, less the clusters the draw
    resolves (``_DRAW_RESERVE``; ``_TOP_K_TOP_P_RESERVE`` for a row with both top_k and top_p); at least one."""
    rescored = -(-head.sampled_rescore // head.cluster_size)
    reserve = _TOP_K_TOP_P_RESERVE if top_k_with_top_p else _DRAW_RESERVE
    return max(1, min(head.num_clusters, head.sampled_n_probes + rescored - reserve))


@dataclass
class CompactRows:
    """What the draw needs of a step's compact rows (``B`` rows, on the head's device).

    ``exact_ids`` ``[B, N]``: the exact set ``E`` (the chosen clusters' members, then the pinned ids); ``exact_valid``
    marks each id's first appearance (padding slots and pinned ids inside a chosen cluster are repeats).
    ``atom_log_mass`` ``[B, C]`` float32: ``log M̂_c / T`` of every cluster outside ``E``, ``-inf`` for the chosen
    ones and clusters with no member left; ``atom_log_max`` ``[B, C]``: each cluster's largest member estimate;
    ``member_estimates`` ``[B, C, cap]``: each member's estimate in the same
    units (``-inf`` at padding slots and pinned ids; a permuted view of ``[cap, C, B]`` storage); ``members``
    ``[C, cap]``: the head's cluster map.
    """

    hidden: torch.Tensor
    temperature: torch.Tensor
    exact_ids: torch.Tensor
    exact_valid: torch.Tensor
    atom_log_mass: torch.Tensor
    atom_log_max: torch.Tensor
    member_estimates: torch.Tensor
    members: torch.Tensor
    postprocess: PostProcess
    pinned: torch.Tensor | None

    @property
    def num_rows(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def atoms(self) -> Atoms:
        return Atoms(self.atom_log_mass, self.atom_log_max, self.member_estimates, self.members)

    @staticmethod
    def concat(parts: Sequence[CompactRows]) -> CompactRows:
        """The rows of ``parts`` (planned by the same head and post-processing) one after the other; the exact sets are
        padded to the widest with invalid slots."""
        if len(parts) == 1:
            return parts[0]
        width = max(int(part.exact_ids.shape[1]) for part in parts)

        def padded(tensor: torch.Tensor, value: int | bool) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, width - int(tensor.shape[1])), value=value)

        first = parts[0]
        return CompactRows(
            hidden=torch.cat([part.hidden for part in parts]),
            temperature=torch.cat([part.temperature for part in parts]),
            exact_ids=torch.cat([padded(part.exact_ids, 0) for part in parts]),
            exact_valid=torch.cat([padded(part.exact_valid, False) for part in parts]),
            atom_log_mass=torch.cat([part.atom_log_mass for part in parts]),
            atom_log_max=torch.cat([part.atom_log_max for part in parts]),
            member_estimates=torch.cat([part.member_estimates for part in parts]),
            members=first.members,
            postprocess=first.postprocess,
            pinned=first.pinned,
        )


class CompactHead:
    """A head's compact rows: the cluster map's real slots and the estimate's table in cluster order (made once per
    table), and the two calls of the module docstring."""

    def __init__(self, head: FlashHead) -> None:
        self.head = head
        members = head.members
        slots = torch.arange(members.shape[1], device=members.device)
        # `build_members` pads a short cluster with its first member: a slot past the first repeating it is padding.
        self.member_valid = (slots == 0) | (members != members[:, :1])
        self._tables: TailTables | None = None
        self._layouts: dict[str, torch.Tensor] = {}  # the table in slot order, by layout
        self._pinned: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the estimate's table in slot order (each layout once made)."""
        return sum(table.numel() * table.element_size() for table in self._layouts.values())

    def _estimates_by_slot(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[cap * C, B]`` contiguous: the estimate of every cluster slot, slot-major (slot 0 of every cluster, then
        slot 1...), the rows innermost.  The head's table is read in that order, so that no ``[B, V]`` estimate is
        gathered and a cluster's reductions run along contiguous ``[C * B]`` vectors.  One row reads the table stored
        hidden-major where FlashHead stores float32 matrices so (a vector product); several rows read it row-major, the
        faster product for them on CPU (a bfloat16 table is row-major for both)."""
        tables = self.head.estimate.tables()
        if self._tables is not tables:
            self._tables, self._layouts = tables, {}
        reduced = hidden.to(tables.basis.dtype) @ tables.basis
        one_row = hidden.shape[0] == 1
        layout = "hidden_major" if one_row and prefers_hidden_major(tables.projected) else "row_major"
        table = self._layouts.get(layout)
        if table is None:
            by_slot = tables.projected[self.head.members.t().reshape(-1)]
            table = self._layouts[layout] = hidden_major(by_slot) if layout == "hidden_major" else by_slot.contiguous()
        if one_row:
            return linear(reduced, table).view(-1, 1)
        return torch.mm(table, reduced.t())

    def _excluded(self, pinned: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(is_pinned [V] or None, slots [K])``: the pinned ids as a mask, and the slot-major flat cluster slots that
        are no atom's member (padding, pinned ids); remembered for the last pinned tensor."""
        if self._pinned is not None and self._pinned[0] is pinned:
            return self._pinned[1], self._pinned[2]
        invalid = ~self.member_valid
        is_pinned = None
        if pinned is not None and pinned.numel():
            is_pinned = torch.zeros(self.head.vocab_size, dtype=torch.bool, device=pinned.device)
            is_pinned.index_fill_(0, pinned, True)
            invalid = invalid | is_pinned[self.head.members]
        slots = torch.nonzero(invalid.t().reshape(-1)).flatten()
        self._pinned = (pinned, is_pinned, slots)
        return is_pinned, slots

    def plan(
        self,
        hidden: torch.Tensor,
        temperature: torch.Tensor,
        *,
        pinned: PinnedIds | None,
        postprocess: PostProcess,
        clusters: int,
    ) -> tuple[torch.Tensor, CompactRows]:
        """``(placeholder [B, V], rows)`` for sampled rows ``hidden`` ``[B, H]`` at ``temperature`` ``[B]`` (> 0);
        ``pinned``: ids scored exactly on every row and never part of an atom; ``clusters``: how many are exact."""
        head = self.head
        hidden = head.check_hidden(hidden)
        head.candidate_rows.refresh()
        temperature = temperature.to(hidden.device, torch.float32)
        per_slot = postprocess(self._estimates_by_slot(hidden)).float().div_(temperature)
        pinned_ids = pinned.ids if pinned is not None else None
        is_pinned, excluded = self._excluded(pinned_ids)
        if excluded.numel():
            per_slot.index_fill_(0, excluded, float("-inf"))
        cap, num_clusters = head.members.shape[1], head.members.shape[0]
        by_slot = per_slot.view(cap, num_clusters, hidden.shape[0])
        largest, log_mass = _largest_and_log_mass(by_slot)  # [B, C] each
        chosen = log_mass.topk(min(clusters, head.num_clusters), dim=1).indices
        ids, exact = head.candidate_rows.candidate_logits(hidden, chosen)
        exact = postprocess(exact)
        valid = self.member_valid[chosen].reshape(ids.shape)
        if is_pinned is not None:
            valid &= ~is_pinned[ids]
        placeholder = torch.full(
            (hidden.shape[0], head.vocab_size), float("-inf"), dtype=exact.dtype, device=hidden.device
        )
        placeholder.scatter_(1, ids, exact)
        if pinned is not None and pinned_ids is not None and pinned_ids.numel():
            pinned_logits = postprocess(torch.nn.functional.linear(hidden.to(pinned.rows.dtype), pinned.rows))
            placeholder.index_copy_(1, pinned_ids, pinned_logits.to(placeholder.dtype))
            ids = torch.cat([ids, pinned_ids.expand(hidden.shape[0], -1)], dim=1)
            valid = torch.cat(
                [valid, torch.ones(ids.shape[0], pinned_ids.numel(), dtype=torch.bool, device=ids.device)], 1
            )
        rows = CompactRows(
            hidden=hidden.detach().clone(),
            temperature=temperature,
            exact_ids=ids,
            exact_valid=valid,
            atom_log_mass=log_mass.scatter_(1, chosen, float("-inf")),
            atom_log_max=largest,
            member_estimates=by_slot.permute(2, 1, 0),
            members=head.members,
            postprocess=postprocess,
            pinned=is_pinned,
        )
        return placeholder, rows

    def resolve(self, rows: CompactRows, row: int, clusters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [k * cap], logits [k * cap] float32)``: the exact logits of row ``row``'s clusters ``clusters``
        ``[k]``, post-processed and divided by the row's temperature as vLLM's sampler sees a logit; ``-inf`` at
        padding slots and pinned ids (already exact in ``E``)."""
        head = self.head
        hidden = rows.hidden[row : row + 1]
        ids, exact = head.candidate_rows.candidate_logits(hidden, clusters.view(1, -1))
        values = rows.postprocess(exact).float()[0].div_(rows.temperature[row])
        invalid = ~self.member_valid[clusters].reshape(-1)
        if rows.pinned is not None:
            invalid |= rows.pinned[ids[0]]
        return ids[0], values.masked_fill_(invalid, float("-inf"))


def _largest_and_log_mass(by_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, logsumexp)`` ``[B, C]`` contiguous over the slots of ``by_slot`` ``[cap, C, B]`` (contiguous), sharing
    the max (``-inf`` for a cluster with no finite slot)."""
    largest = by_slot.amax(dim=0)
    shift = largest.masked_fill(torch.isneginf(largest), 0.0)
    log_mass = (by_slot - shift).exp_().sum(dim=0).log_().add_(shift)
    return largest.t().contiguous(), log_mass.t().contiguous()
