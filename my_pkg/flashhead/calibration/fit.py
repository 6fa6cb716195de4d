"""Data-aware stage 1: fit the centroid vectors to hidden states of the model itself.

The clustering stays weight-based; only the stage-1 scoring vectors ``[C, H]`` change, and they
are still used as ``hidden @ centroids.T`` with the top ``n_probes`` kept, so the assets keep the
published layout.

Targets come from the dense head in float32.  For a hidden state ``h`` with logits ``l = W h``
the *mass* of cluster ``c`` is ``M_c = sum_{j in c} exp(l_j)`` and ``Z = sum_c M_c``.  The fitted
score keeps a meaning serving relies on: ``size_c * exp(h @ centroid_c)`` estimates ``M_c``, i.e.
``h @ centroid_c`` is the log of the cluster's mean ``exp(logit)``, in logit units.

Objective, per hidden state, with ``s_c = h @ centroid_c + log size_c`` and ``q_c = M_c / Z``:

1. cross-entropy of ``softmax(s)`` against ``q``.  Only the ``top_k`` heaviest clusters of each state
   are stored; the others form one bucket holding their total share, which keeps the divergence exact
   for that coarser partition and the targets ``O(N * top_k)`` in memory;
2. plus ``top1_weight`` times the cross-entropy of ``softmax(s)`` against the cluster of the dense
   argmax (the one stage 1 must not miss), except where that token is pinned (always scored exactly);
3. plus ``level_weight * (logsumexp(s) - log Z)^2``: a softmax cannot see a shift shared by every
   cluster, this term fixes it, so that ``sum_c size_c * exp(h @ centroid_c)`` estimates ``Z``;
4. plus ``decay * mean ||centroid_c - init_c||^2`` (relative to the mean squared norm of ``init``'s
   rows), pulling towards the weight-only centroids.

Adam on minibatches of the fitting split; after every epoch the held-out split is scored and the
centroids with the lowest held-out loss are kept (early stopping after ``patience`` epochs
without improvement).  Deterministic for a seed on a given device and thread count.  Dense logits
are computed in row chunks sized by ``chunk_bytes``: ``N x V`` is never materialised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..cluster_rows import build_members

__all__ = ["ClusterTargets", "CalibrationResult", "cluster_targets", "split_rows", "fit_stage1"]

_MAX_WINNERS = 8  # distinct clusters holding a tied dense argmax kept per state


@dataclass
class ClusterTargets:
    """What the dense float32 head says about each hidden state (``N`` rows).

    ``top_ids`` / ``top_log_mass``: ``[N, K]`` the ``K`` heaviest clusters and ``log M_c``.
    ``log_z``: ``[N]`` log of the total mass.  ``winners``: ``[N, T]`` clusters holding a token whose
    logit equals the maximum (ties), ascending, ``-1`` padded.
    ``pinned_winner``: ``[N]`` a maximal token is pinned, so FlashHead always agrees there.
    """

    top_ids: torch.Tensor
    top_log_mass: torch.Tensor
    log_z: torch.Tensor
    winners: torch.Tensor
    pinned_winner: torch.Tensor

    def rows(self, index: torch.Tensor | slice) -> ClusterTargets:
        return ClusterTargets(
            self.top_ids[index],
            self.top_log_mass[index],
            self.log_z[index],
            self.winners[index],
            self.pinned_winner[index],
        )

    def to(self, device: torch.device | str) -> ClusterTargets:
        return ClusterTargets(
            self.top_ids.to(device),
            self.top_log_mass.to(device),
            self.log_z.to(device),
            self.winners.to(device),
            self.pinned_winner.to(device),
        )


@dataclass
class CalibrationResult:
    """Output of :func:`fit_stage1`: fitted ``centroids`` ``[C, H]`` float32 (CPU) and how the fit went."""

    centroids: torch.Tensor
    fit_rows: torch.Tensor
    heldout_rows: torch.Tensor
    epochs: int
    best_epoch: int
    heldout_loss: list[float] = field(default_factory=list)


def _chunk_rows(vocab_size: int, chunk_bytes: int) -> int:
    # Up to four [rows, V] float32 buffers live at once: logits, gathered members, logsumexp's temporaries.
    return max(1, chunk_bytes // (16 * max(1, vocab_size)))


def _cluster_layout(
    assignments: torch.Tensor, num_clusters: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(members [C, cap], valid [C, cap])``: the cluster map with its padding slots marked invalid."""
    members = build_members(assignments, num_clusters).to(device)
    sizes = torch.bincount(assignments.to(device), minlength=num_clusters)
    return members, torch.arange(members.shape[1], device=device).view(1, -1) < sizes.view(-1, 1)


def _pinned_tensor(pinned_ids: Iterable[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = sorted({int(i) for i in pinned_ids if 0 <= int(i) < vocab_size})
    return torch.tensor(ids, dtype=torch.int64, device=device)


def cluster_targets(
    weight: torch.Tensor,
    assignments: torch.Tensor,
    hidden: torch.Tensor,
    *,
    num_clusters: int | None = None,
    top_k: int = 64,
    pinned_ids: Iterable[int] = (),
    chunk_bytes: int = 512 << 20,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> ClusterTargets:
    """Dense float32 targets of ``hidden`` ``[N, H]`` for the head ``weight`` ``[>=V, H]``.

    ``assignments`` ``[V]`` gives each token's cluster; ``pinned_ids`` are tokens scored exactly on
    every row.  Rows are processed in chunks so that about ``chunk_bytes`` of ``[rows, V]`` buffers
    exist at a time.
    """
    device = torch.device(device)
    v = assignments.numel()
    c = int(assignments.max()) + 1 if num_clusters is None else num_clusters
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden states must be [N, {weight.shape[1]}], got {tuple(hidden.shape)}")
    if v > weight.shape[0]:
        raise ValueError(f"{v} assignments but the head has {weight.shape[0]} rows")
    weight32 = weight[:v].to(device, torch.float32)
    members, valid = _cluster_layout(assignments, c, device)
    pinned = _pinned_tensor(pinned_ids, v, device)
    k = min(top_k, c)
    n = hidden.shape[0]
    top_ids = torch.empty(n, k, dtype=torch.int64)
    top_log_mass = torch.empty(n, k, dtype=torch.float32)
    log_z = torch.empty(n, dtype=torch.float32)
    winners = torch.full((n, _MAX_WINNERS), -1, dtype=torch.int64)
    pinned_winner = torch.zeros(n, dtype=torch.bool)
    step = _chunk_rows(v, chunk_bytes)
    cluster_ids = torch.arange(c, device=device)
    for s in tqdm(range(0, n, step), desc="dense targets", unit="chunk", leave=False, disable=not progress):
        logits = hidden[s : s + step].to(device, torch.float32) @ weight32.t()
        best = logits.max(dim=1, keepdim=True).values
        grouped = logits[:, members].masked_fill_(~valid, float("-inf"))  # [b, C, cap]
        log_mass = torch.logsumexp(grouped, dim=2)
        log_z[s : s + step] = torch.logsumexp(log_mass, dim=1).cpu()
        vals, ids = torch.topk(log_mass, k, dim=1)
        top_ids[s : s + step], top_log_mass[s : s + step] = ids.cpu(), vals.cpu()
        wins = (grouped >= best.unsqueeze(2)).any(dim=2)
        ranked = torch.where(wins, cluster_ids, c).sort(dim=1).values[:, :_MAX_WINNERS]
        winners[s : s + step, : ranked.shape[1]] = torch.where(ranked < c, ranked, -1).cpu()
        if pinned.numel():
            pinned_winner[s : s + step] = (logits[:, pinned] >= best).any(dim=1).cpu()
    return ClusterTargets(top_ids, top_log_mass, log_z, winners, pinned_winner)


def split_rows(n: int, heldout_fraction: float, seed: int, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(fit, heldout)`` row indices, both non-empty when ``n >= 2``.

    Rows are held out in contiguous blocks of up to ``block`` rows (at least ten blocks): states captured
    from a text come in text order, and neighbouring positions of one document are alike, so a
    row-wise split would judge the fit on near-copies of what it was fitted to.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    if n < 2:
        raise ValueError(f"need at least 2 hidden states to hold some out, got {n}")
    block = max(1, min(block, n // 10))
    n_blocks = -(-n // block)
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    held_blocks = torch.zeros(n_blocks, dtype=torch.bool)
    held_blocks[perm[: min(n_blocks - 1, max(1, round(n_blocks * heldout_fraction)))]] = True
    held = held_blocks.repeat_interleave(block)[:n]
    return torch.nonzero(~held).flatten(), torch.nonzero(held).flatten()


def _losses(
    scores: torch.Tensor, log_size: torch.Tensor, t: ClusterTargets, top1_weight: float, level_weight: float
) -> torch.Tensor:
    """Per-row objective (terms 1-3 of the module docstring) for ``scores = hidden @ centroids.T``."""
    logits = scores + log_size
    log_total = torch.logsumexp(logits, dim=1)
    log_p = logits - log_total.unsqueeze(1)
    true_share = torch.exp(t.top_log_mass - t.log_z.unsqueeze(1))  # q_c of the stored clusters
    loss = -(true_share * log_p.gather(1, t.top_ids)).sum(dim=1)
    if t.top_ids.shape[1] < scores.shape[1]:
        rest = (1.0 - true_share.sum(dim=1)).clamp_min(0.0)
        loss = loss - rest * torch.logsumexp(log_p.scatter(1, t.top_ids, float("-inf")), dim=1)
    loss = loss + level_weight * (log_total - t.log_z).pow(2)
    if top1_weight:
        ce = -log_p.gather(1, t.winners[:, :1]).squeeze(1)
        loss = loss + top1_weight * torch.where(t.pinned_winner, torch.zeros_like(ce), ce)
    return loss


def fit_stage1(
    weight: torch.Tensor,
    assignments: torch.Tensor,
    hidden: torch.Tensor,
    init: torch.Tensor,
    *,
    pinned_ids: Iterable[int] = (),
    heldout_fraction: float = 0.2,
    seed: int = 0,
    epochs: int = 30,
    batch_size: int = 256,
    lr: float = 0.01,
    top1_weight: float = 0.5,
    level_weight: float = 0.1,
    decay: float = 0.0,
    patience: int = 4,
    top_k: int = 64,
    device: str | torch.device = "cpu",
    targets: ClusterTargets | None = None,
    progress: bool = False,
) -> CalibrationResult:
    """Fit stage-1 vectors ``[C, H]`` to calibration ``hidden`` states ``[N, H]`` (see the module docstring).

    ``init``: the weight-only centroids ``[C, H]`` (e.g. :func:`~my_pkg.flashhead.clustering.score_centroids`),
    the starting point and the anchor of ``decay``.  ``targets``: precomputed :func:`cluster_targets`
    of ``hidden`` (computed here otherwise).  ``lr`` is relative to the mean norm of ``init``'s rows.
    """
    device = torch.device(device)
    c, h = init.shape
    if assignments.dim() != 1 or int(assignments.max()) >= c or int(assignments.min()) < 0:
        raise ValueError(f"assignments must be 1-D cluster ids in [0, {c})")
    if hidden.dim() != 2 or hidden.shape[1] != h:
        raise ValueError(f"hidden states must be [N, {h}], got {tuple(hidden.shape)}")
    if weight.shape[1] != h:
        raise ValueError(f"centroids are [C, {h}] but the head is [V, {weight.shape[1]}]")
    if epochs < 1 or batch_size < 1 or lr <= 0 or patience < 1:
        raise ValueError("epochs, batch_size and patience must be >= 1 and lr > 0")
    if not torch.isfinite(hidden).all():
        raise ValueError("hidden states contain non-finite values")
    fit_rows, held_rows = split_rows(hidden.shape[0], heldout_fraction, seed)
    if targets is None:
        targets = cluster_targets(
            weight,
            assignments,
            hidden,
            num_clusters=c,
            top_k=top_k,
            pinned_ids=pinned_ids,
            device=device,
            progress=progress,
        )
    hidden = hidden.to(device, torch.float32)
    targets = targets.to(device)
    fit_h, fit_t = hidden[fit_rows.to(device)], targets.rows(fit_rows.to(device))
    held_h, held_t = hidden[held_rows.to(device)], targets.rows(held_rows.to(device))
    log_size = torch.log(torch.bincount(assignments.to(device), minlength=c).float())
    anchor = init.detach().to(device, torch.float32)
    centroids = anchor.clone().requires_grad_(True)
    scale = float(anchor.norm(dim=1).mean()) or 1.0
    opt = torch.optim.Adam([centroids], lr=lr * scale)
    gen = torch.Generator().manual_seed(seed)

    def heldout_loss(batch: int = 4096) -> float:
        total = 0.0
        with torch.no_grad():
            for s in range(0, held_h.shape[0], batch):
                part = slice(s, s + batch)
                losses = _losses(held_h[part] @ centroids.t(), log_size, held_t.rows(part), top1_weight, level_weight)
                total += float(losses.sum())
        return total / held_h.shape[0]

    history = [heldout_loss()]
    best_state, best_epoch, since_best = anchor.clone(), 0, 0
    bar = tqdm(range(1, epochs + 1), desc="calibrating stage 1", unit="epoch", disable=not progress)
    epoch = 0
    for epoch in bar:
        order = torch.randperm(fit_h.shape[0], generator=gen).to(device)
        for s in range(0, order.numel(), batch_size):
            idx = order[s : s + batch_size]
            loss = _losses(fit_h[idx] @ centroids.t(), log_size, fit_t.rows(idx), top1_weight, level_weight).mean()
            if decay:
                loss = loss + decay * (centroids - anchor).pow(2).sum(dim=1).mean() / scale**2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        history.append(heldout_loss())
        bar.set_postfix(heldout_loss=f"{history[-1]:.4f}")
        if history[-1] < history[best_epoch] - 1e-6:
            best_state, best_epoch, since_best = centroids.detach().clone(), epoch, 0
        else:
            since_best += 1
            if since_best >= patience:
                break
    bar.close()
    return CalibrationResult(
        centroids=best_state.cpu(),
        fit_rows=fit_rows,
        heldout_rows=held_rows,
        epochs=epoch,
        best_epoch=best_epoch,
        heldout_loss=history,
    )
