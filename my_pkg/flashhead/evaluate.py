"""Accuracy/speed evaluation of FlashHead against the dense head.

Metrics per ``n_probes`` value:

* ``top1``: fraction of hidden states whose FlashHead greedy token is a dense argmax.
* ``top5_in``: fraction of the dense top-5 tokens that are among FlashHead's scored
  candidates (what sampling from the sparse logits can reach).

The reference is the dense head in float32 (weight and hidden states upcast),
whatever the checkpoint's dtype. FlashHead chooses its clusters as serving
does, in the head's dtype; its pick is the best candidate in the same float32
arithmetic, and a pick whose float32 logit equals the maximum (a tie) agrees.
So ``top1`` measures FlashHead's approximation alone (exactly 1 when every
cluster is probed); how often the dense head itself, in a low-precision dtype,
picks another token than float32 is reported apart (:func:`dense_agreement`):
counting those rounding flips against FlashHead under-reports it.
* ``rows``: rows scored per step (``C`` centroids + ``P * cluster_size`` candidates).
* ``ms`` / ``sampled_ms``: time of one :meth:`FlashHead.step_logits` call at batch 1 for a greedy /
  a sampled row (median; the ``[1, V]`` logits serving hands to the sampler), next to the dense step
  (``F.linear`` into the same ``[1, V]`` logits).

Serving fidelity (:func:`serving_fidelity`) measures the logits serving hands to vLLM's
sampler (:meth:`FlashHead.step_logits`, pinned ids included) per ``n_probes`` value:

* ``scored_fraction``: head rows scored per greedy row (centroids + candidates + pinned) / vocab.
* ``top1_agreement``: as ``top1`` above, with the pinned ids among the candidates.
* ``top5_agreement``: fraction of the dense top-5 tokens scored exactly on a greedy row.
* ``stop_token_recall``: among rows whose dense argmax is a pinned id, the fraction FlashHead's
  greedy pick returns (``None`` when no row has one).
* ``sampling``: per (temperature, top_p), the total-variation distance ``1/2 sum |p - q|``
  (mean over rows) between the dense sampling distribution ``p`` and FlashHead's ``q``, both
  in vLLM's semantics and float32: logits / temperature, softmax, then top-p keeps the
  smallest set of most likely tokens whose probability reaches ``top_p`` and renormalises
  (:func:`sampling_distribution`); with the scored fraction of a sampled row.

Hidden states come from a ``.safetensors`` file, from running the local Hugging Face
model on a text file (final hidden state after the last norm, every position), or are
synthetic (see :func:`synthetic_hidden_states`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .head import FlashHead
from .spec import rows_scored

__all__ = [
    "EvalRow",
    "evaluate",
    "dense_agreement",
    "synthetic_hidden_states",
    "synthetic_head",
    "load_hidden_states",
    "capture_hidden_states",
    "format_table",
    "SAMPLING_SETTINGS",
    "SamplingFidelity",
    "ServingFidelity",
    "sampling_distribution",
    "total_variation",
    "serving_fidelity",
    "logit_postprocess",
    "format_fidelity_table",
    "FidelityCurves",
    "fidelity_curves",
    "plot_probe_counts",
]

#: (temperature, top_p) settings the sampling fidelity is measured at.
SAMPLING_SETTINGS: tuple[tuple[float, float], ...] = ((0.7, 0.9), (1.0, 1.0), (1.0, 0.95))


@dataclass
class EvalRow:
    n_probes: int
    scored_rows: int
    top1: float
    top5_in: float
    ms: float
    sampled_ms: float | None = None


def synthetic_hidden_states(
    weight: torch.Tensor, n: int, *, noise: float = 1.0, seed: int = 0, vocab_size: int | None = None
) -> torch.Tensor:
    """Hidden states that point at a target head row, like a confident LM.

    For a random target row ``t``: ``h = scale * (unit(w_t) + noise * g / sqrt(H))`` with
    ``g ~ N(0, I)``, i.e. cosine ~ ``1/sqrt(1 + noise^2)`` with the target row.  ``scale`` makes
    the target logit about ``3 * sqrt(H)`` / mean row norm so the softmax is peaked.  Targets are
    drawn with probability proportional to row norm (frequent tokens have larger rows).
    """
    g = torch.Generator().manual_seed(seed)
    v = weight.shape[0] if vocab_size is None else vocab_size
    w = weight[:v].float()
    norms = w.norm(dim=1)
    targets = torch.multinomial(norms / norms.sum(), n, replacement=True, generator=g)
    h = weight.shape[1]
    unit = torch.nn.functional.normalize(w[targets], dim=1)
    hid = unit + noise * torch.randn(n, h, generator=g) / h**0.5
    scale = 3.0 * h**0.5 / float(norms.mean())
    return hid * scale


def synthetic_head(
    vocab_size: int, hidden_size: int, *, topics: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A random head with LM-like structure: rows belong to Zipf-sized "topics"
    (shared direction plus per-row noise with a decaying spectrum) and have log-normal norms.
    Generated in chunks; deterministic for the seed."""
    g = torch.Generator().manual_seed(seed)
    t = topics or max(2, vocab_size // 64)
    spectrum = (torch.arange(hidden_size, dtype=torch.float32) + 1.0) ** -0.35
    spectrum = spectrum[torch.randperm(hidden_size, generator=g)]
    centers = torch.nn.functional.normalize(torch.randn(t, hidden_size, generator=g) * spectrum, dim=1)
    common = torch.nn.functional.normalize(torch.randn(hidden_size, generator=g), dim=0)
    zipf = 1.0 / (torch.arange(t, dtype=torch.float64) + 1.0) ** 0.8
    topic = torch.multinomial(zipf / zipf.sum(), vocab_size, replacement=True, generator=g)
    out = torch.empty(vocab_size, hidden_size, dtype=dtype)
    for s in range(0, vocab_size, 16384):
        e = min(vocab_size, s + 16384)
        noise = torch.nn.functional.normalize(torch.randn(e - s, hidden_size, generator=g) * spectrum, dim=1)
        rows = 0.55 * centers[topic[s:e]] + 0.75 * noise + 0.25 * common
        norms = torch.exp(0.25 * torch.randn(e - s, 1, generator=g))
        out[s:e] = (torch.nn.functional.normalize(rows, dim=1) * norms).to(dtype)
    return out


def load_hidden_states(path: str | Path) -> torch.Tensor:
    """``[N, H]`` hidden states from a safetensors file (the first 2-D tensor, or key ``hidden_states``)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        key = "hidden_states" if "hidden_states" in keys else None
        if key is None:
            for k in keys:
                if len(f.get_slice(k).get_shape()) == 2:
                    key = k
                    break
        if key is None:
            raise ValueError(f"{path}: no 2-D tensor found (keys: {keys})")
        return f.get_tensor(key).float()


def capture_hidden_states(
    model_dir: str | Path,
    text: str,
    *,
    max_tokens: int = 2048,
    device: str = "cpu",
    chunk: int = 512,
    progress: bool = False,
) -> torch.Tensor:
    """Run the local HF model on ``text`` and return the final (normed) hidden state of every position.

    ``output_hidden_states`` ends with the state after the model's final norm for Llama-style models;
    this is verified against the model's own logits, and the final norm is applied when it is not.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:  # positions past the trained context give states serving never sees
        chunk = min(chunk, context)
    ids = tok(text, return_tensors="pt").input_ids[0][:max_tokens]
    if ids.numel() == 0:
        raise ValueError("the text produced no tokens")
    outs = []
    head = model.get_output_embeddings()
    with torch.no_grad():
        for s in tqdm(range(0, ids.numel(), chunk), desc="hidden states", unit="chunk", disable=not progress):
            piece = ids[s : s + chunk].unsqueeze(0).to(device)
            out = model(piece, output_hidden_states=True)
            hs = out.hidden_states[-1][0]
            if not torch.allclose(head(hs).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
                norm = getattr(getattr(model, "model", None), "norm", None)
                if norm is None or not torch.allclose(
                    head(norm(hs)).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3
                ):
                    raise RuntimeError("cannot reproduce the model's logits from its last hidden state")
                hs = norm(hs)
            outs.append(hs.float().cpu())
    return torch.cat(outs)


def _time_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _float32_weight(head: FlashHead) -> torch.Tensor:
    """The head's rows upcast to float32 once: the eval's reference."""
    return head.weight[: head.vocab_size].float()


def dense_agreement(head: FlashHead, hidden: torch.Tensor, *, batch: int = 256) -> float:
    """Fraction of rows where the dense head in its own dtype picks a float32 argmax (ties agree)."""
    hidden = hidden.to(head.weight.device)
    weight32 = _float32_weight(head)
    agree = 0
    for s in range(0, hidden.shape[0], batch):
        h = hidden[s : s + batch]
        reference = torch.nn.functional.linear(h.float(), weight32)
        pick = head.dense_logits(h.to(head.weight.dtype)).argmax(1, keepdim=True)
        agree += int((reference.gather(1, pick).squeeze(1) >= reference.max(1).values).sum())
    return agree / hidden.shape[0]


def evaluate(
    head: FlashHead,
    hidden: torch.Tensor,
    probes: list[int],
    *,
    batch: int = 256,
    time_repeats: int = 5,
    pinned: torch.Tensor | None = None,
    postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[EvalRow], float]:
    """Sweep ``probes``; return the rows and the dense step time (ms, batch 1).

    Timing is of what serving calls: ``head.step_logits`` on one row (greedy, then sampled) with
    ``pinned`` ids and ``postprocess``, against the dense head into the same ``[1, V]`` logits.

    ``hidden`` is taken at the precision given (float32 hidden states stay
    float32 for the reference); FlashHead sees it cast to the head's dtype.
    One pass over the states: each batch's reference logits serve every probe count.
    """
    hidden = hidden.to(head.weight.device)
    served = hidden.to(head.weight.dtype)
    weight32 = _float32_weight(head)
    probes = [min(p, head.num_clusters) for p in probes]
    agree = [0] * len(probes)
    contained = [0] * len(probes)
    for s in range(0, hidden.shape[0], batch):
        reference = torch.nn.functional.linear(hidden[s : s + batch].float(), weight32)
        top5 = torch.topk(reference, 5, dim=1).indices
        best_dense = reference.max(dim=1).values
        h = served[s : s + batch]
        for i, p in enumerate(probes):
            ids, _ = head.candidate_logits(h, head.select_probes(h, n_probes=p))
            agree[i] += int((reference.gather(1, ids.long()).max(1).values >= best_dense).sum())
            contained[i] += int((top5.unsqueeze(2) == ids.unsqueeze(1)).any(dim=2).sum())
    one = served[:1]
    post = postprocess if postprocess is not None else (lambda x: x)
    pins = None if pinned is None else torch.as_tensor(pinned, dtype=torch.int64, device=one.device)
    dense_ms = _time_ms(lambda: post(head.dense_logits(one)), time_repeats)
    n = hidden.shape[0]
    rows = []
    kept = head.n_probes
    try:
        for i, p in enumerate(probes):
            head.n_probes = p
            ms = _time_ms(lambda: head.step_logits(one, pinned=pins, postprocess=postprocess), time_repeats)
            sampled_ms = _time_ms(
                lambda: head.step_logits(one, sampled=[True], pinned=pins, postprocess=postprocess), time_repeats
            )
            rows.append(
                EvalRow(
                    p,
                    rows_scored(head.num_clusters, p, head.cluster_size),
                    agree[i] / n,
                    contained[i] / (5 * n),
                    ms,
                    sampled_ms,
                )
            )
    finally:
        head.n_probes = kept
    return rows, dense_ms


def format_table(rows: list[EvalRow], dense_ms: float, vocab_size: int) -> str:
    """Markdown table of an evaluation sweep."""
    lines = [
        "| n_probes | scored rows | share of vocab | top-1 agree | top-5 in candidates | greedy ms (B=1) | speed-up "
        "| sampled ms (B=1) | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        sampled = f"{r.sampled_ms:.2f} | {dense_ms / r.sampled_ms:.2f}x" if r.sampled_ms else "n/a | n/a"
        lines.append(
            f"| {r.n_probes} | {r.scored_rows:,} | {r.scored_rows / vocab_size:.1%} | {r.top1:.2%} | "
            f"{r.top5_in:.2%} | {r.ms:.2f} | {dense_ms / r.ms:.2f}x | {sampled} |"
        )
    lines.append(f"| dense | {vocab_size:,} | 100% | 100% | 100% | {dense_ms:.2f} | 1.00x | {dense_ms:.2f} | 1.00x |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- serving fidelity


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
    scored token in the reference's arithmetic (ties agree, as in :func:`evaluate`).  Sampled
    rows use the head's ``sampled_n_probes`` (by default none below every cluster: their estimate
    chooses their exact tokens, so their figures do not change with ``n_probes`` until it is ``C``).
    Restores the head's ``n_probes`` afterwards.
    """
    post = postprocess if postprocess is not None else (lambda x: x)
    device = head.weight.device
    hidden = hidden.to(device)
    served = hidden.to(head.weight.dtype)
    weight32 = _float32_weight(head)
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


# ------------------------------------------------------------------------------------------- curves


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
    weight32 = _float32_weight(head)
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
