"""Estimated logits for the tokens a sampled row does not score exactly.

A sampled row of :meth:`~my_pkg.flashhead.head.FlashHead.step_logits` scores the members of its
probed clusters exactly; every other token ``v`` gets the logit of a rank-``r`` approximation of
the head:

    estimate_v = (h @ L) @ (R.T @ w_v)

with two ``[H, r]`` factors ``L`` and ``R`` (:class:`TailFactors`).  The sampler then sees an
approximate full distribution: the unprobed tokens keep about their share of the probability mass
instead of getting ``-inf``.  Per row this costs ``r * (H + V)`` multiply-adds (``r / H`` of a dense
head) and reads a ``[V, r]`` table (``W @ R``, :class:`TailTables`).

Two fits, both deterministic (seeded randomized SVD computed in row chunks, no copy of the head):

* **weight-only** (no hidden states): ``L = R = B``, the top ``r`` right singular vectors of the head
  ``W[:V]``; the best rank-``r`` approximation of the logits when every direction of ``h`` is equally
  likely.
* **data-aware** (:func:`fit_tail_factors` with ``states``): decode states are far from isotropic, so
  the rank is spent where they lie.  With ``S = Σ^{1/2}`` for the states' second moment
  ``Σ = E[h hᵀ]`` (eigenvalues floored at ``_EIGEN_FLOOR`` of the largest), ``U`` the top ``r`` right
  singular vectors of ``W S``: ``L = S⁻¹ U``, ``R = S U``.  This minimises the expected squared logit
  error ``E_h ||h (I - L Rᵀ) Wᵀ||²`` over those states; the builder fits it on the calibration states
  (the model's own samples by default) and writes it with the assets.

The estimate depends on the head and (data-aware) on the calibration states, not on the clusters or
the stage-1 vectors, so it composes with any stage 1.  Measured on a trained LM it beat using the
stage-1 score as each cluster's logit, with or without a per-token correction, the cluster mean row
plus a low-rank correction, and estimating only the members of the clusters next to the probed ones;
the data-aware fit halves the total-variation distance of the weight-only one at the same rank on
text the calibration never saw (docs/research/sampling.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import hidden_major, linear

__all__ = [
    "TailFactors",
    "TailTables",
    "top_k_ids",
    "build_tail_tables",
    "fit_tail_factors",
    "default_tail_rank",
    "MAX_DEFAULT_TAIL_RANK",
]

#: The default rank is ``hidden_size / 8`` (the tail then costs 1/8 of a dense head), at most this.
MAX_DEFAULT_TAIL_RANK = 64

_CHUNK_ROWS = 16384
_OVERSAMPLE = 8
_POWER_ITERATIONS = 2
# Eigenvalues of the states' second moment below this fraction of the largest are raised to it: a
# direction the states never take must not blow up ``S⁻¹``.
_EIGEN_FLOOR = 1e-3
# Tokens per block when choosing the best-estimated ones (:func:`top_k_ids`): 4 was fastest on CPU
# at 128,256 tokens (2, 8 and 16 within 25 %).
_SELECT_BLOCK = 4


def default_tail_rank(hidden_size: int) -> int:
    """``ceil(hidden_size / 8)``, at most :data:`MAX_DEFAULT_TAIL_RANK` (64 from a hidden size of 512: 1/32 of
    a 2,048-wide head's multiply-adds)."""
    return min(MAX_DEFAULT_TAIL_RANK, math.ceil(hidden_size / 8))


@dataclass(frozen=True)
class TailFactors:
    """``left``, ``right``: ``[H, r]`` float32, columns ordered by importance (the first ``k`` columns of
    both are the rank-``k`` fit)."""

    left: torch.Tensor
    right: torch.Tensor

    def __post_init__(self) -> None:
        if self.left.dim() != 2 or self.left.shape != self.right.shape:
            raise ValueError(
                f"tail factors must be two [H, r] tensors, got {tuple(self.left.shape)} and {tuple(self.right.shape)}"
            )

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    def truncated(self, rank: int) -> TailFactors:
        """The rank-``rank`` fit (``1 <= rank <= self.rank``)."""
        if not 1 <= rank <= self.rank:
            raise ValueError(f"rank must lie in [1, {self.rank}], got {rank}")
        return TailFactors(self.left[:, :rank].contiguous(), self.right[:, :rank].contiguous())


@dataclass
class TailTables:
    """``basis`` ``[H, r]`` (the left factor) and ``projected`` ``[V, r]`` ``= W[:V] @ right``, in the head's
    device and dtype; ``projected`` is multiplied whole by every sampled step, and stored as stage 1's centroids
    are (hidden-major on CPU in float32, :mod:`~my_pkg.flashhead.layout`)."""

    basis: torch.Tensor
    projected: torch.Tensor

    @classmethod
    def from_factors(cls, weight: torch.Tensor, vocab_size: int, factors: TailFactors) -> TailTables:
        """The tables of ``factors`` for the head ``weight[:vocab_size]`` (a vocabulary shard works too)."""
        head = weight[:vocab_size]
        if factors.left.shape[0] != head.shape[1]:
            raise ValueError(f"tail factors have hidden size {factors.left.shape[0]}, the head {head.shape[1]}")
        right = factors.right.to(head.device, torch.float32)
        projected = torch.cat([head[s:e].float() @ right for s, e in _row_chunks(head.shape[0])])
        basis = factors.left.to(head.device, weight.dtype)
        return cls(basis.contiguous(), hidden_major(projected.to(weight.dtype)))

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.basis, self.projected))

    def estimates(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` estimated logits of every token for ``hidden`` ``[B, H]``."""
        return linear(hidden.to(self.basis.dtype) @ self.basis, self.projected)


def top_k_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, k]`` column ids (unordered) of the ``k`` largest ``values`` ``[B, N]`` of each row, ``k <= N``:
    the values ``torch.topk`` gives (on equal values either id).

    Blocks of ``_SELECT_BLOCK`` columns first: a column among the ``k`` best lies in one of the ``k`` blocks
    with the best maxima (or in the last, partial block, always kept), so the exact top-``k`` runs over
    about ``k * _SELECT_BLOCK`` values instead of ``N`` (about half of one ``topk`` over a vocabulary on CPU)."""
    rows, width = values.shape
    blocks = width // _SELECT_BLOCK
    # Max pooling is the blocks' maxima (about 40 % faster than ``amax`` over a ``[B, N / 4, 4]`` view on CPU).
    block_max = torch.nn.functional.max_pool1d(values[:, : blocks * _SELECT_BLOCK].unsqueeze(1), _SELECT_BLOCK)[:, 0]
    best_blocks = block_max.topk(min(k, blocks), dim=1, sorted=False).indices
    offsets = torch.arange(_SELECT_BLOCK, device=values.device)
    ids = (best_blocks.unsqueeze(2) * _SELECT_BLOCK + offsets).view(rows, -1)
    if blocks * _SELECT_BLOCK < width:
        rest = torch.arange(blocks * _SELECT_BLOCK, width, device=values.device)
        ids = torch.cat([ids, rest.expand(rows, -1)], dim=1)
    return ids.gather(1, values.gather(1, ids).topk(k, dim=1, sorted=False).indices)


def _row_chunks(vocab_size: int) -> list[tuple[int, int]]:
    return [(s, min(vocab_size, s + _CHUNK_ROWS)) for s in range(0, vocab_size, _CHUNK_ROWS)]


def _top_right_singular_vectors(
    weight: torch.Tensor, rank: int, seed: int, transform: torch.Tensor | None = None
) -> torch.Tensor:
    """``[H, rank]`` float32: randomized SVD (range finder with power iterations) of ``A = weight @ transform``
    (``transform`` ``[H, H]``, identity when None), by row chunks of ``weight``; ``A`` is never formed (the
    transform multiplies the ``[H, k]`` sides), so the data-aware fit costs what the weight-only one does."""
    vocab, hidden = weight.shape
    k = min(hidden, vocab, rank + _OVERSAMPLE)
    chunks = _row_chunks(vocab)
    # Explicit float32: vLLM loads (and may build the head) with its model dtype as torch's default.
    test = torch.randn(hidden, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(weight.device)

    def times(right: torch.Tensor) -> torch.Tensor:  # A @ right = W @ (T @ right): [V, k]
        right = right if transform is None else transform @ right
        return torch.cat([weight[s:e].float() @ right for s, e in chunks])

    def transposed_times(left: torch.Tensor) -> torch.Tensor:  # A.T @ left = T.T @ (W.T @ left): [H, k]
        out = torch.zeros(hidden, left.shape[1], dtype=torch.float32, device=weight.device)
        for s, e in chunks:
            out.addmm_(weight[s:e].float().t(), left[s:e])
        return out if transform is None else transform.t() @ out

    q = torch.linalg.qr(times(test)).Q
    for _ in range(_POWER_ITERATIONS):
        q = torch.linalg.qr(times(torch.linalg.qr(transposed_times(q)).Q)).Q
    small = transposed_times(q).t()  # [k, H] = Q.T @ A
    return torch.linalg.svd(small, full_matrices=False).Vh[:rank].t().contiguous()


def _whitening(states: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, S⁻¹)`` ``[H, H]`` float32 for ``S = Σ^{1/2}`` of the states' second moment (floored eigenvalues)."""
    h = states.to(device, torch.float64)
    second_moment = h.t() @ h / h.shape[0]
    values, vectors = torch.linalg.eigh(second_moment)
    values = values.clamp(min=_EIGEN_FLOOR * float(values.max().clamp(min=torch.finfo(torch.float64).tiny)))
    root = values.sqrt()
    return (vectors * root) @ vectors.t(), (vectors / root) @ vectors.t()


def fit_tail_factors(
    weight: torch.Tensor, vocab_size: int, rank: int, states: torch.Tensor | None = None, *, seed: int = 0
) -> TailFactors:
    """The rank-``rank`` factors of the estimate for the head ``weight[:vocab_size]``: weight-only, or fitted to
    ``states`` ``[N, H]`` (decode hidden states, e.g. the calibration states) when given.  Runs on the
    weight's device; returns float32 factors on it."""
    head = weight[:vocab_size]
    if not 1 <= rank <= min(head.shape):
        raise ValueError(f"rank must lie in [1, {min(head.shape)}], got {rank}")
    if states is None:
        basis = _top_right_singular_vectors(head, rank, seed)
        return TailFactors(basis, basis)
    if states.dim() != 2 or states.shape[1] != head.shape[1] or states.shape[0] == 0:
        raise ValueError(f"states must be [N, {head.shape[1]}] with N >= 1, got {tuple(states.shape)}")
    if not bool(torch.isfinite(states).all()):
        raise ValueError("states contain non-finite values")
    root, inverse_root = _whitening(states, head.device)
    top = _top_right_singular_vectors(head, rank, seed, transform=root.float()).double()
    return TailFactors((inverse_root @ top).float().contiguous(), (root @ top).float().contiguous())


def build_tail_tables(weight: torch.Tensor, vocab_size: int, rank: int, *, seed: int = 0) -> TailTables:
    """The tables of the weight-only rank-``rank`` approximation of ``weight[:vocab_size]`` (``1 <= rank <= H``)."""
    return TailTables.from_factors(weight, vocab_size, fit_tail_factors(weight, vocab_size, rank, seed=seed))
