"""The fidelity curves ``eval --plot`` draws: greedy top-1 agreement per probe count, sampled TV per estimate rank.

Same semantics as :func:`~my_pkg.flashhead.fidelity.serving_fidelity`; the greedy sweep computes the dense
reference once per batch of states for every probe count. Every function restores the head's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fidelity import SAMPLING_SETTINGS, ServingFidelity, reference_weight, serving_fidelity
from .head import FlashHead

__all__ = ["FidelityCurves", "fidelity_curves", "plot_probe_counts"]


@dataclass
class FidelityCurves:
    """What ``eval --plot`` draws: greedy rows per probe count, sampled rows per estimate rank.

    ``greedy``: :func:`serving_fidelity` at each probe count, without sampling figures. ``sampled``: the served
    probe count at each swept ``sampled_rank`` (``sampled_rank`` of each entry says which); ``served_rank``:
    the rank serving uses.
    """

    greedy: list[ServingFidelity]
    sampled: list[ServingFidelity]
    served_n_probes: int
    served_rank: int


def plot_probe_counts(num_clusters: int, served: int, extra: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Probe counts of the agreement curve: powers of two from 1 up to (about) 8x ``served`` (at most the
    cluster count), with ``served`` and ``extra``."""
    counts = {served, *extra}
    p = 1
    while p <= min(num_clusters, 8 * served):
        counts.add(p)
        p *= 2
    return sorted(c for c in counts if 1 <= c <= num_clusters)


def fidelity_curves(
    head: FlashHead,
    hidden: torch.Tensor,
    probes: list[int],
    *,
    ranks: list[int] | None = None,
    pinned: list[int] | tuple[int, ...] = (),
    postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
    settings: tuple[tuple[float, float], ...] = SAMPLING_SETTINGS,
) -> FidelityCurves:
    """Top-1 agreement at every count of ``probes``, and sampled TV at the head's ``n_probes`` for every rank of
    ``ranks`` (default: 1/4, 1/2, 3/4 and all of the served ``sampled_rank``; none when it is 0). Restores the
    head's ``sampled_rank``."""
    served_rank = head.sampled_rank
    if ranks is None:
        ranks = sorted({max(1, served_rank * k // 4) for k in (1, 2, 3, 4)}) if served_rank else []
    greedy = _greedy_sweep(head, hidden, probes, pinned=pinned, postprocess=postprocess)
    sampled = []
    try:
        for rank in ranks:
            head.sampled_rank = rank
            sampled += serving_fidelity(
                head, hidden, [head.n_probes], pinned=pinned, postprocess=postprocess, settings=settings
            )
    finally:
        head.sampled_rank = served_rank
    return FidelityCurves(greedy=greedy, sampled=sampled, served_n_probes=head.n_probes, served_rank=served_rank)


def _greedy_sweep(
    head: FlashHead,
    hidden: torch.Tensor,
    probes: list[int],
    *,
    pinned: list[int] | tuple[int, ...] = (),
    postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
    batch: int = 256,
) -> list[ServingFidelity]:
    """The greedy figures of :func:`serving_fidelity` (same semantics) at every probe count, the dense reference
    computed once per batch of states (no sampling figures). Restores the head's ``n_probes``."""
    post = postprocess if postprocess is not None else (lambda x: x)
    device = head.weight.device
    hidden = hidden.to(device)
    served = hidden.to(head.weight.dtype)
    weight32 = reference_weight(head)
    pins = torch.tensor(
        sorted({int(i) for i in pinned if 0 <= int(i) < head.vocab_size}), dtype=torch.long, device=device
    )
    probes = sorted({min(p, head.num_clusters) for p in probes})
    agree, top5 = [0] * len(probes), [0] * len(probes)
    saved = head.n_probes
    try:
        for s in range(0, hidden.shape[0], batch):
            reference = post(torch.nn.functional.linear(hidden[s : s + batch].float(), weight32))
            best = reference.max(1).values
            dense_top5 = torch.topk(reference, 5, dim=1).indices
            for i, p in enumerate(probes):
                head.n_probes = p
                scored = torch.isfinite(head.step_logits(served[s : s + batch], pinned=pins, postprocess=postprocess))
                pick = torch.where(scored, reference, float("-inf")).argmax(1, keepdim=True)
                agree[i] += int((reference.gather(1, pick).squeeze(1) >= best).sum())
                top5[i] += int(scored.gather(1, dense_top5).sum())
        n = hidden.shape[0]
        results = []
        for i, p in enumerate(probes):
            head.n_probes = p
            results.append(
                ServingFidelity(
                    n_probes=p,
                    scored_fraction=head.scored_rows_per_step(sampled=False, pinned=int(pins.numel()))
                    / head.vocab_size,
                    top1_agreement=agree[i] / n,
                    top5_agreement=top5[i] / (5 * n),
                    stop_token_recall=None,
                    sampled_n_probes=head.sampled_n_probes,
                    sampled_rescore=head.sampled_rescore,
                    sampled_rank=head.sampled_rank,
                )
            )
    finally:
        head.n_probes = saved
    return results
