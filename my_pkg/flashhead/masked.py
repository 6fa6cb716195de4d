"""The masked way to a step's FlashHead rows: the dense head's logits, masked to FlashHead's answer.

Contract: :func:`masked_logits` gives :meth:`~my_pkg.flashhead.head.FlashHead.step_logits`'s answer for
the same rows, made from ``exact`` (``[B, >= V]``: every token's post-processed logit, e.g. the dense
head's product) instead of FlashHead's own scoring.  Each row keeps exactly the tokens ``step_logits``
scores exactly (:meth:`~my_pkg.flashhead.head.FlashHead.exact_tokens`: a greedy row its candidates, a
sampled row its candidates and best-estimated tokens; every row the ``pinned`` ids), with their values
read from ``exact``; everything else is what ``step_logits`` gives there (``-inf``, or a sampled row's
estimate).  The same tokens, chosen the same way; the exact values are equal up to how the two products
round (bit for bit where they round alike, as a bfloat16 head does).  Serving uses it when the dense
product is the cheaper way to a step's FlashHead rows: which kernel serves a step never changes a row's
answer.

Imports torch and numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .staging import host_mask, index_tensor

if TYPE_CHECKING:
    from .head import FlashHead

__all__ = ["masked_logits"]


def masked_logits(
    head: FlashHead,
    hidden: torch.Tensor,
    exact: torch.Tensor,
    *,
    sampled: torch.Tensor | np.ndarray | None = None,
    pinned: torch.Tensor | None = None,
    postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
    probes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, V]``: ``head``'s step logits for ``hidden``, their exact values read from ``exact`` (see the module
    docstring); ``sampled``, ``pinned``, ``postprocess`` and ``probes`` as in ``step_logits``."""
    hidden = head.check_hidden(hidden)
    num_rows, vocab_size = hidden.shape[0], head.vocab_size
    if exact.dim() != 2 or exact.shape[0] != num_rows or exact.shape[1] < vocab_size:
        raise ValueError(f"exact must be [{num_rows}, >= {vocab_size}], got {tuple(exact.shape)}")
    exact = exact[:, :vocab_size]
    mask = host_mask(sampled, num_rows)
    if mask is None:
        mask = np.zeros(num_rows, dtype=bool)
    out = None
    for rows_sampled in (False, True):
        chosen = np.flatnonzero(mask == rows_sampled)
        if not chosen.size:
            continue
        whole = chosen.size == num_rows  # one kind of row: no copies in and out
        index = None if whole else index_tensor(chosen, hidden.device)
        part_hidden = hidden if index is None else hidden.index_select(0, index)
        part_exact = exact if index is None else exact.index_select(0, index)
        part_probes = probes if probes is None or index is None else probes.index_select(0, index)
        ids, raw = head.exact_tokens(part_hidden, part_probes, sampled=rows_sampled)
        if raw is not None:
            part = (postprocess(raw) if postprocess is not None else raw).to(exact.dtype)
        else:
            part = torch.full_like(part_exact, float("-inf"))
        part.scatter_(1, ids, part_exact.gather(1, ids))
        if index is None:
            out = part
        else:
            if out is None:
                out = torch.empty_like(exact)
            out.index_copy_(0, index, part)
    assert out is not None  # at least one row
    if pinned is not None and pinned.numel():
        out[:, pinned] = exact[:, pinned]
    return out
