"""A head's sampled-row estimate: its rank, its rescored tokens and its tables, built once on first use.

Contract: :class:`SampledEstimate` holds what a :class:`~my_pkg.flashhead.head.FlashHead` needs to give a
sampled row every token's estimated logit (:mod:`~my_pkg.flashhead.tail_estimate`): the rank ``r``
(default :func:`~my_pkg.flashhead.spec.default_sampled_rank`), how many best-estimated tokens are scored
exactly (default :func:`~my_pkg.flashhead.spec.default_sampled_rescore`) and the ``[V, r]`` tables, built
from the fitted factors when they reach the rank, else by the weight-only fit.  Changing the rank drops the
tables; the next sampled row builds them again.

Imports torch only.
"""

from __future__ import annotations

import torch

from .spec import default_sampled_rank, default_sampled_rescore, tail_fitted
from .tail_estimate import TailFactors, TailTables, build_tail_tables, top_k_ids

__all__ = ["SampledEstimate"]


class SampledEstimate:
    """The estimate of sampled rows over the first ``vocab_size`` rows of ``weight``.

    Args:
        weight: ``[V', H]`` head weight (a reference is kept).
        vocab_size: tokens ``V <= V'``.
        factors: the estimate fitted to calibration states (None: weight-only at every rank).
        rank: ``0..H`` (0: no estimate), None for the default.
    """

    def __init__(
        self, weight: torch.Tensor, vocab_size: int, factors: TailFactors | None, rank: int | None = None
    ) -> None:
        self._weight = weight
        self._vocab_size = vocab_size
        self._hidden_size = int(weight.shape[1])
        self._factors = factors
        #: The tables, once a sampled row needed them (None before).
        self.built: TailTables | None = None
        self._rescore: int | None = None
        self._rank = default_sampled_rank(vocab_size, self._hidden_size, fitted_rank=self.fitted_rank)
        if rank is not None:
            self.rank = rank

    @property
    def fitted_rank(self) -> int:
        """Rank of the fitted factors (0: none)."""
        return self._factors.rank if self._factors is not None else 0

    @property
    def rank(self) -> int:
        """Rank of the head approximation behind a sampled row's estimated logits (0: ``-inf`` instead)."""
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= self._hidden_size:
            raise ValueError(f"sampled_rank must be an int in [0, {self._hidden_size}], got {value!r}")
        if value != self._rank:
            self.built = None
        self._rank = value

    @property
    def fitted(self) -> bool:
        """Whether the estimate is the one fitted to calibration states (else weight-only)."""
        return tail_fitted(self._rank, self._vocab_size, self.fitted_rank)

    @property
    def rescore(self) -> int:
        """Tokens outside a sampled row's candidates scored exactly: those with the best estimated logits."""
        if self._rescore is None:
            return default_sampled_rescore(self._vocab_size, fitted=self.fitted)
        return self._rescore

    @rescore.setter
    def rescore(self, value: int | None) -> None:
        valid = not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= self._vocab_size
        if value is not None and not valid:
            raise ValueError(f"sampled_rescore must be an int in [0, {self._vocab_size}], got {value!r}")
        self._rescore = value

    def tables(self) -> TailTables:
        """The ``[V, r]`` tables at the current rank, built on the first call."""
        if self.built is None:
            rank = min(self._rank, self._vocab_size)
            if self.fitted:
                assert self._factors is not None
                self.built = TailTables.from_factors(self._weight, self._vocab_size, self._factors.truncated(rank))
            else:
                self.built = build_tail_tables(self._weight, self._vocab_size, rank)
        return self.built

    def best(self, raw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """``[B, k]`` the :attr:`rescore` tokens outside the candidates ``ids`` with the best raw estimates
        (None when there are none), chosen before the logit post-processing (a soft-cap can tie large
        estimates, the raw ones rank them).  Sets ``raw`` to ``-inf`` at ``ids`` in place: the caller writes
        their exact logits there."""
        raw.scatter_(1, ids, float("-inf"))
        k = min(self.rescore, self._vocab_size - ids.shape[1])
        return top_k_ids(raw, k) if k > 0 else None
