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
* ``ms``: time of one FlashHead greedy step at batch 1 (median), next to the dense step.

Hidden states come from a ``.safetensors`` file, from running the local Hugging Face
model on a text file (final hidden state after the last norm, every position), or are
synthetic (see :func:`synthetic_hidden_states`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .head import FlashHead

__all__ = ["EvalRow", "evaluate", "dense_agreement", "synthetic_hidden_states", "synthetic_head", "load_hidden_states",
           "capture_hidden_states", "format_table"]


@dataclass
class EvalRow:
    n_probes: int
    scored_rows: int
    top1: float
    top5_in: float
    ms: float


def synthetic_hidden_states(weight: torch.Tensor, n: int, *, noise: float = 1.0, seed: int = 0,
                            vocab_size: int | None = None) -> torch.Tensor:
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
    hid = unit + noise * torch.randn(n, h, generator=g) / h ** 0.5
    scale = 3.0 * h ** 0.5 / float(norms.mean())
    return hid * scale


def synthetic_head(vocab_size: int, hidden_size: int, *, topics: int | None = None, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
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


def capture_hidden_states(model_dir: str | Path, text: str, *, max_tokens: int = 2048,
                          device: str = "cpu", chunk: int = 512) -> torch.Tensor:
    """Run the local HF model on ``text`` and return the final (normed) hidden state of every position.

    ``output_hidden_states`` ends with the state after the model's final norm for Llama-style models;
    this is verified against the model's own logits, and the final norm is applied when it is not.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    ids = tok(text, return_tensors="pt").input_ids[0][:max_tokens]
    if ids.numel() == 0:
        raise ValueError("the text produced no tokens")
    outs = []
    head = model.get_output_embeddings()
    with torch.no_grad():
        for s in range(0, ids.numel(), chunk):
            piece = ids[s:s + chunk].unsqueeze(0).to(device)
            out = model(piece, output_hidden_states=True)
            hs = out.hidden_states[-1][0]
            if not torch.allclose(head(hs).float(), out.logits[0].float(), rtol=1e-3, atol=1e-3):
                norm = getattr(getattr(model, "model", None), "norm", None)
                if norm is None or not torch.allclose(head(norm(hs)).float(), out.logits[0].float(),
                                                      rtol=1e-3, atol=1e-3):
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
        h = hidden[s:s + batch]
        reference = torch.nn.functional.linear(h.float(), weight32)
        pick = head.dense_logits(h.to(head.weight.dtype)).argmax(1, keepdim=True)
        agree += int((reference.gather(1, pick).squeeze(1) >= reference.max(1).values).sum())
    return agree / hidden.shape[0]


def evaluate(head: FlashHead, hidden: torch.Tensor, probes: list[int], *, batch: int = 256,
             time_repeats: int = 5) -> tuple[list[EvalRow], float]:
    """Sweep ``probes``; return the rows and the dense step time (ms, batch 1).

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
        reference = torch.nn.functional.linear(hidden[s:s + batch].float(), weight32)
        top5 = torch.topk(reference, 5, dim=1).indices
        best_dense = reference.max(dim=1).values
        h = served[s:s + batch]
        for i, p in enumerate(probes):
            ids, _ = head.candidate_logits(h, head.select_probes(h, n_probes=p))
            agree[i] += int((reference.gather(1, ids.long()).max(1).values >= best_dense).sum())
            contained[i] += int((top5.unsqueeze(2) == ids.unsqueeze(1)).any(dim=2).sum())
    one = served[:1]
    dense_ms = _time_ms(lambda: head.dense_logits(one).argmax(1), time_repeats)
    n = hidden.shape[0]
    rows = []
    for i, p in enumerate(probes):
        ms = _time_ms(lambda: head.greedy(one, head.select_probes(one, n_probes=p)), time_repeats)
        rows.append(EvalRow(p, head.num_clusters + p * head.cluster_size, agree[i] / n, contained[i] / (5 * n), ms))
    return rows, dense_ms


def format_table(rows: list[EvalRow], dense_ms: float, vocab_size: int) -> str:
    """Markdown table of an evaluation sweep."""
    lines = ["| n_probes | scored rows | share of vocab | top-1 agree | top-5 in candidates | ms/step (B=1) | speed-up |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.n_probes} | {r.scored_rows:,} | {r.scored_rows / vocab_size:.1%} | {r.top1:.2%} | "
                     f"{r.top5_in:.2%} | {r.ms:.2f} | {dense_ms / r.ms:.2f}x |")
    lines.append(f"| dense | {vocab_size:,} | 100% | 100% | 100% | {dense_ms:.2f} | 1.00x |")
    return "\n".join(lines)
