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

import time
from dataclasses import dataclass, field
from statistics import NormalDist

import torch
from tqdm.auto import tqdm

from .cluster_rows import build_members
from .spec import rows_scored

__all__ = [
    "ClusterTargets",
    "CalibrationResult",
    "ProbeChoice",
    "StageOneCalibration",
    "cluster_targets",
    "split_rows",
    "fit_stage1",
    "probes_needed",
    "agreement_curve",
    "agreement_lower_bound",
    "scored_fraction",
    "choose_n_probes",
    "calibrate_stage1",
    "ProbeRule",
    "apply_probe_rule",
    "keep_stage1",
    "CALIBRATED",
    "WEIGHT_ONLY",
]

_MAX_WINNERS = 8  # distinct clusters holding a tied dense argmax kept per state

#: Default safety factor of the probe choice: the estimate must show at most half the misses the target allows.
PROBE_MARGIN = 2.0


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


@dataclass
class ProbeChoice:
    """A probe count and its held-out top-1 agreement (:func:`choose_n_probes`).

    ``agreement``: the held-out estimate; ``agreement_lower``: its one-sided lower confidence bound.
    ``certified``: the bound reaches the target.  ``reached``: the estimate reaches the target with
    fewer probes than clusters (probing every cluster always agrees).
    """

    n_probes: int
    agreement: float
    agreement_lower: float
    scored_fraction: float
    reached: bool
    certified: bool


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


def _pinned_tensor(pinned_ids, vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = sorted({int(i) for i in pinned_ids if 0 <= int(i) < vocab_size})
    return torch.tensor(ids, dtype=torch.int64, device=device)


def cluster_targets(
    weight: torch.Tensor,
    assignments: torch.Tensor,
    hidden: torch.Tensor,
    *,
    num_clusters: int | None = None,
    top_k: int = 64,
    pinned_ids=(),
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
    pinned_ids=(),
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


def probes_needed(
    centroids: torch.Tensor,
    hidden: torch.Tensor,
    targets: ClusterTargets,
    *,
    dtype: torch.dtype = torch.float32,
    batch: int = 4096,
) -> torch.Tensor:
    """``[N]`` smallest probe count at which FlashHead's greedy token is a dense float32 argmax.

    Stage 1 is scored as serving scores it (``hidden @ centroids.T`` in ``dtype``, the head's).  A
    state agrees once any cluster holding a maximal token is probed; a tie in stage-1 scores counts
    against it (the top-k may break it either way).  ``0`` where a maximal token is pinned.
    """
    cent = centroids.to(hidden.device, dtype)
    out = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    for s in range(0, hidden.shape[0], batch):
        scores = torch.nn.functional.linear(hidden[s : s + batch].to(dtype), cent).float()
        win = targets.winners[s : s + batch].to(hidden.device)
        win_score = scores.gather(1, win.clamp_min(0)).masked_fill(win < 0, float("-inf"))
        rank = (scores.unsqueeze(1) >= win_score.unsqueeze(2)).sum(dim=2)  # [b, T], itself included
        need = rank.masked_fill(win < 0, scores.shape[1]).min(dim=1).values
        out[s : s + batch] = torch.where(targets.pinned_winner[s : s + batch].to(hidden.device), 0, need)
    return out.cpu()


def agreement_curve(needed: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """``[C + 1]`` top-1 agreement at every probe count ``0..C`` from :func:`probes_needed`."""
    counts = torch.bincount(needed.clamp(0, num_clusters), minlength=num_clusters + 1)
    return counts.cumsum(0).double() / max(1, needed.numel())


def scored_fraction(num_clusters: int, n_probes: int, cluster_size: int, vocab_size: int, num_pinned: int = 0) -> float:
    """Share of the vocabulary scored per step: centroids, probed members and pinned ids."""
    return rows_scored(num_clusters, n_probes, cluster_size, pinned=num_pinned) / vocab_size


def _check_target(target_agreement: float, confidence: float) -> None:
    if not 0.0 < target_agreement <= 1.0:
        raise ValueError(f"target agreement must lie in (0, 1], got {target_agreement}")
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must lie in [0.5, 1), got {confidence}")


def agreement_lower_bound(agreement: torch.Tensor, n: int, confidence: float) -> torch.Tensor:
    """One-sided Wilson score lower bound of a proportion ``agreement`` measured on ``n`` states."""
    z = NormalDist().inv_cdf(confidence)
    p = agreement.double()
    z2n = z * z / n
    return (p + z2n / 2 - z * torch.sqrt(p * (1 - p) / n + z2n / (4 * n))) / (1 + z2n)


def _probe_choice(
    curve: torch.Tensor,
    p: int,
    n: int,
    target: float,
    confidence: float,
    num_clusters: int,
    cluster_size: int,
    vocab_size: int,
    num_pinned: int,
) -> ProbeChoice:
    lower = 1.0 if p == num_clusters else float(agreement_lower_bound(curve[p], n, confidence))
    return ProbeChoice(
        n_probes=p,
        agreement=float(curve[p]),
        agreement_lower=lower,
        scored_fraction=scored_fraction(num_clusters, p, cluster_size, vocab_size, num_pinned),
        reached=p < num_clusters and float(curve[p]) >= target - 1e-12,
        certified=lower >= target - 1e-12,
    )


def choose_n_probes(
    needed: torch.Tensor,
    num_clusters: int,
    cluster_size: int,
    vocab_size: int,
    *,
    target_agreement: float = 0.995,
    confidence: float = 0.95,
    num_pinned: int = 0,
    n_probes: int | None = None,
    margin: float = 1.0,
) -> ProbeChoice:
    """The probe count to write, from the held-out states' :func:`probes_needed`.

    The smallest count whose held-out agreement reaches ``target_agreement`` with ``confidence``
    (its one-sided Wilson lower bound does; ``confidence=0.5`` takes the estimate itself).  When no
    count below ``C`` shows that -- too few held-out states -- the smallest whose estimate reaches the
    target, with ``certified`` False.  Probing every cluster always agrees, so ``C`` is the last
    resort.  ``n_probes`` given: that count, judged the same way.

    ``margin``: the estimate must also show at most ``1 / margin`` of the misses the target allows
    (agreement ``>= 1 - (1 - target) / margin``), a safety factor for text unlike the held-out states.
    """
    _check_target(target_agreement, confidence)
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1, got {margin}")
    estimate_target = 1.0 - (1.0 - target_agreement) / margin
    n = needed.numel()
    if n == 0:
        raise ValueError("no held-out states to choose n_probes on")
    curve = agreement_curve(needed, num_clusters)
    layout = (num_clusters, cluster_size, vocab_size, num_pinned)
    if n_probes is not None:
        if not 1 <= n_probes <= num_clusters:
            raise ValueError(f"n_probes must lie in [1, {num_clusters}], got {n_probes}")
        return _probe_choice(curve, n_probes, n, target_agreement, confidence, *layout)
    lower = agreement_lower_bound(curve[1:num_clusters], n, confidence)
    estimate_ok = curve[1:num_clusters] >= estimate_target - 1e-12
    for ok_mask in ((lower >= target_agreement - 1e-12) & estimate_ok, estimate_ok):
        ok = torch.nonzero(ok_mask).flatten()
        if ok.numel():
            return _probe_choice(curve, int(ok[0]) + 1, n, target_agreement, confidence, *layout)
    return _probe_choice(curve, num_clusters, n, target_agreement, confidence, *layout)


@dataclass
class StageOneCalibration:
    """Outcome of :func:`calibrate_stage1`: the vectors to write, the probe count and the evidence.

    ``choice``: the kept vectors at the probe count to write (held-out split).  ``weight_only``: the
    weight-only vectors on the held-out split at the count the rule gives them; ``weight_only_same_probes``:
    them at ``choice.n_probes``.
    """

    centroids: torch.Tensor
    choice: ProbeChoice
    weight_only: ProbeChoice
    weight_only_same_probes: ProbeChoice
    fit: CalibrationResult
    num_pinned: int
    target_agreement: float
    confidence: float
    margin: float = 1.0
    # name -> (states, the count that set alone needs, the set judged at the written count)
    validation: dict[str, tuple[int, ProbeChoice, ProbeChoice]] = field(default_factory=dict)
    pooled: ProbeChoice | None = None  # every validation state (held-out split included) at the written count
    stage1: str = "calibrated"  # the variant kept: CALIBRATED or WEIGHT_ONLY (`centroids` are its vectors)
    stage1_reason: str = ""  # one line: why that variant was kept
    variants: dict[str, ProbeRule] = field(default_factory=dict)  # each variant under the rule, count free
    fitted_centroids: torch.Tensor | None = None  # the fitted vectors, kept or not
    calibrated_same_probes: ProbeChoice | None = None  # the fitted vectors at ``choice.n_probes`` (held-out split)

    @property
    def n_probes(self) -> int:
        return self.choice.n_probes

    def record(self) -> dict:
        """What config.json keeps about the calibration (``flash_head_calibration``)."""
        return {
            "rows": int(self.fit.fit_rows.numel() + self.fit.heldout_rows.numel()),
            "fit_rows": int(self.fit.fit_rows.numel()),
            "heldout_rows": int(self.fit.heldout_rows.numel()),
            "target_agreement": self.target_agreement,
            "confidence": self.confidence,
            "n_probes": self.n_probes,
            "scored_fraction": round(self.choice.scored_fraction, 6),
            "heldout_agreement": round(self.choice.agreement, 6),
            "heldout_agreement_lower_bound": round(self.choice.agreement_lower, 6),
            "target_reached": self.choice.reached,
            "target_certified": self.choice.certified,
            "weight_only_heldout_agreement": round(self.weight_only_same_probes.agreement, 6),
            "weight_only_n_probes": self.weight_only.n_probes,
            "stage1": self.stage1,
            "stage1_reason": self.stage1_reason,
            "stage1_variants": {
                name: {
                    "n_probes_needed": rule.n_probes,
                    "meets_target": rule.meets,
                    "agreement": round(rule.pooled.agreement, 6),
                    "agreement_lower_bound": round(rule.pooled.agreement_lower, 6),
                    "scored_fraction": round(rule.pooled.scored_fraction, 6),
                }
                for name, rule in self.variants.items()
            },
            "pinned_ids": self.num_pinned,
            "epochs": self.fit.epochs,
            "best_epoch": self.fit.best_epoch,
            "margin": self.margin,
            "validation_rows": None
            if self.pooled is None
            else int(self.fit.heldout_rows.numel() + sum(rows for rows, _, _ in self.validation.values())),
            "validation_agreement_lower_bound": None if self.pooled is None else round(self.pooled.agreement_lower, 6),
            "validation": {
                name: {
                    "rows": rows,
                    "n_probes_needed": alone.n_probes,
                    "agreement": round(at.agreement, 6),
                    "agreement_lower_bound": round(at.agreement_lower, 6),
                }
                for name, (rows, alone, at) in self.validation.items()
            },
        }


@dataclass
class ProbeRule:
    """The probe-count rule applied to one stage 1 over every validation set (:func:`apply_probe_rule`).

    ``n_probes``: the count the rule gives; ``meets``: below all clusters, every set's estimate shows at most
    ``1 / margin`` of the misses the target allows and the pooled lower bound reaches the target there.
    ``per_set``: name -> the count that set alone needs; ``at``: name -> the set judged at ``n_probes``;
    ``pooled``: every state pooled, at ``n_probes``.
    """

    n_probes: int
    meets: bool
    per_set: dict[str, ProbeChoice]
    at: dict[str, ProbeChoice]
    pooled: ProbeChoice


def apply_probe_rule(
    needed: dict[str, torch.Tensor],
    num_clusters: int,
    cluster_size: int,
    vocab_size: int,
    *,
    num_pinned: int = 0,
    target_agreement: float = 0.995,
    confidence: float = 0.95,
    margin: float = PROBE_MARGIN,
    n_probes: int | None = None,
) -> ProbeRule:
    """The smallest count at which every set's estimate shows at most ``1 / margin`` of the misses the target
    allows and the one-sided ``confidence`` bound over all sets pooled reaches the target (``n_probes``: that
    count instead, judged the same way).  ``needed``: name -> :func:`probes_needed` of that set's states."""
    layout = (num_clusters, cluster_size, vocab_size)
    pooled_needed = torch.cat(list(needed.values()))
    per_set = {
        name: choose_n_probes(
            n, *layout, num_pinned=num_pinned, target_agreement=target_agreement, confidence=0.5, margin=margin
        )
        for name, n in needed.items()
    }
    first = choose_n_probes(
        pooled_needed, *layout, num_pinned=num_pinned, target_agreement=target_agreement, confidence=confidence
    )
    count = n_probes if n_probes is not None else max([first.n_probes, *(ch.n_probes for ch in per_set.values())])
    choose = dict(target_agreement=target_agreement, confidence=confidence, margin=margin, num_pinned=num_pinned)
    at = {name: choose_n_probes(n, *layout, n_probes=count, **choose) for name, n in needed.items()}
    pooled = choose_n_probes(
        pooled_needed,
        *layout,
        num_pinned=num_pinned,
        n_probes=count,
        target_agreement=target_agreement,
        confidence=confidence,
    )
    estimate_target = 1.0 - (1.0 - target_agreement) / margin
    meets = (
        count < num_clusters
        and pooled.certified
        and all(choice.agreement >= estimate_target - 1e-12 for choice in at.values())
    )
    return ProbeRule(n_probes=count, meets=meets, per_set=per_set, at=at, pooled=pooled)


#: Names of the two stage-1 variants a calibrated build measures (``flash_head_calibration.stage1``).
CALIBRATED, WEIGHT_ONLY = "calibrated", "weight_only"


def keep_stage1(calibrated: ProbeRule, weight_only: ProbeRule, *, fixed_probes: bool = False) -> tuple[str, str]:
    """``(kept variant, one-line reason)``: the stage 1 that meets the promise with the fewest probes.

    Both meet it: fewer probes wins, a tie goes to the higher pooled agreement, then to the calibrated one.
    One meets it: that one.  Neither: the one needing fewer probes (the rule's fallback), said so.  With a
    fixed probe count (``--n-probes``): the one with the higher pooled agreement there (tie: calibrated).
    """
    cal, wo = calibrated, weight_only
    if fixed_probes:
        kept = WEIGHT_ONLY if wo.pooled.agreement > cal.pooled.agreement else CALIBRATED
        return kept, (
            f"n_probes fixed at {cal.n_probes}: kept the {kept.replace('_', '-')} stage 1, the higher held-out "
            f"agreement there ({max(cal.pooled.agreement, wo.pooled.agreement):.4f} vs "
            f"{min(cal.pooled.agreement, wo.pooled.agreement):.4f})"
        )
    if cal.meets and wo.meets:
        if wo.n_probes < cal.n_probes or (wo.n_probes == cal.n_probes and wo.pooled.agreement > cal.pooled.agreement):
            return WEIGHT_ONLY, (
                f"kept the weight-only stage 1: it meets the target with n_probes={wo.n_probes}, "
                f"the calibrated one needs {cal.n_probes}"
            )
        return CALIBRATED, (
            f"kept the calibrated stage 1: it meets the target with n_probes={cal.n_probes}, "
            f"the weight-only one needs {wo.n_probes}"
        )
    if cal.meets or wo.meets:
        kept, other = (CALIBRATED, wo) if cal.meets else (WEIGHT_ONLY, cal)
        name = "weight-only" if kept == CALIBRATED else "calibrated"
        return kept, (
            f"kept the {kept.replace('_', '-')} stage 1: the {name} one does not meet the target below all "
            f"clusters (its rule's count {other.n_probes})"
        )
    kept = WEIGHT_ONLY if wo.n_probes < cal.n_probes else CALIBRATED
    return kept, (
        f"neither stage 1 meets the target below all clusters on the validation states; kept the "
        f"{kept.replace('_', '-')} one, whose estimate reaches it with fewer probes "
        f"({min(cal.n_probes, wo.n_probes)} vs {max(cal.n_probes, wo.n_probes)})"
    )


def calibrate_stage1(
    weight: torch.Tensor,
    assignments: torch.Tensor,
    init: torch.Tensor,
    hidden: torch.Tensor,
    *,
    pinned_ids=(),
    target_agreement: float = 0.995,
    confidence: float = 0.95,
    n_probes: int | None = None,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    margin: float = PROBE_MARGIN,
    validation: dict[str, torch.Tensor] | None = None,
    keep_best: bool = True,
    device: str | torch.device = "cpu",
    progress: bool = False,
    **fit_options,
) -> StageOneCalibration:
    """Fit the stage-1 vectors, choose ``n_probes`` on states the fit never saw, and keep the better stage 1.

    1. Dense float32 targets of every state (:func:`cluster_targets`).
    2. Fit on the fitting split, early-stopped on the held-out split (:func:`fit_stage1`).
    3. The probe count (or ``n_probes`` when given), judged on the held-out split and on every ``validation``
       set (states of another source, e.g. the model's own samples when calibrating on a text), stage 1 scored
       in the head's dtype as serving scores it: the smallest count at which every set's estimate shows at most
       ``1 / margin`` of the misses the target allows and the one-sided ``confidence`` lower bound over all
       these states pooled reaches the target (:func:`apply_probe_rule`).
    4. The weight-only ``init`` is judged by the same rule on the same states; with ``keep_best`` the stage 1
       that meets the target with fewer probes is kept (:func:`keep_stage1`), else the fitted one.
    """
    c = init.shape[0]
    _check_target(target_agreement, confidence)
    if n_probes is not None and not 1 <= n_probes <= c:
        raise ValueError(f"n_probes must lie in [1, {c}], got {n_probes}")
    v = assignments.numel()
    pinned = sorted({int(i) for i in pinned_ids if 0 <= int(i) < v})
    top_k = fit_options.pop("top_k", 64)
    targets = cluster_targets(
        weight, assignments, hidden, num_clusters=c, pinned_ids=pinned, top_k=top_k, device=device, progress=progress
    )
    fit = fit_stage1(
        weight,
        assignments,
        hidden,
        init,
        pinned_ids=pinned,
        heldout_fraction=heldout_fraction,
        seed=seed,
        device=device,
        targets=targets,
        progress=progress,
        **fit_options,
    )
    layout = (c, int(torch.bincount(assignments, minlength=c).max()), v)
    held_h, held_t = hidden[fit.heldout_rows].to(device), targets.rows(fit.heldout_rows)
    sets: dict[str, tuple[torch.Tensor, ClusterTargets]] = {"heldout": (held_h, held_t)}
    for name, states in (validation or {}).items():
        states = states.to(device)
        t = cluster_targets(weight, assignments, states, num_clusters=c, pinned_ids=pinned, top_k=1, device=device)
        sets[name] = (states, t)
    rule = dict(
        num_pinned=len(pinned),
        target_agreement=target_agreement,
        confidence=confidence,
        margin=margin,
        n_probes=n_probes,
    )

    def needed_by(centroids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: probes_needed(centroids, h, t, dtype=weight.dtype) for name, (h, t) in sets.items()}

    needed = {CALIBRATED: needed_by(fit.centroids), WEIGHT_ONLY: needed_by(init)}
    # What each variant needs under the rule (the record's figures), and each at the count to write.
    free = {name: apply_probe_rule(n, *layout, **{**rule, "n_probes": None}) for name, n in needed.items()}
    fixed = free if n_probes is None else {name: apply_probe_rule(n, *layout, **rule) for name, n in needed.items()}
    if keep_best:
        kept, reason = keep_stage1(fixed[CALIBRATED], fixed[WEIGHT_ONLY], fixed_probes=n_probes is not None)
    else:
        kept, reason = CALIBRATED, "kept the calibrated stage 1 (no comparison asked for)"
    chosen = fixed[kept]
    written = chosen.n_probes
    choose = dict(target_agreement=target_agreement, confidence=confidence, margin=margin)
    held_init = needed[WEIGHT_ONLY]["heldout"]
    return StageOneCalibration(
        centroids=fit.centroids if kept == CALIBRATED else init.detach().to("cpu", torch.float32).clone(),
        choice=chosen.at["heldout"],
        weight_only=free[WEIGHT_ONLY].at["heldout"],
        weight_only_same_probes=choose_n_probes(held_init, *layout, num_pinned=len(pinned), n_probes=written, **choose),
        fit=fit,
        num_pinned=len(pinned),
        target_agreement=target_agreement,
        confidence=confidence,
        margin=margin,
        pooled=chosen.pooled,
        validation={
            name: (int(sets[name][0].shape[0]), chosen.per_set[name], chosen.at[name])
            for name in sets
            if name != "heldout"
        },
        stage1=kept,
        stage1_reason=reason,
        variants=free,
        calibrated_same_probes=choose_n_probes(
            needed[CALIBRATED]["heldout"], *layout, num_pinned=len(pinned), n_probes=written, **choose
        ),
        fitted_centroids=fit.centroids,
    )


# ------------------------------------------------------------------------------------- self-calibration

#: Short, varied openings the dense model continues when a build has no calibration text ("" is BOS alone):
#: prose, code, lists, dialogue, markup and numbers, so the sampled text covers more than one style.
SELF_CALIBRATION_PROMPTS: tuple[str, ...] = (
    "",
    "The",
    "In this",
    "Once upon a time",
    "Hello",
    "We",
    "It is",
    "A",
    "Why",
    "How to",
    "Note:",
    "Example:",
    "Summary:",
    "Q:",
    "1.",
    "-",
    "#",
    "def ",
    "import ",
    "class ",
    "for i in",
    "if ",
    "return",
    "This function",
    "The following",
    '{"',
    "<p>",
    "$ ",
    "2024",
    "Table",
)


@dataclass
class SelfCalibration:
    """Hidden states of the dense model's own samples (:func:`generate_calibration_states`) and how they were made."""

    hidden: torch.Tensor
    sequences: int
    rounds: int
    seconds: float
    stopped_by_time: bool
    settings: dict

    def record(self) -> dict:
        return {
            **self.settings,
            "states": int(self.hidden.shape[0]),
            "sequences": self.sequences,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 1),
            "stopped_by_time": self.stopped_by_time,
        }


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _final_norm_needed(model, device) -> bool:
    """Whether the last element of ``output_hidden_states`` still needs the final norm to give the logits."""
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % model.config.vocab_size
    out = model(input_ids=ids, output_hidden_states=True)
    hs, head = out.hidden_states[-1][0], model.get_output_embeddings()
    if torch.allclose(head(hs).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
        return False
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is not None and torch.allclose(head(norm(hs)).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
        return True
    raise RuntimeError("cannot reproduce the model's logits from its last hidden state")


@torch.no_grad()
def generate_calibration_states(
    model,
    tokenizer,
    *,
    max_states: int = 16384,
    new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    time_budget_s: float = 600.0,
    prompts: tuple[str, ...] = SELF_CALIBRATION_PROMPTS,
    progress: bool = False,
) -> SelfCalibration:
    """Sample the dense model from ``prompts`` and keep the LM head's input at every generated position.

    A decode step sees the hidden state of the model's own previous outputs, so these states are what a
    served model's head sees.  Each round samples one continuation of every prompt (BOS, when the
    tokenizer has one, then the prompt; batch of ``len(prompts)``, left-padded) for up to ``new_tokens``
    tokens (fewer when the context is shorter), with ``temperature`` / ``top_p``, seeded by
    ``seed + round``; rounds repeat until ``max_states`` states or ``time_budget_s`` seconds.  A
    sequence's states end at its first EOS.  States are float32 on the CPU, round by round.
    """
    from tqdm.auto import tqdm

    if max_states < 1 or new_tokens < 1 or time_budget_s <= 0 or temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError("max_states, new_tokens, time_budget_s, temperature must be positive; top_p in (0, 1]")
    device = next(model.parameters()).device
    norm = getattr(getattr(model, "model", None), "norm", None) if _final_norm_needed(model, device) else None
    eos = _eos_ids(model, tokenizer)
    start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos) if eos else 0)
    encoded = [
        ([] if start_id is None else [int(start_id)])
        + list(tokenizer(p, add_special_tokens=False).input_ids if p else [])
        for p in prompts
    ]
    encoded = [e if e else [pad_id] for e in encoded]
    width = max(len(e) for e in encoded)
    context = getattr(model.config, "max_position_embeddings", None)
    steps = min(new_tokens, context - width) if isinstance(context, int) and context > width else new_tokens
    input_ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    eos_tensor = torch.tensor(sorted(eos), dtype=torch.int64, device=device)
    states: list[torch.Tensor] = []
    count, rounds, t0 = 0, 0, time.perf_counter()
    stopped_by_time = False
    bar = tqdm(total=max_states, desc="self-calibration", unit="state", disable=not progress)
    devices = [device] if device.type == "cuda" else []
    while count < max_states:
        remaining = time_budget_s - (time.perf_counter() - t0)
        if remaining <= 0:
            stopped_by_time = True
            break
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + rounds)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=0,
                max_new_tokens=steps,
                min_new_tokens=0,
                pad_token_id=pad_id,
                eos_token_id=sorted(eos) or None,
                output_hidden_states=True,
                return_dict_in_generate=True,
                max_time=remaining,
            )
        rounds += 1
        generated = out.sequences[:, width:]
        last = [step[-1][:, -1, :] for step in out.hidden_states]  # [B, H] per step, the head's input
        hs = torch.stack(last[: generated.shape[1]], dim=1)  # [B, T, H]
        if norm is not None:
            hs = norm(hs)
        is_eos = (
            torch.isin(generated, eos_tensor) if eos_tensor.numel() else torch.zeros_like(generated, dtype=torch.bool)
        )
        before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before this position
        keep = hs[before == 0].float().cpu()[: max_states - count]
        states.append(keep)
        count += keep.shape[0]
        bar.update(keep.shape[0])
        if time.perf_counter() - t0 >= time_budget_s and count < max_states:
            stopped_by_time = True
            break
    bar.close()
    hidden = torch.cat(states) if states else torch.empty(0, model.config.hidden_size)
    settings = {
        "prompts": len(prompts),
        "new_tokens": steps,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "max_states": max_states,
        "time_budget_s": time_budget_s,
    }
    return SelfCalibration(
        hidden=hidden,
        sequences=rounds * len(prompts),
        rounds=rounds,
        seconds=time.perf_counter() - t0,
        stopped_by_time=stopped_by_time,
        settings=settings,
    )


def load_causal_lm(model_dir, device: str = "cpu"):
    """``(model, tokenizer)`` of a local Hugging Face checkpoint in float32, or a ``RuntimeError`` saying why not.

    Refuses a checkpoint whose weights do not cover the model (e.g. a head-only file): ``transformers``
    would initialise the missing layers at random and sample noise.
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise RuntimeError(f"transformers is not installed ({e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, output_loading_info=True
        )
    except Exception as e:  # noqa: BLE001 - any loading failure means: cannot run this checkpoint
        raise RuntimeError(
            f"cannot load the model with transformers: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in info.get("missing_keys", []) if k not in tied]
    if missing:
        raise RuntimeError(f"the checkpoint lacks {len(missing)} of the model's weights (e.g. {sorted(missing)[0]})")
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer
