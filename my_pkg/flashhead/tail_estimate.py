"""Estimated logits for the tokens a sampled row does not score exactly.

A sampled row of :meth:`~my_pkg.flashhead.head.FlashHead.step_logits` scores the members of its
probed clusters exactly; every other token ``v`` gets the logit of the rank-``r`` approximation
of the head:

    estimate_v = (h @ B) @ (B.T @ w_v)

where ``B`` ``[H, r]`` holds the top ``r`` right singular vectors of the head ``W[:V]``.  The
sampler then sees an approximate full distribution: the unprobed tokens keep about their share
of the probability mass instead of getting ``-inf``.  Per row this costs ``r * (H + V)``
multiply-adds (``r / H`` of a dense head) and reads a ``[V, r]`` table.

The estimate depends on the head weight only, not on the clusters or the stage-1 vectors, so it
composes with any stage 1 (weight-only or calibrated).  Measured on a trained LM it beat using
the stage-1 score as each cluster's logit, with or without a per-token correction, and the
cluster mean row plus a low-rank correction, at the same cost (docs/flashhead.md).

``B`` comes from a seeded randomized SVD computed in row chunks (no copy of the head is made),
so it is deterministic for a head on a given device and thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TailTables", "build_tail_tables", "default_tail_rank", "MAX_DEFAULT_TAIL_RANK"]

#: The default rank is ``hidden_size / 8`` (the tail then costs 1/8 of a dense head), at most this.
MAX_DEFAULT_TAIL_RANK = 64

_CHUNK_ROWS = 16384
_OVERSAMPLE = 8
_POWER_ITERATIONS = 2


def default_tail_rank(hidden_size: int) -> int:
    """``ceil(hidden_size / 8)``, at most :data:`MAX_DEFAULT_TAIL_RANK` (64 from a hidden size of 512: 1/32 of
    a 2,048-wide head's multiply-adds)."""
    return min(MAX_DEFAULT_TAIL_RANK, math.ceil(hidden_size / 8))


@dataclass
class TailTables:
    """``basis`` ``[H, r]`` and ``projected`` ``[V, r]`` ``= W[:V] @ basis``, in the head's device and dtype."""

    basis: torch.Tensor
    projected: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.basis, self.projected))

    def estimates(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` estimated logits of every token for ``hidden`` ``[B, H]``."""
        return (hidden.to(self.basis.dtype) @ self.basis) @ self.projected.t()


def _row_chunks(vocab_size: int) -> list[tuple[int, int]]:
    return [(s, min(vocab_size, s + _CHUNK_ROWS)) for s in range(0, vocab_size, _CHUNK_ROWS)]


def _top_right_singular_vectors(weight: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """``[H, rank]`` float32: randomized SVD (range finder with power iterations) of ``weight``, by row chunks."""
    vocab, hidden = weight.shape
    k = min(hidden, vocab, rank + _OVERSAMPLE)
    chunks = _row_chunks(vocab)
    test = torch.randn(hidden, k, generator=torch.Generator().manual_seed(seed)).to(weight.device)

    def times(right: torch.Tensor) -> torch.Tensor:  # W @ right: [V, k]
        return torch.cat([weight[s:e].float() @ right for s, e in chunks])

    def transposed_times(left: torch.Tensor) -> torch.Tensor:  # W.T @ left: [H, k]
        out = torch.zeros(hidden, left.shape[1], device=weight.device)
        for s, e in chunks:
            out.addmm_(weight[s:e].float().t(), left[s:e])
        return out

    q = torch.linalg.qr(times(test)).Q
    for _ in range(_POWER_ITERATIONS):
        q = torch.linalg.qr(times(torch.linalg.qr(transposed_times(q)).Q)).Q
    small = transposed_times(q).t()  # [k, H] = Q.T @ W
    return torch.linalg.svd(small, full_matrices=False).Vh[:rank].t().contiguous()


def build_tail_tables(weight: torch.Tensor, vocab_size: int, rank: int, *, seed: int = 0) -> TailTables:
    """The tables of the rank-``rank`` approximation of ``weight[:vocab_size]`` (``1 <= rank <= H``)."""
    head = weight[:vocab_size]
    if not 1 <= rank <= min(head.shape):
        raise ValueError(f"rank must lie in [1, {min(head.shape)}], got {rank}")
    basis = _top_right_singular_vectors(head, rank, seed)
    projected = torch.cat([head[s:e].float() @ basis for s, e in _row_chunks(vocab_size)])
    return TailTables(basis.to(weight.dtype).contiguous(), projected.to(weight.dtype).contiguous())
