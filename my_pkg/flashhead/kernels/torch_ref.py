"""Pure-torch FlashHead kernels (CPU path and reference implementation).

Stage 2 on CPU uses ``torch.sparse.sampled_addmm``: the candidate token ids form the
column pattern of a CSR matrix ``[B, V']`` and the op evaluates ``hidden[b] . weight[v]``
only at those positions, reading each candidate row once without materialising a
gathered copy (a fresh ``index_select`` copy of thousands of rows is several times slower
on CPU).  On other devices (or dtypes the sparse op lacks) rows are gathered with
``index_select`` and reduced with ``bmm``.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["stage1_scores", "select_probes", "candidate_ids", "candidate_logits", "greedy",
           "greedy_from_candidates"]

_SPARSE_OK: dict[torch.dtype, bool] = {}


def stage1_scores(hidden: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` centroid scores ``hidden @ centroids.T`` (in the centroids' dtype)."""
    return torch.nn.functional.linear(hidden.to(centroids.dtype), centroids)


def select_probes(scores: torch.Tensor, n_probes: int, *, sample_rows: torch.Tensor | None = None,
                  temperature: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Top-``n_probes`` clusters per row; rows flagged in ``sample_rows`` instead draw
    ``n_probes`` clusters without replacement with probabilities ``softmax(scores / temperature)``
    (Gumbel-top-k), fully on device and without host synchronisation."""
    if sample_rows is None:
        return torch.topk(scores, n_probes, dim=-1, sorted=False).indices
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    s = scores.float()
    u = torch.rand(s.shape, generator=generator, device=s.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))
    perturbed = torch.where(sample_rows.to(s.device).view(-1, 1), s / temperature + gumbel, s)
    return torch.topk(perturbed, n_probes, dim=-1, sorted=False).indices


def candidate_ids(members: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """``[B, P*cap]`` token ids of the probed clusters."""
    return members[probes].reshape(probes.shape[0], -1)


def _sparse_supported(dtype: torch.dtype) -> bool:
    ok = _SPARSE_OK.get(dtype)
    if ok is None:
        try:
            w = torch.randn(8, 4).to(dtype)
            h = torch.randn(1, 4).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a = torch.sparse_csr_tensor(torch.tensor([0, 2]), torch.tensor([5, 1]), torch.zeros(2, dtype=dtype),
                                            size=(1, 8), check_invariants=False)
                out = torch.sparse.sampled_addmm(a, h, w.t(), beta=0.0).values()
            ref = (w[[5, 1]].float() @ h[0].float())
            ok = bool(torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2))
        except Exception:
            ok = False
        _SPARSE_OK[dtype] = ok
    return ok


def _logits_sparse(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    b, n = ids.shape
    crow = torch.arange(0, (b + 1) * n, n, dtype=torch.int64, device=ids.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow, ids.reshape(-1), torch.zeros(b * n, dtype=weight.dtype,
                                          device=ids.device), size=(b, weight.shape[0]),
                                          check_invariants=False)
        out = torch.sparse.sampled_addmm(pattern, hidden, weight.t(), beta=0.0, alpha=1.0)
    return out.values().view(b, n)


def _logits_gather(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    b, n = ids.shape
    rows = weight.index_select(0, ids.reshape(-1)).view(b, n, -1)
    return torch.bmm(rows, hidden.unsqueeze(2)).squeeze(2)


def candidate_logits(hidden: torch.Tensor, weight: torch.Tensor, members: torch.Tensor,
                     probes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact logits of every candidate: ``(token_ids [B, P*cap], logits [B, P*cap])``."""
    hidden = hidden.to(weight.dtype)
    ids = candidate_ids(members, probes)
    # The CSR pattern allows at most ``V'`` entries per row (only hit when padding duplicates
    # push ``P*cap`` above the head's row count); fall back to gathering then.
    if hidden.device.type == "cpu" and ids.shape[1] <= weight.shape[0] and _sparse_supported(weight.dtype):
        return ids, _logits_sparse(hidden.contiguous(), weight, ids)
    return ids, _logits_gather(hidden, weight, ids)


def greedy_from_candidates(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Argmax token over candidates; ties go to the smallest token id."""
    best = logits.max(dim=1, keepdim=True).values
    big = torch.iinfo(torch.int64).max
    return torch.where(logits == best, ids, torch.full_like(ids, big)).min(dim=1).values


def greedy(hidden: torch.Tensor, weight: torch.Tensor, members: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 argmax token over the candidates (smallest id on ties)."""
    ids, logits = candidate_logits(hidden, weight, members, probes)
    return greedy_from_candidates(ids, logits)
