"""Stage 2's reads: exact logits of the probed clusters' members and of any token ids.

Contract: :class:`CandidateRows` scores a head's candidates through its kernel backend, from the head
weight itself or, on a CPU head, from its rows in cluster order (:mod:`~my_pkg.flashhead.cluster_rows`,
the same logits bit for bit); a CPU head without that copy scores a batch cluster by cluster through each
head row's cluster (``token_cluster``).  The head calls :meth:`CandidateRows.refresh` once per step, which
notices a weight changed in place.

Imports torch only.
"""

from __future__ import annotations

import torch

from .cluster_rows import ClusterRows, cluster_rows_for
from .kernels import KernelOps, torch_ref

__all__ = ["CandidateRows"]


class CandidateRows:
    """Where stage 2 reads a head's rows.

    Args:
        weight: ``[V', H]`` head weight (a reference is kept).
        assignments: ``[V]`` int64 cluster id of each token, on the weight's device.
        members: ``[C, cap]`` the cluster map, on the weight's device.
        kernels: the head's backend functions (:func:`~my_pkg.flashhead.kernels.load_ops`).
        copy: read the candidates from a copy of the rows in cluster order (CPU only).
    """

    def __init__(
        self, weight: torch.Tensor, assignments: torch.Tensor, members: torch.Tensor, *, kernels: KernelOps, copy: bool
    ) -> None:
        self.weight, self.members, self.kernels = weight, members, kernels
        #: The candidates' rows in cluster order (None: scored from ``weight`` itself).
        self.cluster_rows: ClusterRows | None = cluster_rows_for(weight, assignments, members) if copy else None
        #: Each head row's cluster (C: none, e.g. padding rows): lets a CPU batch be scored cluster by cluster.
        self.token_cluster: torch.Tensor | None = None
        if weight.device.type == "cpu" and self.cluster_rows is None:
            token_cluster = torch.full((weight.shape[0],), members.shape[0], dtype=torch.int64)
            token_cluster[: assignments.numel()] = assignments
            self.token_cluster = token_cluster

    @property
    def nbytes(self) -> int:
        """Bytes beyond the head weight: the rows in cluster order, or each row's cluster."""
        return (self.token_cluster.numel() * 8 if self.token_cluster is not None else 0) + (
            self.cluster_rows.nbytes if self.cluster_rows is not None else 0
        )

    def refresh(self) -> None:
        """Check the copy against the head (:meth:`~my_pkg.flashhead.cluster_rows.ClusterRows.refresh`)."""
        if self.cluster_rows is not None:
            self.cluster_rows.refresh()

    def candidate_logits(
        self, hidden: torch.Tensor, probes: torch.Tensor, extra_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's ``candidate_logits`` (token ids and their exact logits), the ``extra_ids`` after the
        candidates, from the rows in cluster order when there are any."""
        kernels, rows = self.kernels, self.cluster_rows
        if rows is None:
            return kernels.candidate_logits(
                hidden, self.weight, self.members, probes, token_cluster=self.token_cluster, extra_ids=extra_ids
            )
        _, logits = kernels.candidate_logits(
            hidden,
            rows.rows,
            rows.slots,
            probes,
            token_cluster=rows.token_cluster,
            extra_ids=None if extra_ids is None else rows.row_of[extra_ids],
        )
        ids = torch_ref.candidate_ids(self.members, probes)
        return (ids if extra_ids is None else torch.cat([ids, extra_ids], dim=1)), logits

    def token_logits(self, hidden: torch.Tensor, ids: torch.Tensor, *, has_candidates: bool = False) -> torch.Tensor:
        """``[B, N]`` exact logits of any token ids ``[B, N]``: from the rows in cluster order when ``ids`` hold
        probed clusters' members (``has_candidates``), else from the head itself, where a sampled row's
        best-estimated tokens lie closer together (blocks of neighbouring ids,
        :func:`~my_pkg.flashhead.tail_estimate.top_k_ids`)."""
        rows = self.cluster_rows
        if rows is None or not has_candidates:
            return self.kernels.token_logits(hidden, self.weight, ids)
        return self.kernels.token_logits(hidden, rows.rows, rows.row_of[ids])
