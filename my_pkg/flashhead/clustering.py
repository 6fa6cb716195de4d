"""Balanced spherical k-means over the rows of an LM head.

Every cluster receives exactly ``cluster_size`` vocabulary rows when the
vocabulary size ``V`` is a multiple of the size.  Otherwise ``C = ceil(V / size)``
clusters are made and their sizes differ by at most one (``floor(V / C)`` or
``ceil(V / C)``); :class:`~my_pkg.flashhead.head.FlashHead` pads the short clusters
in memory by repeating one of their own members, so scores stay exact.  Such
unequal assets are valid for this package but cannot be loaded by the public
FlashHead plugin, which requires equal cluster sizes.

Algorithm
---------
1. Rows are L2-normalised (spherical k-means: cosine similarity).
2. When the hidden size is large, the iterations run in a PCA subspace of
   ``pca_dim`` dimensions (cosine structure is mostly preserved and an iteration
   costs ``pca_dim / hidden`` of a full one); the last ``refine_iterations``
   assignment passes use the full dimensionality.
3. Each assignment pass keeps, per row, the ``candidates`` most similar
   centroids (similarities are computed in row chunks; the full ``V x C`` matrix
   is never materialised) and solves the capacity constraint with vectorised
   deferred acceptance (rows propose to their next best cluster, each cluster
   keeps its best proposals up to its capacity).  Rows left over are placed in
   clusters with free capacity, again by best similarity.
4. Centroids are the re-normalised means of their members.

The result is deterministic for a given seed, device and thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

__all__ = ["ClusteringResult", "balanced_kmeans", "cluster_capacities", "random_balanced_assignment", "score_centroids"]


@dataclass
class ClusteringResult:
    """Output of :func:`balanced_kmeans`.

    ``assignments``: ``[V]`` int64 cluster id per vocabulary row.
    ``centroids``: ``[C, H]`` float32 stage-1 scoring vectors (see :func:`score_centroids`).
    """

    assignments: torch.Tensor
    centroids: torch.Tensor
    num_clusters: int
    cluster_size: int


def cluster_capacities(vocab_size: int, cluster_size: int) -> torch.Tensor:
    """Capacity of each of the ``ceil(V / cluster_size)`` clusters (sizes differ by at most 1)."""
    if cluster_size < 1:
        raise ValueError("cluster_size must be >= 1")
    if vocab_size < 1:
        raise ValueError("vocab_size must be >= 1")
    n = math.ceil(vocab_size / cluster_size)
    base = vocab_size // n
    extra = vocab_size - base * n
    cap = torch.full((n,), base, dtype=torch.int64)
    cap[:extra] += 1
    return cap


def random_balanced_assignment(vocab_size: int, cluster_size: int, seed: int = 0) -> torch.Tensor:
    """A random assignment with balanced sizes (for timing-only runs)."""
    cap = cluster_capacities(vocab_size, cluster_size)
    ids = torch.repeat_interleave(torch.arange(cap.numel()), cap)
    g = torch.Generator().manual_seed(seed)
    return ids[torch.randperm(vocab_size, generator=g)]


def _rank_in_group(group: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order elements by (group asc, score desc); return (order, rank of each ordered element in its group)."""
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]
    g = group[order]
    n = g.numel()
    pos = torch.arange(n, device=g.device)
    is_start = torch.ones(n, dtype=torch.bool, device=g.device)
    if n > 1:
        is_start[1:] = g[1:] != g[:-1]
    start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), dim=0).values
    return order, pos - start


def _deferred_acceptance(cand_idx: torch.Tensor, cand_score: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Capacity-constrained assignment of rows to their candidate clusters.

    Rows propose to candidates in order of preference (``cand_idx`` sorted by descending score);
    every cluster keeps its best proposals up to ``capacity``.  Returns ``[N]`` cluster ids,
    ``-1`` for rows that every candidate rejected.
    """
    n, k = cand_idx.shape
    dev = cand_idx.device
    assign = torch.full((n,), -1, dtype=torch.int64, device=dev)
    held_score = torch.zeros(n, dtype=cand_score.dtype, device=dev)
    ptr = torch.zeros(n, dtype=torch.int64, device=dev)
    rows_all = torch.arange(n, device=dev)
    for _ in range(k):
        prop = rows_all[(assign < 0) & (ptr < k)]
        if prop.numel() == 0:
            break
        c = cand_idx[prop, ptr[prop]]
        s = cand_score[prop, ptr[prop]]
        ptr[prop] += 1
        held = rows_all[assign >= 0]
        rows = torch.cat([held, prop])
        grp = torch.cat([assign[held], c])
        sc = torch.cat([held_score[held], s])
        order, rank = _rank_in_group(grp, sc)
        keep = rank < capacity[grp[order]]
        r = rows[order]
        assign[r[~keep]] = -1
        assign[r[keep]] = grp[order][keep]
        held_score[r[keep]] = sc[order][keep]
    return assign


def _topk_chunked(
    x: torch.Tensor, cent: torch.Tensor, k: int, chunk: int, mask: torch.Tensor | None = None, desc: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k centroid similarity for every row of ``x``, computed in row chunks."""
    n = x.shape[0]
    k = min(k, cent.shape[0] if mask is None else int(mask.sum()))
    idx = torch.empty(n, k, dtype=torch.int64, device=x.device)
    val = torch.empty(n, k, dtype=torch.float32, device=x.device)
    it = range(0, n, chunk)
    if desc is not None:
        it = tqdm(it, desc=desc, leave=False, unit="chunk")
    for s in it:
        sims = x[s : s + chunk] @ cent.t()
        if mask is not None:
            sims.masked_fill_(~mask, float("-inf"))
        v, i = torch.topk(sims, k, dim=1)
        idx[s : s + chunk] = i
        val[s : s + chunk] = v.float()
    return idx, val


def _balanced_assign(
    x: torch.Tensor, cent: torch.Tensor, capacity: torch.Tensor, candidates: int, chunk: int, desc: str | None = None
) -> torch.Tensor:
    idx, val = _topk_chunked(x, cent, candidates, chunk, desc=desc)
    assign = _deferred_acceptance(idx, val, capacity)
    # Leftovers: rows whose candidates were all taken by better rows.
    while True:
        left = torch.nonzero(assign < 0).flatten()
        if left.numel() == 0:
            return assign
        used = torch.bincount(assign[assign >= 0], minlength=capacity.numel())
        free = capacity - used
        li, lv = _topk_chunked(x[left], cent, candidates, chunk, mask=free > 0)
        sub = _deferred_acceptance(li, lv, free)
        assign[left] = sub


def _normalized_means(x: torch.Tensor, assign: torch.Tensor, c: int) -> torch.Tensor:
    sums = torch.zeros(c, x.shape[1], dtype=torch.float32, device=x.device)
    sums.index_add_(0, assign, x.float())
    return torch.nn.functional.normalize(sums, dim=1)


def score_centroids(
    weight: torch.Tensor, assignments: torch.Tensor, num_clusters: int, chunk: int = 16384
) -> torch.Tensor:
    """Norm-aware stage-1 scoring vectors.

    Each centroid is the spherical (unit) mean direction of its members scaled by the
    members' mean row norm, so ``hidden @ centroid`` approximates the typical logit of the
    cluster: clusters of large-norm rows (which win the argmax more often) score higher
    than a unit-norm centroid would let them.  On structured synthetic heads this predicted
    the best cluster slightly better than either the plain spherical centroid or the raw
    mean of the rows.
    """
    dev = assignments.device
    sums = torch.zeros(num_clusters, weight.shape[1], dtype=torch.float32, device=dev)
    norm_sum = torch.zeros(num_clusters, dtype=torch.float32, device=dev)
    for s in range(0, weight.shape[0], chunk):
        w = weight[s : s + chunk].to(dev, torch.float32)
        n = w.norm(dim=1)
        a = assignments[s : s + chunk]
        sums.index_add_(0, a, w / n.clamp_min(1e-12)[:, None])
        norm_sum.index_add_(0, a, n)
    counts = torch.bincount(assignments, minlength=num_clusters).clamp_min(1).to(torch.float32)
    return torch.nn.functional.normalize(sums, dim=1) * (norm_sum / counts)[:, None]


def _pca_basis(x: torch.Tensor, dim: int, gen: torch.Generator, sample: int = 32768) -> torch.Tensor:
    n = x.shape[0]
    sel = torch.randperm(n, generator=gen)[: min(n, sample)].to(x.device)
    xs = x[sel]
    xs = xs - xs.mean(0, keepdim=True)
    cov = (xs.t() @ xs).double()
    _, vecs = torch.linalg.eigh(cov)
    return vecs[:, -dim:].flip(1).to(torch.float32).contiguous()


def balanced_kmeans(
    weight: torch.Tensor,
    cluster_size: int = 16,
    *,
    iterations: int = 20,
    seed: int = 0,
    device: str | torch.device | None = None,
    pca_dim: int | None = 256,
    refine_iterations: int = 1,
    candidates: int = 8,
    chunk: int = 8192,
    progress: bool = True,
) -> ClusteringResult:
    """Cluster the rows of ``weight`` ([V, H]) into ``ceil(V / cluster_size)`` balanced clusters.

    ``device``: ``None``/"auto" picks CUDA when available, else CPU.  ``pca_dim``: run the main
    iterations in a PCA subspace of this many dimensions when it is smaller than ``H``
    (``None`` disables).  ``refine_iterations``: full-dimensional passes at the end (only
    when PCA was used).  Returns assignments and norm-aware stage-1 centroids
    (:func:`score_centroids`).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    v, h = weight.shape
    capacity = cluster_capacities(v, cluster_size).to(device)
    c = capacity.numel()
    gen = torch.Generator().manual_seed(seed)

    x = torch.nn.functional.normalize(weight.to(device, torch.float32), dim=1)
    use_pca = pca_dim is not None and pca_dim < h and c > 1
    xr = x @ _pca_basis(x, pca_dim, gen) if use_pca else x
    if use_pca:
        xr = torch.nn.functional.normalize(xr, dim=1)

    init = torch.randperm(v, generator=gen)[:c].to(device)
    cent = xr[init].clone()
    assign = None
    total = max(1, iterations) + (refine_iterations if use_pca else 0)
    bar = tqdm(total=total, desc="balanced k-means", unit="it", disable=not progress)
    for _ in range(max(1, iterations)):
        new = _balanced_assign(xr, cent, capacity, candidates, chunk)
        changed = v if assign is None else int((new != assign).sum())
        assign = new
        cent = _normalized_means(xr, assign, c)
        bar.update(1)
        bar.set_postfix(changed=changed)
        if changed == 0:
            bar.update(max(1, iterations) - bar.n)
            break
    if use_pca:
        del xr
        cent = _normalized_means(x, assign, c)
        for _ in range(refine_iterations):
            new = _balanced_assign(x, cent, capacity, candidates, chunk)
            changed = int((new != assign).sum())
            assign = new
            cent = _normalized_means(x, assign, c)
            bar.update(1)
            bar.set_postfix(changed=changed)
    bar.close()
    del x
    centroids = score_centroids(weight, assign, c)
    return ClusteringResult(
        assignments=assign.cpu(), centroids=centroids.cpu(), num_clusters=c, cluster_size=cluster_size
    )
