"""Accuracy/speed sweep of FlashHead against the dense head, per ``n_probes`` value (:func:`evaluate`).

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

Hidden states come from a ``.safetensors`` file (:func:`load_hidden_states`) or from running the local
Hugging Face model on a text (:func:`~my_pkg.flashhead.hf.capture_hidden_states`: final hidden state after
the last norm, every position); :mod:`.synthetic` makes synthetic ones. The logits serving hands to vLLM's
sampler are measured by :mod:`.fidelity`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .fidelity import reference_weight
from .head import FlashHead
from .spec import rows_scored

__all__ = [
    "EvalRow",
    "evaluate",
    "dense_agreement",
    "load_hidden_states",
    "format_table",
]


@dataclass
class EvalRow:
    n_probes: int
    scored_rows: int
    top1: float
    top5_in: float
    ms: float
    sampled_ms: float | None = None


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


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def dense_agreement(head: FlashHead, hidden: torch.Tensor, *, batch: int = 256) -> float:
    """Fraction of rows where the dense head in its own dtype picks a float32 argmax (ties agree)."""
    hidden = hidden.to(head.weight.device)
    weight32 = reference_weight(head)
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
    weight32 = reference_weight(head)
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
