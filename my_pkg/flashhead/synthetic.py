"""Synthetic inputs for the eval, the tests and the benchmarks: hidden states that point at head rows, and a
random head with LM-like structure. Deterministic for a seed."""

from __future__ import annotations

import torch

__all__ = ["synthetic_hidden_states", "synthetic_head"]


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
