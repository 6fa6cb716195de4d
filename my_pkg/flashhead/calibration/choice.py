"""How many probes stage 1 needs: the statistics behind the probe count a build writes.

For each validation state, :func:`probes_needed` is the smallest probe count at which FlashHead's greedy
token is a dense float32 argmax; :func:`agreement_curve` turns those into the top-1 agreement at every
count.  :func:`choose_n_probes` picks the smallest count whose one-sided Wilson lower bound
(:func:`agreement_lower_bound`) reaches the target, while the estimate itself shows at most ``1 / margin``
of the misses the target allows.  :func:`apply_probe_rule` applies that rule over several validation sets
at once, and :func:`keep_stage1` compares two stage-1 variants (calibrated, weight-only) under it.
Pure torch on ``[N]`` count tensors, apart from :func:`probes_needed`, which scores stage 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import torch

from ..spec import rows_scored
from .fit import ClusterTargets

__all__ = [
    "PROBE_MARGIN",
    "CALIBRATED",
    "WEIGHT_ONLY",
    "ProbeChoice",
    "ProbeRule",
    "probes_needed",
    "agreement_curve",
    "agreement_lower_bound",
    "scored_fraction",
    "check_target",
    "choose_n_probes",
    "apply_probe_rule",
    "keep_stage1",
]

#: Default safety factor of the probe choice: the estimate must show at most half the misses the target allows.
PROBE_MARGIN = 2.0


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


def check_target(target_agreement: float, confidence: float) -> None:
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
    check_target(target_agreement, confidence)
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
