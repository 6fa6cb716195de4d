"""Serving fidelity: how close the logits serving hands to vLLM's sampler are to the dense head's.

:func:`serving_fidelity` measures :meth:`FlashHead.step_logits` (pinned ids included) per ``n_probes`` value:

* ``scored_fraction``: head rows scored per greedy row (centroids + candidates + pinned) / vocab.
* ``top1_agreement``: fraction of hidden states whose greedy pick is a dense argmax (the pick is the best
  exactly scored token in float32; a tie with the maximum agrees).
* ``top5_agreement``: fraction of the dense top-5 tokens scored exactly on a greedy row.
* ``stop_token_recall``: among rows whose dense argmax is a pinned id, the fraction FlashHead's
  greedy pick returns (``None`` when no row has one).
* ``sampling``: per (temperature, top_p), the total-variation distance ``1/2 sum |p - q|``
  (mean over rows) between the dense sampling distribution ``p`` and FlashHead's ``q``, both
  in vLLM's semantics and float32: logits / temperature, softmax, then top-p keeps the
  smallest set of most likely tokens whose probability reaches ``top_p`` and renormalises
  (:func:`sampling_distribution`); with the scored fraction of a sampled row.

The reference is the dense head in float32 (:func:`reference_weight`), with the model's own final-logit
soft-cap / scale (:func:`logit_postprocess`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .head import FlashHead

__all__ = [
    "SAMPLING_SETTINGS",
    "SamplingFidelity",
    "ServingFidelity",
    "reference_weight",
    "sampling_distribution",
    "total_variation",
    "serving_fidelity",
    "logit_postprocess",
    "format_fidelity_table",
]

#: (temperature, top_p) settings the sampling fidelity is measured at.
SAMPLING_SETTINGS: tuple[tuple[float, float], ...] = ((0.7, 0.9), (1.0, 1.0), (1.0, 0.95))


def reference_weight(head: FlashHead) -> torch.Tensor:
    """The head's rows upcast to float32 once: the eval's reference."""
    return head.weight[: head.vocab_size].float()


@dataclass
class SamplingFidelity:
    temperature: float
    top_p: float
    tv_distance: float
    scored_fraction: float
    tv_p90: float | None = None  # 90th percentile over states of the TV distance
    tv_max: float | None = None


@dataclass
class ServingFidelity:
    n_probes: int
    scored_fraction: float
    top1_agreement: float
    top5_agreement: float
    stop_token_recall: float | None
    sampled_n_probes: int
    sampling: list[SamplingFidelity] = field(default_factory=list)
    sampled_rescore: int = 0  # the best-estimated tokens a sampled row scores exactly
    sampled_rank: int = 0  # rank of a sampled row's estimate (0: -inf outside its exact tokens)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sampling_distribution(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``[B, V]`` float32 probabilities vLLM's sampler draws from: ``softmax(logits / temperature)``,
    then top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``
    (at least one) and renormalises.  ``-inf`` logits get probability 0."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if not 0 < top_p <= 1:
        raise ValueError("top_p must lie in (0, 1]")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    ranked, order = probs.sort(dim=-1, descending=True)
    ranked = ranked * ((ranked.cumsum(-1) - ranked) < top_p)  # the mass before a kept token is < top_p
    kept = torch.zeros_like(probs).scatter_(-1, order, ranked)
    return kept / kept.sum(-1, keepdim=True)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B]`` total-variation distance ``1/2 sum |p - q|`` between rows of two distributions."""
    return 0.5 * (p - q).abs().sum(-1)


def logit_postprocess(config: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The model's final-logit soft-cap / scale from its config.json, as vLLM applies it
    (``tanh(x / cap) * cap``, then ``* scale``); None when the model has neither.

    Reads ``final_logit_softcapping`` (Gemma-2/3), ``logit_scale`` (a multiplier) and
    ``logits_scaling`` (a divisor), top level or in ``text_config``.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def number(name: str) -> float | None:
        value = text.get(name, config.get(name))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None

    cap = number("final_logit_softcapping")
    scale = (number("logit_scale") or 1.0) / (number("logits_scaling") or 1.0)
    if cap is None and scale == 1.0:
        return None

    def postprocess(logits: torch.Tensor) -> torch.Tensor:
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits * scale if scale != 1.0 else logits

    return postprocess


def serving_fidelity(
    head: FlashHead,
    hidden: torch.Tensor,
    probes: list[int],
    *,
    pinned: list[int] | tuple[int, ...] = (),
    postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
    settings: tuple[tuple[float, float], ...] = SAMPLING_SETTINGS,
    batch: int = 256,
) -> list[ServingFidelity]:
    """Fidelity of the logits serving hands to vLLM (:meth:`FlashHead.step_logits`) per probe count.

    The reference is the dense head in float32 (``postprocess`` applied); FlashHead runs in the
    head's dtype with ``pinned`` ids scored on every row.  A greedy pick is the best exactly
    scored token in the reference's arithmetic (ties agree, as in :func:`~my_pkg.flashhead.evaluate.evaluate`).  Sampled
    rows use the head's ``sampled_n_probes`` (by default none below every cluster: their estimate
    chooses their exact tokens, so their figures do not change with ``n_probes`` until it is ``C``).
    Restores the head's ``n_probes`` afterwards.
    """
    post = postprocess if postprocess is not None else (lambda x: x)
    device = head.weight.device
    hidden = hidden.to(device)
    served = hidden.to(head.weight.dtype)
    weight32 = reference_weight(head)
    pins = torch.tensor(
        sorted({int(i) for i in pinned if 0 <= int(i) < head.vocab_size}), dtype=torch.long, device=device
    )
    n = hidden.shape[0]
    probes = sorted({min(p, head.num_clusters) for p in probes})
    saved = head.n_probes
    results = []
    try:
        for p in probes:
            head.n_probes = p
            agree = top5 = stop_rows = stop_hits = 0
            tv: list[list[torch.Tensor]] = [[] for _ in settings]
            sampled = torch.ones(min(batch, n), dtype=torch.bool)
            for s in range(0, n, batch):
                reference = post(torch.nn.functional.linear(hidden[s : s + batch].float(), weight32))
                h = served[s : s + batch]
                greedy = head.step_logits(h, pinned=pins, postprocess=postprocess)
                scored = torch.isfinite(greedy)
                pick = torch.where(scored, reference, float("-inf")).argmax(1, keepdim=True)
                best = reference.max(1).values
                hits = reference.gather(1, pick).squeeze(1) >= best
                agree += int(hits.sum())
                top5 += int(scored.gather(1, torch.topk(reference, 5, dim=1).indices).sum())
                if pins.numel():
                    stops = (reference.argmax(1, keepdim=True) == pins.view(1, -1)).any(1)
                    stop_rows += int(stops.sum())
                    stop_hits += int((stops & hits).sum())
                flash = head.step_logits(h, sampled=sampled[: h.shape[0]], pinned=pins, postprocess=postprocess)
                for i, (temperature, top_p) in enumerate(settings):
                    dense_p = sampling_distribution(reference, temperature, top_p)
                    flash_q = sampling_distribution(flash, temperature, top_p)
                    tv[i].append(total_variation(dense_p, flash_q).cpu())
            vocab = head.vocab_size
            sampled_fraction = head.scored_rows_per_step(sampled=True, pinned=int(pins.numel())) / vocab
            results.append(
                ServingFidelity(
                    n_probes=p,
                    scored_fraction=head.scored_rows_per_step(sampled=False, pinned=int(pins.numel())) / vocab,
                    top1_agreement=agree / n,
                    top5_agreement=top5 / (5 * n),
                    stop_token_recall=stop_hits / stop_rows if stop_rows else None,
                    sampled_n_probes=head.sampled_n_probes,
                    sampled_rescore=head.sampled_rescore,
                    sampled_rank=head.sampled_rank,
                    sampling=[
                        _sampling_fidelity(t, tp, torch.cat(tv[i]), sampled_fraction)
                        for i, (t, tp) in enumerate(settings)
                    ],
                )
            )
    finally:
        head.n_probes = saved
    return results


def _sampling_fidelity(temperature: float, top_p: float, tv: torch.Tensor, fraction: float) -> SamplingFidelity:
    tv = tv.double()
    return SamplingFidelity(
        temperature, top_p, float(tv.mean()), fraction, tv_p90=float(torch.quantile(tv, 0.9)), tv_max=float(tv.max())
    )


def format_fidelity_table(results: list[ServingFidelity]) -> str:
    """Markdown table of :func:`serving_fidelity` results."""
    settings = [(x.temperature, x.top_p) for x in results[0].sampling] if results else []
    head = (
        "| n_probes | scored (greedy) | top-1 agree | top-5 scored | stop recall | sampled rows: probes + exact "
        "tokens | scored (sampled) |"
    )
    head += "".join(f" TV T={t:g} top_p={tp:g} |" for t, tp in settings)
    lines = [head, "|---:" * (7 + len(settings)) + "|"]
    for r in results:
        stop = "n/a" if r.stop_token_recall is None else f"{r.stop_token_recall:.2%}"
        sampled = f"{r.sampling[0].scored_fraction:.1%}" if r.sampling else "n/a"
        tvs = "".join(
            f" {x.tv_distance:.4f} (p90 {x.tv_p90:.3f}, max {x.tv_max:.2f}) |"
            if x.tv_max is not None
            else f" {x.tv_distance:.4f} |"
            for x in r.sampling
        )
        lines.append(
            f"| {r.n_probes} | {r.scored_fraction:.1%} | {r.top1_agreement:.2%} | {r.top5_agreement:.2%} | "
            f"{stop} | {r.sampled_n_probes} + {r.sampled_rescore:,} | {sampled} |{tvs}"
        )
    return "\n".join(lines)
