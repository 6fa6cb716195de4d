"""The FlashHead two-stage LM head.

Stage 1 scores the ``C`` cluster centroids (``hidden @ centroids.T``) and keeps the ``P`` best
probes; stage 2 computes the exact logits of the ``P * cluster_size`` member rows of the
probed clusters, reading them through the cluster map from the head weight on an accelerator,
and from a copy of its rows in cluster order on CPU (:mod:`~my_pkg.flashhead.cluster_rows`).

:meth:`FlashHead.step_logits` builds what serving hands to the sampler for one decode step:

* greedy rows: exact logits of the top ``n_probes`` clusters' members, ``-inf`` elsewhere (the
  argmax is the best candidate, the smallest id on ties);
* sampled rows: every token an *estimated* logit from a rank-``r`` approximation of the head
  (:mod:`~my_pkg.flashhead.tail_estimate`), except the ``sampled_rescore`` tokens with the best
  estimates, which are scored exactly.  By default (``sampled_n_probes`` 0) the estimate alone
  chooses those tokens and a sampled row skips stage 1; with ``sampled_n_probes`` > 0 the members of
  that many top clusters are scored exactly too.  The sampler then sees an approximate full
  distribution: the tokens outside the exact ones keep about their share of the probability mass
  instead of losing it, and the sampler's own temperature, top-k/top-p and min-p apply to the whole
  row.  Nothing is random, so a seeded request reproduces;
* both: the ``pinned`` ids (EOS, special and stop tokens) are scored exactly on every row.

A batch of several rows is scored cluster by cluster on CPU (each probed head row read once for
every row that probes it, :mod:`~my_pkg.flashhead.kernels.torch_ref`), with the same logits bit for
bit as row by row: a request's logits do not depend on the batch it is in, and a large batch costs
about the head's union of candidates instead of ``B`` times each row's.

Its parts live beside it: the defaults of its parameters (:mod:`~my_pkg.flashhead.spec`), the cluster map
(:mod:`~my_pkg.flashhead.cluster_rows`), stage 2's reads (:mod:`~my_pkg.flashhead.candidates`), the sampled
rows' estimate (:mod:`~my_pkg.flashhead.sampled`), the ways through a step's batch
(:mod:`~my_pkg.flashhead.step_paths`) and the same answer made from the dense logits
(:mod:`~my_pkg.flashhead.masked`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from . import step_paths
from .candidates import CandidateRows
from .cluster_rows import ClusterRows, build_members
from .kernels import KernelOps, load_ops, resolve_backend, torch_ref
from .kernels.torch_ref import CpuPlan
from .layout import hidden_major
from .probes import select_probes as top_probes
from .sampled import SampledEstimate
from .spec import HeadSettings, HeadSpec, resolve_sampled_n_probes, rows_scored
from .staging import host_mask
from .tail_estimate import TailFactors, TailTables

__all__ = ["FlashHead", "PinnedIds"]


class PinnedIds(NamedTuple):
    """Token ids scored exactly on every row of a step, with their rows of the head weight (a caller that pins
    the same ids every step keeps the rows instead of gathering them per step)."""

    ids: torch.Tensor
    rows: torch.Tensor


class FlashHead:
    """Two-stage (clustered) LM head over an existing head weight.

    Args:
        weight: ``[V', H]`` head weight; may have more rows than the vocabulary (padding).
            Only a reference is kept.
        centroids: ``[C, H]`` stage-1 scoring vectors (stored in the weight's dtype and device).
        assignments: ``[V]`` cluster id of each vocabulary row.
        vocab_size: vocabulary size ``V`` (default: ``len(assignments)``); ``V <= V'``.
        n_probes: clusters scored exactly per step, ``1..C``.
        sampled_n_probes: clusters scored exactly for a sampled row in :meth:`step_logits`
            (``0..C``; default :func:`~my_pkg.flashhead.spec.default_sampled_n_probes`: 0 while sampled rows have an
            estimate, else following ``n_probes``).  0 needs the estimate: at ``sampled_rank`` 0 a
            sampled row probes ``n_probes``.
        sampled_rank: rank of the head approximation that estimates a sampled row's unprobed
            logits (``0..H``, 0: ``-inf`` instead; default :func:`~my_pkg.flashhead.spec.default_sampled_rank`).  Its
            tables are built on the first sampled row (a randomized SVD of the head, once).
        tail_factors: the estimate fitted to calibration states (the assets' ``tail_estimate.safetensors``);
            used at every ``sampled_rank`` up to its rank, above it (or when None) the weight-only fit.
        backend: ``"auto"`` or a registered backend name (:mod:`~my_pkg.flashhead.kernels`:
            ``"torch"``, ``"triton"``); ``auto`` takes Triton for CUDA tensors when it imports, else torch.
        allow_empty_clusters: accept clusters without a member (a head over one vocabulary shard
            of a tensor-parallel model, with the global centroids and the shard's assignments).
        cluster_rows: score candidates from a copy of the head's rows in cluster order
            (:mod:`~my_pkg.flashhead.cluster_rows`: the same logits, read in runs; one more copy of the
            token rows).  CPU only; default: on a CPU head scored by the torch backend.
        cpu_plan: where the torch backend's CPU path switches ways (:class:`~.kernels.torch_ref.CpuPlan`; the same
            logits, another speed); default :data:`~.kernels.torch_ref.DEFAULT_PLAN`.

    All methods accept any batch ``B >= 1``; on an accelerator they do no host synchronisation.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        centroids: torch.Tensor,
        assignments: torch.Tensor,
        *,
        vocab_size: int | None = None,
        n_probes: int,
        backend: str = "auto",
        sampled_n_probes: int | None = None,
        sampled_rank: int | None = None,
        allow_empty_clusters: bool = False,
        tail_factors: TailFactors | None = None,
        cluster_rows: bool | None = None,
        cpu_plan: CpuPlan | None = None,
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        if centroids.dim() != 2 or centroids.shape[1] != weight.shape[1]:
            raise ValueError(f"centroids must be [C, {weight.shape[1]}], got {tuple(centroids.shape)}")
        if assignments.dim() != 1:
            raise ValueError("assignments must be 1-D")
        v = assignments.numel() if vocab_size is None else int(vocab_size)
        if assignments.numel() != v:
            raise ValueError(f"assignments has {assignments.numel()} entries, vocab_size is {v}")
        if v > weight.shape[0]:
            raise ValueError(f"vocab_size {v} exceeds the head's {weight.shape[0]} rows")
        c = centroids.shape[0]
        members = build_members(assignments, c, allow_empty=allow_empty_clusters)
        self.weight = weight
        # Hidden-major on CPU in float32, where stage 1 streams them faster (layout.py).
        self.centroids = hidden_major(centroids.detach().to(weight.device, weight.dtype))
        self.members = members.to(weight.device)
        self.num_clusters = c
        self.cluster_size = members.shape[1]
        self.vocab_size = v
        self.hidden_size = weight.shape[1]
        self.backend = resolve_backend(backend, weight.device.type)
        if cluster_rows is None:
            cluster_rows = weight.device.type == "cpu" and self.backend == "torch"
        elif cluster_rows and weight.device.type != "cpu":
            raise ValueError("cluster_rows is for a CPU head (its check of the copy reads a comparison back)")
        assigned = assignments.detach().to(weight.device, torch.int64)
        self.candidate_rows = CandidateRows(
            weight, assigned, self.members, kernels=load_ops(self.backend, cpu_plan), copy=cluster_rows
        )
        self._cpu_plan = cpu_plan
        #: The candidates' rows in cluster order (None: scored from ``weight`` itself).
        self.cluster_rows: ClusterRows | None = self.candidate_rows.cluster_rows
        self._n_probes = 1
        self.n_probes = n_probes
        self._sampled_n_probes: int | None = None
        self.estimate = SampledEstimate(weight, v, tail_factors, sampled_rank)
        self.sampled_n_probes = sampled_n_probes

    @classmethod
    def from_settings(
        cls,
        weight: torch.Tensor,
        centroids: torch.Tensor,
        assignments: torch.Tensor,
        *,
        settings: HeadSettings,
        vocab_size: int | None = None,
        tail_factors: TailFactors | None = None,
        allow_empty_clusters: bool = False,
    ) -> FlashHead:
        """The head serving builds from its `settings` (:meth:`~my_pkg.flashhead.spec.HeadSpec.resolve` over these
        assets' sizes); the eval builds the same one."""
        spec = HeadSpec.resolve(
            settings,
            num_clusters=int(centroids.shape[0]),
            vocab_size=assignments.numel() if vocab_size is None else int(vocab_size),
            hidden_size=int(weight.shape[-1]),
            fitted_rank=tail_factors.rank if tail_factors is not None else 0,
        )
        return cls(
            weight,
            centroids,
            assignments,
            vocab_size=vocab_size,
            allow_empty_clusters=allow_empty_clusters,
            tail_factors=tail_factors,
            **spec.head_options(),
        )

    # -- properties -----------------------------------------------------------------
    @property
    def kernels(self) -> KernelOps:
        """The backend's functions this head calls: stage 1's scores, stage 2's candidates, any ids' logits."""
        return self.candidate_rows.kernels

    @property
    def cpu_plan(self) -> CpuPlan | None:
        """The torch backend's plan given to this head (None: its default); assigning one re-resolves the kernels."""
        return self._cpu_plan

    @cpu_plan.setter
    def cpu_plan(self, plan: CpuPlan | None) -> None:
        self.candidate_rows.kernels = load_ops(self.backend, plan)
        self._cpu_plan = plan

    @property
    def n_probes(self) -> int:
        return self._n_probes

    @n_probes.setter
    def n_probes(self, value: int) -> None:
        value = self._check_probes(value)
        self._n_probes = value

    @property
    def sampled_n_probes(self) -> int:
        """Clusters scored exactly for a sampled row (see :meth:`step_logits`)."""
        return resolve_sampled_n_probes(self._sampled_n_probes, self._n_probes, self.num_clusters, self.estimate.rank)

    @sampled_n_probes.setter
    def sampled_n_probes(self, value: int | None) -> None:
        """An int in ``0..C``, or None for :func:`~my_pkg.flashhead.spec.default_sampled_n_probes`."""
        self._sampled_n_probes = None if value is None else self._check_probes(value, "sampled_n_probes", low=0)

    @property
    def sampled_rank(self) -> int:
        """Rank of the head approximation behind a sampled row's estimated logits (0: ``-inf`` instead)."""
        return self.estimate.rank

    @sampled_rank.setter
    def sampled_rank(self, value: int) -> None:
        self.estimate.rank = value

    @property
    def sampled_rescore(self) -> int:
        """Tokens outside a sampled row's candidates scored exactly: those with the best estimated logits
        (default :func:`~my_pkg.flashhead.spec.default_sampled_rescore`; 0: estimates only)."""
        return self.estimate.rescore

    @sampled_rescore.setter
    def sampled_rescore(self, value: int | None) -> None:
        """An int in ``0..V``, or None for the default."""
        self.estimate.rescore = value

    @property
    def tail_fitted(self) -> bool:
        """Whether sampled rows' estimate is the one fitted to calibration states (else weight-only)."""
        return self.estimate.fitted

    def _tail_tables(self) -> TailTables:
        return self.estimate.tables()

    def _check_probes(self, value, name: str = "n_probes", low: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= self.num_clusters:
            raise ValueError(f"{name} must be an int in [{low}, {self.num_clusters}], got {value!r}")
        return value

    @property
    def extra_memory_bytes(self) -> int:
        """Bytes held beyond the shared head weight (centroids + cluster map, the rows in cluster order on
        CPU, and once a sampled row has been served the estimate's tables: ``r`` values per token)."""
        return (
            self.centroids.numel() * self.centroids.element_size()
            + self.members.numel() * self.members.element_size()
            + self.candidate_rows.nbytes
            + (self.estimate.built.nbytes if self.estimate.built is not None else 0)
        )

    # -- API ------------------------------------------------------------------------
    def check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [B, {self.hidden_size}], got {tuple(hidden.shape)}")
        return hidden

    def select_probes(self, hidden: torch.Tensor, *, n_probes: int | None = None) -> torch.Tensor:
        """``[B, P]`` cluster ids: the top-P centroid scores of each row (``P`` default ``n_probes``), best
        first, the smaller id first on equal scores (:mod:`~my_pkg.flashhead.probes`)."""
        hidden = self.check_hidden(hidden)
        p = self._n_probes if n_probes is None else self._check_probes(n_probes)
        return top_probes(self.kernels.stage1_scores(hidden, self.centroids), p)

    def candidate_logits(
        self, hidden: torch.Tensor, probes: torch.Tensor | None = None, **select_kw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids [B, P*cap] int64, logits [B, P*cap])``: exact logits of every candidate."""
        hidden = self.check_hidden(hidden)
        if probes is None:
            probes = self.select_probes(hidden, **select_kw)
        self.candidate_rows.refresh()
        return self.candidate_rows.candidate_logits(hidden, probes)

    def step_logits(
        self,
        hidden: torch.Tensor,
        *,
        sampled: torch.Tensor | np.ndarray | None = None,
        pinned: torch.Tensor | PinnedIds | None = None,
        postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
        probes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, vocab_size]`` logits of one decode step, as serving hands them to the sampler.

        Args:
            hidden: ``[B, H]`` final hidden states.
            sampled: ``[B]`` bool on the host (a CPU tensor or numpy array): rows that sample.
                Greedy rows (False, or ``sampled=None``) get the exact logits of the members of
                the top ``n_probes`` clusters and ``-inf`` elsewhere.  Sampled rows get the exact
                logits of the members of the top ``sampled_n_probes`` clusters (none by default),
                and every other token the estimated logit of the rank-``sampled_rank``
                approximation of the head (:mod:`~my_pkg.flashhead.tail_estimate`; ``-inf`` at
                rank 0), but for the ``sampled_rescore`` best-estimated ones, scored exactly.
            pinned: int64 token ids on the head's device, scored exactly on every row (or :class:`PinnedIds`:
                the ids with their weight rows).
            postprocess: the model's logit scale / soft-cap, applied to every finite value
                (candidates, estimates, pinned), never to ``-inf``.
            probes: ``[B, K]`` int64 cluster ids on the head's device, each row's best first, chosen by
                the caller instead of stage 1 (:meth:`probe_width` columns at least; a greedy row probes
                its first ``n_probes``, a sampled row its first ``sampled_n_probes``).  Tensor
                parallelism passes the probes the ranks chose together from their shares of the
                centroids (:mod:`~my_pkg.flashhead.probes`); the same probes give the same logits.

        Deterministic (same rows, same logits) and without host synchronisation, except on the
        first sampled row, which builds the estimate's tables once.
        """
        hidden = self.check_hidden(hidden)
        self.candidate_rows.refresh()
        num_rows = hidden.shape[0]
        post = postprocess if postprocess is not None else _identity
        mask = host_mask(sampled, num_rows)
        if mask is not None and not mask.any():
            mask = None
        width = self.probe_width(mask is not None and bool(mask.all()), mask is not None)
        if probes is not None and (probes.dim() != 2 or probes.shape[0] != num_rows or probes.shape[1] < width):
            raise ValueError(f"probes must be [{num_rows}, >= {width}], got {tuple(probes.shape)}")
        logits = step_paths.scored(self, hidden, probes, mask, width, post)
        if isinstance(pinned, torch.Tensor):
            pinned = PinnedIds(pinned, self.weight.index_select(0, pinned)) if pinned.numel() else None
        if pinned is not None:
            exact = post(torch.nn.functional.linear(hidden.to(pinned.rows.dtype), pinned.rows))
            logits.index_copy_(1, pinned.ids, exact.to(logits.dtype))
        return logits

    def exact_tokens(
        self, hidden: torch.Tensor, probes: torch.Tensor | None, *, sampled: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(ids [B, N], raw [B, V] or None)``: the tokens :meth:`step_logits` scores exactly on rows that all
        sample or none (pinned ids aside), probing the first ``sampled_n_probes`` or ``n_probes`` of ``probes``
        (None: stage 1's), and sampled rows' raw estimates, whose values at the ids are to be overwritten."""
        width = self.sampled_n_probes if sampled else self._n_probes
        ids = torch_ref.candidate_ids(self.members, self.probes_for(hidden, probes, width))
        if not (sampled and self.estimate.rank):
            return ids, None
        raw = self._tail_tables().estimates(hidden)
        best = self.estimate.best(raw, ids)
        return (ids if best is None else torch.cat([ids, best], dim=1)), raw

    def probe_width(self, all_sampled: bool, any_sampled: bool) -> int:
        """Clusters :meth:`step_logits` needs chosen per row for a batch whose rows all sample, or some:
        ``sampled_n_probes`` for sampled rows, ``n_probes`` for greedy ones, the larger for a mixed batch."""
        if all_sampled:
            return self.sampled_n_probes
        return max(self._n_probes, self.sampled_n_probes) if any_sampled else self._n_probes

    def probes_for(self, hidden: torch.Tensor, chosen: torch.Tensor | None, width: int) -> torch.Tensor:
        """``[B, width]`` the best clusters of each row: the first ``width`` of ``chosen``, else stage 1's
        (not run when ``width`` is 0)."""
        if chosen is not None:
            return chosen[:, :width]
        if width == 0:
            return torch.empty((hidden.shape[0], 0), dtype=torch.int64, device=hidden.device)
        return top_probes(self.kernels.stage1_scores(hidden, self.centroids), width)

    def scored_rows_per_step(self, *, sampled: bool, pinned: int = 0) -> int:
        """Head rows scored per row of :meth:`step_logits`: centroids + candidates + ``pinned`` ids;
        a sampled row also pays the estimate's ``r * (H + V)`` multiply-adds, counted in rows of ``H``
        (:func:`~my_pkg.flashhead.spec.rows_scored`)."""
        if not sampled:
            return rows_scored(self.num_clusters, self._n_probes, self.cluster_size, pinned=pinned)
        return rows_scored(
            self.num_clusters,
            self.sampled_n_probes,
            self.cluster_size,
            pinned=pinned + (self.sampled_rescore if self.estimate.rank else 0),
            rank=self.estimate.rank,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
        )

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, vocab_size]`` reference logits of the full head."""
        hidden = self.check_hidden(hidden)
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight[: self.vocab_size])

    def __repr__(self) -> str:
        return (
            f"FlashHead(vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
            f"num_clusters={self.num_clusters}, cluster_size={self.cluster_size}, "
            f"n_probes={self.n_probes}, backend={self.backend!r})"
        )


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits
