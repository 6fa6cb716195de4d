"""The FlashHead two-stage LM head.

Stage 1 scores the ``C`` cluster centroids (``hidden @ centroids.T``) and keeps ``P``
probes; stage 2 computes the exact logits of the ``P * cluster_size`` member rows of the
probed clusters, reading them from the original head weight through the cluster map
(no permuted copy of the head is made).

:meth:`FlashHead.step_logits` builds what serving hands to the sampler for one decode step:

* greedy rows: exact logits of the top ``n_probes`` clusters' members, ``-inf`` elsewhere, so
  the argmax is :meth:`FlashHead.greedy`'s pick;
* sampled rows: exact logits of the top ``sampled_n_probes`` clusters' members, and every other
  token an *estimated* logit from a rank-``r`` approximation of the head
  (:mod:`~my_pkg.flashhead.tail_estimate`).  The
  sampler then sees an approximate full distribution: an unprobed cluster keeps about its share
  of the probability mass instead of losing it, and the sampler's own temperature, top-k/top-p
  and min-p apply to the whole row.  Nothing is random, so a seeded request reproduces;
* both: the ``pinned`` ids (EOS, special and stop tokens) are scored exactly on every row.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from .kernels import torch_ref
from .kernels import triton_available
from .staging import index_tensor
from .tail_estimate import TailTables, build_tail_tables, default_tail_rank

__all__ = ["FlashHead", "build_members", "default_sampled_n_probes"]


def default_sampled_n_probes(n_probes: int, num_clusters: int) -> int:
    """Clusters a sampled row probes when not set: ``ceil(C / 16)`` (its exact candidates then cover
    1/16 of the vocabulary, as much as stage 1 costs), and never fewer than the greedy rows' ``n_probes``."""
    return max(1, min(num_clusters, max(n_probes, math.ceil(num_clusters / 16))))


def build_members(assignments: torch.Tensor, num_clusters: int | None = None, *,
                  allow_empty: bool = False) -> torch.Tensor:
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


class FlashHead:
    """Two-stage (clustered) LM head over an existing head weight.

    Args:
        weight: ``[V', H]`` head weight; may have more rows than the vocabulary (padding).
            Only a reference is kept.
        centroids: ``[C, H]`` stage-1 scoring vectors (stored in the weight's dtype and device).
        assignments: ``[V]`` cluster id of each vocabulary row.
        vocab_size: vocabulary size ``V`` (default: ``len(assignments)``); ``V <= V'``.
        n_probes: clusters scored exactly per step, ``1..C``.
        sampled_n_probes: clusters scored exactly for a sampled row in :meth:`step_logits`
            (``1..C``; default :func:`default_sampled_n_probes` of ``n_probes``, following it).
        sampled_rank: rank of the head approximation that estimates a sampled row's unprobed
            logits (``0..H``, 0: ``-inf`` instead; default
            :func:`~my_pkg.flashhead.tail_estimate.default_tail_rank` of the hidden size).  Its
            tables are built on the first sampled row (a randomized SVD of the head, once).
        backend: ``"auto"`` (Triton for CUDA tensors when importable, else torch),
            ``"torch"`` or ``"triton"``.
        allow_empty_clusters: accept clusters without a member (a head over one vocabulary shard
            of a tensor-parallel model, with the global centroids and the shard's assignments).

    Ties in :meth:`greedy` go to the smallest token id (as ``torch.argmax`` over the dense
    logits does).  All methods accept any batch ``B >= 1`` and do no host synchronisation.
    """

    def __init__(self, weight: torch.Tensor, centroids: torch.Tensor, assignments: torch.Tensor, *,
                 vocab_size: int | None = None, n_probes: int, backend: str = "auto",
                 dense_batch_threshold: int | None = None, sampled_n_probes: int | None = None,
                 sampled_rank: int | None = None, allow_empty_clusters: bool = False) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        if centroids.dim() != 2 or centroids.shape[1] != weight.shape[1]:
            raise ValueError(f"centroids must be [C, {weight.shape[1]}], got {tuple(centroids.shape)}")
        if assignments.dim() != 1:
            raise ValueError("assignments must be 1-D")
        v = assignments.numel() if vocab_size is None else int(vocab_size)
        if assignments.numel() != v:
            raise ValueError(f"assignments has {assignments.numel()} entries, vocab_size is {v}")
        if v > weight.shape[0]:
            raise ValueError(f"vocab_size {v} exceeds the head's {weight.shape[0]} rows")
        c = centroids.shape[0]
        members = build_members(assignments, c, allow_empty=allow_empty_clusters)
        self.weight = weight
        self.centroids = centroids.detach().to(weight.device, weight.dtype).contiguous()
        self.members = members.to(weight.device)
        self.num_clusters = c
        self.cluster_size = members.shape[1]
        self.vocab_size = v
        self.hidden_size = weight.shape[1]
        self.backend = self._resolve_backend(backend, weight)
        self._n_probes = 1
        self.n_probes = n_probes
        self._sampled_n_probes: int | None = None
        self.sampled_n_probes = sampled_n_probes
        self._tail: TailTables | None = None
        self._sampled_rank = default_tail_rank(self.hidden_size)
        if sampled_rank is not None:
            self.sampled_rank = sampled_rank
        self.dense_batch_threshold = dense_batch_threshold

    @staticmethod
    def _resolve_backend(backend: str, weight: torch.Tensor) -> str:
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if backend == "auto":
            return "triton" if weight.is_cuda and triton_available() else "torch"
        if backend == "triton" and not triton_available():
            raise ValueError("backend 'triton' requested but triton cannot be imported")
        return backend

    def _kernels(self):
        if self.backend == "triton":
            from .kernels import triton_kernels

            return triton_kernels
        return torch_ref

    # -- properties -----------------------------------------------------------------
    @property
    def n_probes(self) -> int:
        return self._n_probes

    @n_probes.setter
    def n_probes(self, value: int) -> None:
        value = self._check_probes(value)
        self._n_probes = value

    @property
    def sampled_n_probes(self) -> int:
        """Clusters scored exactly for a sampled row (see :meth:`step_logits`)."""
        if self._sampled_n_probes is None:
            return default_sampled_n_probes(self._n_probes, self.num_clusters)
        return self._sampled_n_probes

    @sampled_n_probes.setter
    def sampled_n_probes(self, value: int | None) -> None:
        """An int in ``1..C``, or None to follow ``n_probes`` (:func:`default_sampled_n_probes`)."""
        self._sampled_n_probes = None if value is None else self._check_probes(value, "sampled_n_probes")

    @property
    def sampled_rank(self) -> int:
        """Rank of the head approximation behind a sampled row's estimated logits (0: ``-inf`` instead)."""
        return self._sampled_rank

    @sampled_rank.setter
    def sampled_rank(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= self.hidden_size:
            raise ValueError(f"sampled_rank must be an int in [0, {self.hidden_size}], got {value!r}")
        if value != self._sampled_rank:
            self._tail = None
        self._sampled_rank = value

    def _tail_tables(self) -> TailTables:
        if self._tail is None:
            self._tail = build_tail_tables(self.weight, self.vocab_size, min(self._sampled_rank, self.vocab_size))
        return self._tail

    def _check_probes(self, value, name: str = "n_probes") -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.num_clusters:
            raise ValueError(f"{name} must be an int in [1, {self.num_clusters}], got {value!r}")
        return value

    @property
    def dense_batch_threshold(self) -> int | None:
        """Batches larger than this are served by the dense head (None: never).

        Above the crossover measured by ``bench/head.py`` the dense matmul is faster."""
        return self._dense_batch_threshold

    @dense_batch_threshold.setter
    def dense_batch_threshold(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"dense_batch_threshold must be None or an int >= 0, got {value!r}")
        self._dense_batch_threshold = value

    def _use_dense(self, hidden: torch.Tensor) -> bool:
        return self._dense_batch_threshold is not None and hidden.shape[0] > self._dense_batch_threshold

    @property
    def extra_memory_bytes(self) -> int:
        """Bytes held beyond the shared head weight (centroids + cluster map, and once a sampled
        row has been served the estimate's tables: ``r`` values per token)."""
        return (self.centroids.numel() * self.centroids.element_size()
                + self.members.numel() * self.members.element_size()
                + (self._tail.nbytes if self._tail is not None else 0))

    @property
    def scored_rows(self) -> int:
        """Rows scored per step at the current ``n_probes`` (centroids + candidates)."""
        return self.num_clusters + self._n_probes * self.cluster_size

    # -- API ------------------------------------------------------------------------
    def _check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [B, {self.hidden_size}], got {tuple(hidden.shape)}")
        return hidden

    def select_probes(self, hidden: torch.Tensor, *, n_probes: int | None = None) -> torch.Tensor:
        """``[B, P]`` cluster ids: the top-P centroid scores of each row (``P`` default ``n_probes``)."""
        hidden = self._check_hidden(hidden)
        p = self._n_probes if n_probes is None else self._check_probes(n_probes)
        scores = torch_ref.stage1_scores(hidden, self.centroids)
        return torch_ref.select_probes(scores, p)

    def candidate_logits(self, hidden: torch.Tensor, probes: torch.Tensor | None = None,
                         **select_kw) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids [B, P*cap] int64, logits [B, P*cap])``: exact logits of every candidate."""
        hidden = self._check_hidden(hidden)
        if probes is None:
            probes = self.select_probes(hidden, **select_kw)
        return self._kernels().candidate_logits(hidden, self.weight, self.members, probes)

    def greedy(self, hidden: torch.Tensor, probes: torch.Tensor | None = None) -> torch.Tensor:
        """``[B]`` int64 argmax token over the candidates (ties: smallest token id)."""
        hidden = self._check_hidden(hidden)
        if probes is None and self._use_dense(hidden):
            return self.dense_logits(hidden).argmax(dim=1)
        if probes is None:
            probes = self.select_probes(hidden)
        return self._kernels().greedy(hidden, self.weight, self.members, probes)

    def sparse_logits(self, hidden: torch.Tensor, probes: torch.Tensor | None = None, **select_kw) -> torch.Tensor:
        """``[B, vocab_size]``: exact logits on the candidates, ``-inf`` elsewhere
        (dense logits for a batch above ``dense_batch_threshold``)."""
        if probes is None and self._use_dense(self._check_hidden(hidden)):
            return self.dense_logits(hidden)
        ids, logits = self.candidate_logits(hidden, probes, **select_kw)
        out = torch.full((ids.shape[0], self.vocab_size), float("-inf"), dtype=logits.dtype, device=logits.device)
        return out.scatter_(1, ids, logits)

    def step_logits(self, hidden: torch.Tensor, *, sampled: torch.Tensor | np.ndarray | None = None,
                    pinned: torch.Tensor | None = None,
                    postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``[B, vocab_size]`` logits of one decode step, as serving hands them to the sampler.

        Args:
            hidden: ``[B, H]`` final hidden states.
            sampled: ``[B]`` bool on the host (a CPU tensor or numpy array): rows that sample.
                Greedy rows (False, or ``sampled=None``) get the exact logits of the members of
                the top ``n_probes`` clusters and ``-inf`` elsewhere.  Sampled rows get the exact
                logits of the members of the top ``sampled_n_probes`` clusters, and every other
                token the estimated logit of the rank-``sampled_rank`` approximation of the head
                (:mod:`~my_pkg.flashhead.tail_estimate`; ``-inf`` at rank 0).
            pinned: int64 token ids on the head's device, scored exactly on every row.
            postprocess: the model's logit scale / soft-cap, applied to every finite value
                (candidates, estimates, pinned), never to ``-inf``.

        Deterministic (same rows, same logits) and without host synchronisation, except on the
        first sampled row, which builds the estimate's tables once.
        """
        hidden = self._check_hidden(hidden)
        num_rows = hidden.shape[0]
        post = postprocess if postprocess is not None else _identity
        scores = torch_ref.stage1_scores(hidden, self.centroids)
        mask = _host_mask(sampled, num_rows)
        if mask is None or not mask.any() or mask.all():
            logits = self._rows_logits(hidden, scores, mask is not None and bool(mask.any()), post)
        else:
            logits = torch.empty((num_rows, self.vocab_size), dtype=self.weight.dtype, device=hidden.device)
            for rows_sampled in (False, True):
                index = index_tensor(np.flatnonzero(mask == rows_sampled), hidden.device)
                part = self._rows_logits(hidden.index_select(0, index), scores.index_select(0, index),
                                         rows_sampled, post)
                logits.index_copy_(0, index, part)
        if pinned is not None and pinned.numel():
            pinned_weight = self.weight.index_select(0, pinned)
            logits[:, pinned] = post(torch.nn.functional.linear(hidden.to(self.weight.dtype), pinned_weight)).to(
                logits.dtype)
        return logits

    def _rows_logits(self, hidden: torch.Tensor, scores: torch.Tensor, sampled: bool,
                     post: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Step logits of rows that are all greedy or all sampled (before pinned ids)."""
        probes = torch_ref.select_probes(scores, self.sampled_n_probes if sampled else self._n_probes)
        ids, exact = self._kernels().candidate_logits(hidden, self.weight, self.members, probes)
        exact = post(exact)
        if sampled and self._sampled_rank:
            out = post(self._tail_tables().estimates(hidden)).to(exact.dtype)
        else:
            out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), dtype=exact.dtype,
                             device=hidden.device)
        return out.scatter_(1, ids, exact)

    def scored_rows_per_step(self, *, sampled: bool, pinned: int = 0) -> int:
        """Head rows scored per row of :meth:`step_logits`: centroids + candidates + ``pinned`` ids;
        a sampled row also pays the estimate's ``r * (H + V)`` multiply-adds, counted in rows of ``H``."""
        if not sampled:
            return self.num_clusters + self._n_probes * self.cluster_size + pinned
        estimate = math.ceil(self._sampled_rank * (self.hidden_size + self.vocab_size) / self.hidden_size)
        return self.num_clusters + self.sampled_n_probes * self.cluster_size + pinned + estimate

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, vocab_size]`` reference logits of the full head."""
        hidden = self._check_hidden(hidden)
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight[: self.vocab_size])

    def __repr__(self) -> str:
        return (f"FlashHead(vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
                f"num_clusters={self.num_clusters}, cluster_size={self.cluster_size}, "
                f"n_probes={self.n_probes}, backend={self.backend!r})")


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _host_mask(sampled: torch.Tensor | np.ndarray | None, num_rows: int) -> np.ndarray | None:
    """``sampled`` as a numpy bool array of ``num_rows`` (a device tensor is copied to the host)."""
    if sampled is None:
        return None
    mask = sampled.detach().cpu().numpy() if isinstance(sampled, torch.Tensor) else np.asarray(sampled)
    mask = mask.astype(bool, copy=False).reshape(-1)
    if mask.shape[0] != num_rows:
        raise ValueError(f"sampled has {mask.shape[0]} entries for {num_rows} rows")
    return mask
