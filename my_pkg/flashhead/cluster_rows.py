"""The cluster map (:func:`build_members`) and a cluster-major copy of the head's rows, so that stage 2 on CPU
reads each probed cluster in one run.

A cluster's members are scattered over the head (token ids in no particular order), so stage 2 reads
``P * cap`` rows from as many places; on CPU that took 2.3x-2.5x as long as reading them cluster by cluster
from consecutive rows (one decode row, one thread: 6.0 against 2.6 ms at 262,144 x 640 with 512 probes, 5.3
against 2.2 ms at 128,256 x 2,048 with 251; ``python -m bench.experiments.cluster_rows``, docs/research/experiments.md).
:class:`ClusterRows` holds the head's ``V`` token rows sorted by cluster (each token once, padding rows
left out) and the cluster map in that copy's row numbers, so the kernels score a probed cluster from
consecutive rows and compute every dot product from the same values as over the head itself: the logits
are the same, bit for bit.

The price is one more copy of the head's token rows (``V * H`` elements, in the head's dtype): made on CPU
only, where the scattered reads are slow and memory is plentiful (``MY_PKG_FLASHHEAD_CLUSTER_ROWS=0`` turns
it off); heads over the same weight and cluster map share one copy (an EAGLE drafter's head over the
target's LM head).  A weight changed in place after the copy was made (an RL loop's weight sync) is
noticed by :meth:`ClusterRows.refresh`, which compares one row of the copy per call with the head's and
copies the whole head again when they differ.

Imports torch only.
"""

from __future__ import annotations

import logging
import weakref

import torch

__all__ = ["ClusterRows", "build_members", "cluster_rows_for"]

logger = logging.getLogger(f"vllm.{__name__}")

# Rows between two rows checked by consecutive `refresh` calls: far apart, so that a few calls look at rows spread
# over the whole head, and a prime, so that every row is checked once in `V` calls (V not a multiple of it).
_CHECK_STRIDE = 40_507

# The integer type of each float's width: rows compare bit for bit (a NaN equals itself).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def build_members(
    assignments: torch.Tensor, num_clusters: int | None = None, *, allow_empty: bool = False
) -> torch.Tensor:
    """Cluster map ``[C, cap]`` int64 of token ids from per-token cluster ids.

    ``cap`` is the largest cluster size.  Shorter clusters are padded by repeating their
    first member, so scoring the padded slots only duplicates an exact logit.  Raises
    ``ValueError`` for ids out of range, and for an empty cluster unless ``allow_empty``
    (a vocabulary shard holds only some of each cluster's members): an empty cluster's
    slots then hold token 0, whose logit is exact like any other candidate's.
    """
    a = assignments.detach().to("cpu", torch.int64).flatten()
    if a.numel() == 0:
        raise ValueError("assignments is empty")
    c = int(a.max()) + 1 if num_clusters is None else num_clusters
    if int(a.min()) < 0 or int(a.max()) >= c:
        raise ValueError(f"cluster ids must lie in [0, {c})")
    counts = torch.bincount(a, minlength=c)
    empty = counts == 0
    if bool(empty.any()) and not allow_empty:
        raise ValueError("every cluster needs at least one member")
    cap = int(counts.max())
    order = torch.argsort(a, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(cap).view(1, cap)
    pos = starts.view(-1, 1) + torch.minimum(slot, (counts - 1).clamp(min=0).view(-1, 1))
    pos = torch.where(slot < counts.view(-1, 1), pos, starts.view(-1, 1))
    members = order[pos.clamp(max=a.numel() - 1)]
    return members.masked_fill_(empty.view(-1, 1), 0)


class ClusterRows:
    """The ``V`` token rows of ``weight`` in cluster order, and how the cluster map reads them.

    Args:
        weight: ``[V', H]`` head weight (``V <= V'``; rows from ``V`` on are in no cluster).
        assignments: ``[V]`` int64 cluster id of each token, on the weight's device.
        members: ``[C, cap]`` the cluster map in token ids (:func:`build_members`).

    Attributes:
        rows: ``[V, H]`` the copy: row ``i`` is token ``order[i]``'s.
        slots: ``[C, cap]`` ``members`` in rows of the copy (padding and empty clusters repeat a row, as there).
        token_cluster: ``[V]`` the cluster of each row of the copy, ascending.
        row_of: ``[V]`` the row of the copy that holds each token.
    """

    def __init__(self, weight: torch.Tensor, assignments: torch.Tensor, members: torch.Tensor) -> None:
        self.order = torch.argsort(assignments, stable=True)
        self.row_of = torch.empty_like(self.order)
        self.row_of[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        self.slots = self.row_of[members]
        self.token_cluster = assignments[self.order]
        self._assignments = assignments
        self._weight = weight
        self.rows = weight.index_select(0, self.order)
        self._next_check = 0

    @property
    def nbytes(self) -> int:
        index_bytes = sum(
            t.numel() * t.element_size() for t in (self.order, self.row_of, self.slots, self.token_cluster)
        )
        return self.rows.numel() * self.rows.element_size() + index_bytes

    def serves(self, weight: torch.Tensor, assignments: torch.Tensor) -> bool:
        """Whether this copy is the one a head over ``weight`` and ``assignments`` would make."""
        same_weight = (
            weight.data_ptr() == self._weight.data_ptr()
            and weight.shape == self._weight.shape
            and weight.stride() == self._weight.stride()
            and weight.dtype == self._weight.dtype
        )
        return (
            same_weight and assignments.shape == self._assignments.shape and torch.equal(assignments, self._assignments)
        )

    def refresh(self) -> None:
        """Compare one row of the copy with the head's (a different row each call); copy the head again when
        they differ: its weight was changed in place since the copy was made."""
        row = self._next_check
        self._next_check = (row + _CHECK_STRIDE) % self.rows.shape[0]
        bits = _BITS[self.rows.element_size()]
        if torch.equal(self.rows[row].view(bits), self._weight[self.order[row]].view(bits)):
            return
        logger.warning(
            "my_pkg: the LM head's weight changed in place; FlashHead copies its rows again (a CPU copy in cluster "
            "order, MY_PKG_FLASHHEAD_CLUSTER_ROWS)"
        )
        torch.index_select(self._weight, 0, self.order, out=self.rows)


# Copies alive in this process, by the weight they copy: a second head over the same weight shares its copy.
_COPIES: weakref.WeakValueDictionary[tuple, ClusterRows] = weakref.WeakValueDictionary()


def cluster_rows_for(weight: torch.Tensor, assignments: torch.Tensor, members: torch.Tensor) -> ClusterRows:
    """The :class:`ClusterRows` of ``weight`` and ``assignments``: the one another head made, else a new one."""
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, assignments.numel())
    shared = _COPIES.get(key)
    if shared is not None and shared.serves(weight, assignments):
        return shared
    made = ClusterRows(weight, assignments, members)
    _COPIES[key] = made
    return made
