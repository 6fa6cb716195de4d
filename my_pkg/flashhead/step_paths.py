"""The three ways :meth:`~my_pkg.flashhead.head.FlashHead.step_logits` scores a step's rows, pinned ids aside.

Contract: :func:`scored` gives ``[B, V]`` logits for ``hidden``, each greedy row the exact logits of its
``n_probes`` clusters' members and ``-inf`` elsewhere, each sampled row its estimate with the
``sampled_rescore`` best-estimated tokens and its ``sampled_n_probes`` clusters' members exact.  Which way
it takes never changes a row's logits, only how the head's rows are read:

* one pass: every row probes as many clusters (all greedy, all sampled, or equal counts);
* mixed: greedy rows and sampled rows that probe no cluster, their exact tokens scored in one pass over the
  head (a head row several rows need is read once; the torch backend);
* split: greedy rows and sampled rows scored apart, each kind in one pass.

Imports torch and numpy only; the head reaches it as an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .kernels import torch_ref
from .staging import index_tensor

if TYPE_CHECKING:
    from .head import FlashHead

__all__ = ["scored"]

PostProcess = Callable[[torch.Tensor], torch.Tensor]


def scored(
    head: FlashHead,
    hidden: torch.Tensor,
    probes: torch.Tensor | None,
    sampled: np.ndarray | None,
    width: int,
    post: PostProcess,
) -> torch.Tensor:
    """Step logits before the pinned ids; ``sampled`` marks the sampled rows (None: none), ``probes`` are the
    caller's (None: stage 1's) and ``width`` the clusters a one-pass batch probes (``probe_width``)."""
    if sampled is None or sampled.all() or head.sampled_n_probes == head.n_probes:
        # One pass: every row probes the same number of clusters, only the logits outside the
        # candidates differ.
        return _rows_logits(head, hidden, head.probes_for(hidden, probes, width), sampled, post)
    if head.sampled_n_probes == 0 and head.estimate.rank and head.sampled_rescore and head.backend == "torch":
        return _mixed_logits(head, hidden, probes, sampled, post)
    logits = torch.empty((hidden.shape[0], head.vocab_size), dtype=head.weight.dtype, device=hidden.device)
    for rows_sampled in (False, True):
        index = index_tensor(np.flatnonzero(sampled == rows_sampled), hidden.device)
        part_hidden = hidden.index_select(0, index)
        part_probes = None if probes is None else probes.index_select(0, index)
        part = _rows_logits(
            head,
            part_hidden,
            head.probes_for(part_hidden, part_probes, head.sampled_n_probes if rows_sampled else head.n_probes),
            np.ones(index.numel(), bool) if rows_sampled else None,
            post,
        )
        logits.index_copy_(0, index, part)
    return logits


def _rows_logits(
    head: FlashHead, hidden: torch.Tensor, probes: torch.Tensor, sampled: np.ndarray | None, post: PostProcess
) -> torch.Tensor:
    """Step logits before the pinned ids, each row probing the clusters ``probes``; ``sampled`` marks the
    sampled rows (None: none)."""
    if sampled is not None and bool(sampled.all()) and head.estimate.rank:
        # Every row samples: its rescored tail tokens are scored in the candidates' pass over the head.
        raw = head.estimate.tables().estimates(hidden)
        rescored = head.estimate.best(raw, torch_ref.candidate_ids(head.members, probes))
        if probes.shape[1] == 0:  # no candidates: the estimate chose every exact token
            if rescored is None:
                return post(raw).to(head.weight.dtype)
            ids, exact = rescored, head.candidate_rows.token_logits(hidden, rescored)
        else:
            ids, exact = head.candidate_rows.candidate_logits(hidden, probes, extra_ids=rescored)
        return post(raw).to(exact.dtype).scatter_(1, ids, post(exact))
    ids, exact = head.candidate_rows.candidate_logits(hidden, probes)
    exact = post(exact)
    out = torch.full((hidden.shape[0], head.vocab_size), float("-inf"), dtype=exact.dtype, device=hidden.device)
    if sampled is not None and head.estimate.rank:
        index = index_tensor(np.flatnonzero(sampled), hidden.device)
        out.index_copy_(
            0,
            index,
            _estimates(head, hidden.index_select(0, index), ids.index_select(0, index), post, exact.dtype),
        )
    return out.scatter_(1, ids, exact)


def _mixed_logits(
    head: FlashHead, hidden: torch.Tensor, probes: torch.Tensor | None, sampled: np.ndarray, post: PostProcess
) -> torch.Tensor:
    """Step logits before the pinned ids of a batch of greedy rows and sampled rows that probe no cluster:
    the greedy rows' candidates and the sampled rows' best-estimated tokens scored in one pass over the
    head (a head row that several rows need is read once), the same logits as each kind alone."""
    greedy = index_tensor(np.flatnonzero(~sampled), hidden.device)
    rows_sampled = index_tensor(np.flatnonzero(sampled), hidden.device)
    greedy_hidden = hidden.index_select(0, greedy)
    chosen = None if probes is None else probes.index_select(0, greedy)
    candidates = torch_ref.candidate_ids(head.members, head.probes_for(greedy_hidden, chosen, head.n_probes))
    raw = head.estimate.tables().estimates(hidden.index_select(0, rows_sampled))
    best = head.estimate.best(raw, candidates.new_empty((raw.shape[0], 0)))  # no candidates of their own
    assert best is not None  # sampled_rescore > 0
    # One [B, N] id matrix; the narrower kind repeats its last id (scored and written twice, same value).
    width = max(candidates.shape[1], best.shape[1])
    ids = torch.empty((hidden.shape[0], width), dtype=torch.int64, device=hidden.device)
    for index, part in ((greedy, candidates), (rows_sampled, best)):
        ids.index_copy_(0, index, torch.cat([part, part[:, -1:].expand(-1, width - part.shape[1])], 1))
    exact = post(head.candidate_rows.token_logits(hidden, ids, has_candidates=True))
    out = torch.full((hidden.shape[0], head.vocab_size), float("-inf"), dtype=exact.dtype, device=hidden.device)
    out.index_copy_(0, rows_sampled, post(raw).to(exact.dtype))
    return out.scatter_(1, ids, exact)


def _estimates(
    head: FlashHead, hidden: torch.Tensor, ids: torch.Tensor, post: PostProcess, dtype: torch.dtype
) -> torch.Tensor:
    """``[B, V]`` estimated logits of sampled rows; the ``sampled_rescore`` best-estimated tokens outside
    the candidates ``ids`` are scored exactly (the tail tokens most likely to carry mass)."""
    raw = head.estimate.tables().estimates(hidden)
    best = head.estimate.best(raw, ids)
    out = post(raw).to(dtype)
    if best is not None:
        out.scatter_(1, best, post(head.candidate_rows.token_logits(hidden, best)).to(dtype))
    return out
