"""The FlashHead two-stage LM head.

Stage 1 scores the ``C`` cluster centroids (``hidden @ centroids.T``) and keeps ``P``
probes; stage 2 computes the exact logits of the ``P * cluster_size`` member rows of the
probed clusters, reading them from the original head weight through the cluster map
(no permuted copy of the head is made).
"""

from __future__ import annotations

import torch

from .kernels import torch_ref
from .kernels import triton_available

__all__ = ["FlashHead", "build_members"]


def build_members(assignments: torch.Tensor, num_clusters: int | None = None) -> torch.Tensor:
    """Cluster map ``[C, cap]`` int64 of token ids from per-token cluster ids.

    ``cap`` is the largest cluster size.  Shorter clusters are padded by repeating their
    first member, so scoring the padded slots only duplicates an exact logit.  Raises
    ``ValueError`` for an empty cluster or ids out of range.
    """
    a = assignments.detach().to("cpu", torch.int64).flatten()
    if a.numel() == 0:
        raise ValueError("assignments is empty")
    c = int(a.max()) + 1 if num_clusters is None else num_clusters
    if int(a.min()) < 0 or int(a.max()) >= c:
        raise ValueError(f"cluster ids must lie in [0, {c})")
    counts = torch.bincount(a, minlength=c)
    if int(counts.min()) == 0:
        raise ValueError("every cluster needs at least one member")
    cap = int(counts.max())
    order = torch.argsort(a, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(cap).view(1, cap)
    pos = starts.view(-1, 1) + torch.minimum(slot, (counts - 1).view(-1, 1))
    pos = torch.where(slot < counts.view(-1, 1), pos, starts.view(-1, 1))
    return order[pos]


class FlashHead:
    """Two-stage (clustered) LM head over an existing head weight.

    Args:
        weight: ``[V', H]`` head weight; may have more rows than the vocabulary (padding).
            Only a reference is kept.
        centroids: ``[C, H]`` stage-1 scoring vectors (stored in the weight's dtype and device).
        assignments: ``[V]`` cluster id of each vocabulary row.
        vocab_size: vocabulary size ``V`` (default: ``len(assignments)``); ``V <= V'``.
        n_probes: clusters scored exactly per step, ``1..C``.
        backend: ``"auto"`` (Triton for CUDA tensors when importable, else torch),
            ``"torch"`` or ``"triton"``.

    Ties in :meth:`greedy` go to the smallest token id (as ``torch.argmax`` over the dense
    logits does).  All methods accept any batch ``B >= 1`` and do no host synchronisation.
    """

    def __init__(self, weight: torch.Tensor, centroids: torch.Tensor, assignments: torch.Tensor, *,
                 vocab_size: int | None = None, n_probes: int, backend: str = "auto",
                 dense_batch_threshold: int | None = None) -> None:
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
        members = build_members(assignments, c)
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

    def _check_probes(self, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.num_clusters:
            raise ValueError(f"n_probes must be an int in [1, {self.num_clusters}], got {value!r}")
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
        """Bytes held beyond the shared head weight (centroids + cluster map)."""
        return (self.centroids.numel() * self.centroids.element_size()
                + self.members.numel() * self.members.element_size())

    @property
    def scored_rows(self) -> int:
        """Rows scored per step at the current ``n_probes`` (centroids + candidates)."""
        return self.num_clusters + self._n_probes * self.cluster_size

    # -- API ------------------------------------------------------------------------
    def _check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [B, {self.hidden_size}], got {tuple(hidden.shape)}")
        return hidden

    def select_probes(self, hidden: torch.Tensor, *, n_probes: int | None = None,
                      sample_rows: torch.Tensor | None = None, temperature: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        """``[B, P]`` cluster ids: top-P centroid scores, or for rows where ``sample_rows`` is
        True, P clusters drawn without replacement with probability ``softmax(score / temperature)``."""
        hidden = self._check_hidden(hidden)
        p = self._n_probes if n_probes is None else self._check_probes(n_probes)
        scores = torch_ref.stage1_scores(hidden, self.centroids)
        return torch_ref.select_probes(scores, p, sample_rows=sample_rows, temperature=temperature,
                                       generator=generator)

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

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, vocab_size]`` reference logits of the full head."""
        hidden = self._check_hidden(hidden)
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight[: self.vocab_size])

    def __repr__(self) -> str:
        return (f"FlashHead(vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
                f"num_clusters={self.num_clusters}, cluster_size={self.cluster_size}, "
                f"n_probes={self.n_probes}, backend={self.backend!r})")
