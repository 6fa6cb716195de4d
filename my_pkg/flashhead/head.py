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
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .cluster_rows import ClusterRows, cluster_rows_for
from .kernels import load_backend, resolve_backend, torch_ref
from .layout import hidden_major
from .probes import select_probes as top_probes
from .staging import index_tensor
from .tail_estimate import TailFactors, TailTables, build_tail_tables, default_tail_rank, top_k_ids

__all__ = [
    "FlashHead",
    "build_members",
    "default_n_probes",
    "default_sampled_n_probes",
    "default_sampled_rank",
    "default_sampled_rescore",
    "rows_scored",
]


def default_n_probes(num_clusters: int) -> int:
    """Probe count of a greedy row when the assets give none: about 1/32 of the clusters (256 of 8,016
    for a 128k vocabulary), at least 8.  The builder writes it (or its calibrated choice) into
    ``config.json``; serving falls back to it for assets without ``n_probes``."""
    return max(1, min(num_clusters, max(8, math.ceil(num_clusters / 32))))


def rows_scored(
    num_clusters: int,
    n_probes: int,
    cluster_size: int,
    *,
    pinned: int = 0,
    rank: int = 0,
    hidden_size: int = 1,
    vocab_size: int = 0,
) -> int:
    """Head rows scored for one row of a step: ``C`` centroids and ``P * cluster_size`` candidates (neither
    when ``P`` is 0: no stage 1), and the ``pinned`` ids; a rank-``rank`` tail estimate (sampled rows) adds
    its ``rank * (H + V)`` multiply-adds counted in rows of ``H``.  The one formula behind every "rows
    scored" figure."""
    estimate = math.ceil(rank * (hidden_size + vocab_size) / hidden_size) if rank else 0
    return (num_clusters if n_probes else 0) + n_probes * cluster_size + pinned + estimate


def default_sampled_n_probes(n_probes: int, num_clusters: int, sampled_rank: int) -> int:
    """Clusters a sampled row probes when not set: none while the row has an estimate (``sampled_rank`` > 0),
    which then chooses the row's exact tokens by itself, so the row skips stage 1; without an estimate, or
    when greedy rows probe every cluster (every row then gets the dense logits), the greedy rows'
    ``n_probes`` (at most ``C``).  On the trained fixture the estimate's best tokens, scored exactly, gave the
    TV on shifted text of as many exact tokens split between probed clusters and rescored ones (a little
    lower) at fewer rows scored (docs/research/sampling.md, "Sampled rows on shifted text")."""
    probes = max(1, min(num_clusters, n_probes))
    return 0 if sampled_rank and probes < num_clusters else probes


def resolve_sampled_n_probes(configured: int | None, n_probes: int, num_clusters: int, sampled_rank: int) -> int:
    """The clusters a sampled row probes: ``configured``, but :func:`default_sampled_n_probes` when it is None,
    or 0 without an estimate to choose the row's exact tokens (``sampled_rank`` 0)."""
    if configured is None or (configured == 0 and not sampled_rank):
        return default_sampled_n_probes(n_probes, num_clusters, sampled_rank)
    return configured


def default_sampled_rescore(vocab_size: int, *, fitted: bool = True) -> int:
    """Tokens a sampled row scores exactly besides its candidates when not set: the best-estimated
    ``ceil(V / 32)`` (4,008 for a 128k vocabulary), or ``ceil(V / 16)`` when the estimate is the weight-only
    one (not ``fitted`` to calibration states), which ranks the tokens worse.  On the trained fixture both
    met TV <= 0.01 at T=0.7/top_p=0.9 and <= 0.02 at T=1 on shifted text without any probed cluster, where
    the weight-only estimate with ``V / 32`` missed T=1 (docs/research/sampling.md, "Sampled rows on shifted text")."""
    return math.ceil(vocab_size / (32 if fitted else 16))


#: Share of the dense head's multiply-adds that a sampled row spends at most by default when its estimate is
#: fitted (pinned ids aside): the estimate's rank is lowered where ``ceil(H / 8)`` and the exact tokens would
#: cost more (:func:`default_sampled_rank`).
SAMPLED_ROW_BUDGET = 0.15


def default_sampled_rank(vocab_size: int, hidden_size: int, *, fitted_rank: int = 0) -> int:
    """Rank of a sampled row's estimate when not set: ``ceil(H / 8)``, at most 64
    (:func:`~my_pkg.flashhead.tail_estimate.default_tail_rank`).  With fitted factors of rank ``fitted_rank``
    it is lowered, where needed, so that the estimate (``r * (H + V) / H`` rows) and its
    :func:`default_sampled_rescore` exact tokens stay within :data:`SAMPLED_ROW_BUDGET` of the ``V`` rows:
    never at 2,048-wide heads (64 of at most 239 at 128,256 x 2,048), 29 instead of 32 on the trained fixture's
    8,192 x 256.  The weight-only estimate (no factors) keeps ``ceil(H / 8)``: it ranks the tokens worse, and on
    the fixture no rank within the budget met the TV targets with it (docs/research/sampling.md, "Sampled rows
    on shifted text")."""
    rank = default_tail_rank(hidden_size)
    spare = SAMPLED_ROW_BUDGET * vocab_size - default_sampled_rescore(vocab_size)
    within = max(1, min(rank, math.floor(spare * hidden_size / (hidden_size + vocab_size))))
    return within if within <= fitted_rank else rank


def build_members(
    assignments: torch.Tensor, num_clusters: int | None = None, *, allow_empty: bool = False
) -> torch.Tensor:
    """Cluster map ``[C, cap]`` int64 of token ids from per-token cluster ids.

    ``cap`` is the largest cluster size.  Shorter clusters are padded by repeating their
    first member, so scoring the padded slots only duplicates an exact logit.  Raises
    ``ValueError`` for ids out of range, and for an empty cluster unless ``allow_empty``
    (a vocabulary shard holds only some of each cluster's members): an empty cluster's
    slots then hold token 0, whose logit is exact like any other candidate's.
    """
    a = assignments.detach().to("cpu", torch.int64).flatten()
    if a.numel() == 0:
        raise ValueError("assignments is empty")
    c = int(a.max()) + 1 if num_clusters is None else num_clusters
    if int(a.min()) < 0 or int(a.max()) >= c:
        raise ValueError(f"cluster ids must lie in [0, {c})")
    counts = torch.bincount(a, minlength=c)
    empty = counts == 0
    if bool(empty.any()) and not allow_empty:
        raise ValueError("every cluster needs at least one member")
    cap = int(counts.max())
    order = torch.argsort(a, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(cap).view(1, cap)
    pos = starts.view(-1, 1) + torch.minimum(slot, (counts - 1).clamp(min=0).view(-1, 1))
    pos = torch.where(slot < counts.view(-1, 1), pos, starts.view(-1, 1))
    members = order[pos.clamp(max=a.numel() - 1)]
    return members.masked_fill_(empty.view(-1, 1), 0)


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
            (``0..C``; default :func:`default_sampled_n_probes`: 0 while sampled rows have an
            estimate, else following ``n_probes``).  0 needs the estimate: at ``sampled_rank`` 0 a
            sampled row probes ``n_probes``.
        sampled_rank: rank of the head approximation that estimates a sampled row's unprobed
            logits (``0..H``, 0: ``-inf`` instead; default :func:`default_sampled_rank`).  Its
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
        #: The candidates' rows in cluster order (None: scored from ``weight`` itself).
        self.cluster_rows: ClusterRows | None = (
            cluster_rows_for(weight, assigned, self.members) if cluster_rows else None
        )
        # Each head row's cluster (C: none, e.g. padding rows): lets a CPU batch be scored cluster by cluster.
        self._token_cluster: torch.Tensor | None = None
        if weight.device.type == "cpu" and self.cluster_rows is None:
            token_cluster = torch.full((weight.shape[0],), c, dtype=torch.int64)
            token_cluster[:v] = assigned
            self._token_cluster = token_cluster
        self._n_probes = 1
        self.n_probes = n_probes
        self._sampled_n_probes: int | None = None
        self.sampled_n_probes = sampled_n_probes
        self._tail: TailTables | None = None
        self._tail_factors = tail_factors
        self._sampled_rescore: int | None = None
        fitted_rank = tail_factors.rank if tail_factors is not None else 0
        self._sampled_rank = default_sampled_rank(v, self.hidden_size, fitted_rank=fitted_rank)
        if sampled_rank is not None:
            self.sampled_rank = sampled_rank

    def _kernels(self):
        return load_backend(self.backend)

    # -- properties -----------------------------------------------------------------
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
        return resolve_sampled_n_probes(self._sampled_n_probes, self._n_probes, self.num_clusters, self._sampled_rank)

    @sampled_n_probes.setter
    def sampled_n_probes(self, value: int | None) -> None:
        """An int in ``0..C``, or None for :func:`default_sampled_n_probes`."""
        self._sampled_n_probes = None if value is None else self._check_probes(value, "sampled_n_probes", low=0)

    @property
    def sampled_rank(self) -> int:
        """Rank of the head approximation behind a sampled row's estimated logits (0: ``-inf`` instead)."""
        return self._sampled_rank

    @sampled_rank.setter
    def sampled_rank(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= self.hidden_size:
            raise ValueError(f"sampled_rank must be an int in [0, {self.hidden_size}], got {value!r}")
        if value != self._sampled_rank:
            self._tail = None
        self._sampled_rank = value

    @property
    def sampled_rescore(self) -> int:
        """Tokens outside a sampled row's candidates scored exactly: those with the best estimated logits
        (default :func:`default_sampled_rescore`; 0: estimates only)."""
        if self._sampled_rescore is None:
            return default_sampled_rescore(self.vocab_size, fitted=self.tail_fitted)
        return self._sampled_rescore

    @sampled_rescore.setter
    def sampled_rescore(self, value: int | None) -> None:
        """An int in ``0..V``, or None for :func:`default_sampled_rescore`."""
        valid = not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= self.vocab_size
        if value is not None and not valid:
            raise ValueError(f"sampled_rescore must be an int in [0, {self.vocab_size}], got {value!r}")
        self._sampled_rescore = value

    def _tail_tables(self) -> TailTables:
        if self._tail is None:
            rank = min(self._sampled_rank, self.vocab_size)
            if self.tail_fitted:
                self._tail = TailTables.from_factors(self.weight, self.vocab_size, self._tail_factors.truncated(rank))
            else:
                self._tail = build_tail_tables(self.weight, self.vocab_size, rank)
        return self._tail

    @property
    def tail_fitted(self) -> bool:
        """Whether sampled rows' estimate is the one fitted to calibration states (else weight-only)."""
        rank = min(self._sampled_rank, self.vocab_size)
        return self._tail_factors is not None and 0 < rank <= self._tail_factors.rank

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
            + (self._token_cluster.numel() * 8 if self._token_cluster is not None else 0)
            + (self.cluster_rows.nbytes if self.cluster_rows is not None else 0)
            + (self._tail.nbytes if self._tail is not None else 0)
        )

    # -- API ------------------------------------------------------------------------
    def _check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [B, {self.hidden_size}], got {tuple(hidden.shape)}")
        return hidden

    def select_probes(self, hidden: torch.Tensor, *, n_probes: int | None = None) -> torch.Tensor:
        """``[B, P]`` cluster ids: the top-P centroid scores of each row (``P`` default ``n_probes``), best
        first, the smaller id first on equal scores (:mod:`~my_pkg.flashhead.probes`)."""
        hidden = self._check_hidden(hidden)
        p = self._n_probes if n_probes is None else self._check_probes(n_probes)
        return top_probes(torch_ref.stage1_scores(hidden, self.centroids), p)

    def candidate_logits(
        self, hidden: torch.Tensor, probes: torch.Tensor | None = None, **select_kw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids [B, P*cap] int64, logits [B, P*cap])``: exact logits of every candidate."""
        hidden = self._check_hidden(hidden)
        if probes is None:
            probes = self.select_probes(hidden, **select_kw)
        self._refresh_rows()
        return self._candidate_logits(hidden, probes)

    def _refresh_rows(self) -> None:
        if self.cluster_rows is not None:
            self.cluster_rows.refresh()

    def _candidate_logits(
        self, hidden: torch.Tensor, probes: torch.Tensor, extra_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's ``candidate_logits`` (token ids and their exact logits), from the rows in cluster order
        when the head has them."""
        rows = self.cluster_rows
        if rows is None:
            return self._kernels().candidate_logits(
                hidden, self.weight, self.members, probes, token_cluster=self._token_cluster, extra_ids=extra_ids
            )
        _, logits = self._kernels().candidate_logits(
            hidden,
            rows.rows,
            rows.slots,
            probes,
            token_cluster=rows.token_cluster,
            extra_ids=None if extra_ids is None else rows.row_of[extra_ids],
        )
        ids = torch_ref.candidate_ids(self.members, probes)
        return (ids if extra_ids is None else torch.cat([ids, extra_ids], dim=1)), logits

    def _token_logits(self, hidden: torch.Tensor, ids: torch.Tensor, *, has_candidates: bool = False) -> torch.Tensor:
        """``[B, N]`` exact logits of any token ids ``[B, N]``: from the rows in cluster order when ``ids`` hold
        probed clusters' members (``has_candidates``), else from the head itself, where a sampled row's
        best-estimated tokens lie closer together (blocks of neighbouring ids, :func:`top_k_ids`)."""
        rows = self.cluster_rows
        if rows is None or not has_candidates:
            return torch_ref.token_logits(hidden, self.weight, ids)
        return torch_ref.token_logits(hidden, rows.rows, rows.row_of[ids])

    def step_logits(
        self,
        hidden: torch.Tensor,
        *,
        sampled: torch.Tensor | np.ndarray | None = None,
        pinned: torch.Tensor | None = None,
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
            pinned: int64 token ids on the head's device, scored exactly on every row.
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
        hidden = self._check_hidden(hidden)
        self._refresh_rows()
        num_rows = hidden.shape[0]
        post = postprocess if postprocess is not None else _identity
        mask = _host_mask(sampled, num_rows)
        if mask is not None and not mask.any():
            mask = None
        width = self.probe_width(mask is not None and bool(mask.all()), mask is not None)
        if probes is not None and (probes.dim() != 2 or probes.shape[0] != num_rows or probes.shape[1] < width):
            raise ValueError(f"probes must be [{num_rows}, >= {width}], got {tuple(probes.shape)}")
        if mask is None or mask.all() or self.sampled_n_probes == self._n_probes:
            # One pass: every row probes the same number of clusters, only the logits outside the
            # candidates differ.
            logits = self._rows_logits(hidden, self._probes(hidden, probes, width), mask, post)
        elif self.sampled_n_probes == 0 and self._sampled_rank and self.sampled_rescore and self.backend == "torch":
            logits = self._mixed_logits(hidden, probes, mask, post)
        else:
            logits = torch.empty((num_rows, self.vocab_size), dtype=self.weight.dtype, device=hidden.device)
            for rows_sampled in (False, True):
                index = index_tensor(np.flatnonzero(mask == rows_sampled), hidden.device)
                part_hidden = hidden.index_select(0, index)
                part_probes = None if probes is None else probes.index_select(0, index)
                part = self._rows_logits(
                    part_hidden,
                    self._probes(part_hidden, part_probes, self.sampled_n_probes if rows_sampled else self._n_probes),
                    np.ones(index.numel(), bool) if rows_sampled else None,
                    post,
                )
                logits.index_copy_(0, index, part)
        if pinned is not None and pinned.numel():
            pinned_weight = self.weight.index_select(0, pinned)
            logits[:, pinned] = post(torch.nn.functional.linear(hidden.to(self.weight.dtype), pinned_weight)).to(
                logits.dtype
            )
        return logits

    def masked_logits(
        self,
        hidden: torch.Tensor,
        exact: torch.Tensor,
        *,
        sampled: torch.Tensor | np.ndarray | None = None,
        pinned: torch.Tensor | None = None,
        postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
        probes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`step_logits`'s answer for the same rows, made from ``exact`` (``[B, >= vocab_size]``: every
        token's post-processed logit, e.g. the dense head's product) instead of FlashHead's own scoring.

        Each row keeps exactly the tokens :meth:`step_logits` scores exactly (a greedy row its candidates, a
        sampled row its candidates and best-estimated tokens, every row the ``pinned`` ids), with their values
        read from ``exact``; everything else is what :meth:`step_logits` gives there (``-inf``, or a sampled
        row's estimate).  The same tokens, chosen the same way; the exact values are equal up to how the two
        products round (bit for bit where they round alike, as a bfloat16 head does).  Serving uses it when
        the dense product is the cheaper way to a step's FlashHead rows: which kernel serves a step then never
        changes a row's answer.
        """
        hidden = self._check_hidden(hidden)
        num_rows = hidden.shape[0]
        if exact.dim() != 2 or exact.shape[0] != num_rows or exact.shape[1] < self.vocab_size:
            raise ValueError(f"exact must be [{num_rows}, >= {self.vocab_size}], got {tuple(exact.shape)}")
        exact = exact[:, : self.vocab_size]
        post = postprocess if postprocess is not None else _identity
        mask = _host_mask(sampled, num_rows)
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
            width = self.sampled_n_probes if rows_sampled else self._n_probes
            ids = torch_ref.candidate_ids(self.members, self._probes(part_hidden, part_probes, width))
            if rows_sampled and self._sampled_rank:
                raw = self._tail_tables().estimates(part_hidden)
                best = self._rescored(raw, ids)
                part = post(raw).to(exact.dtype)
                if best is not None:
                    ids = torch.cat([ids, best], dim=1)
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

    def probe_width(self, all_sampled: bool, any_sampled: bool) -> int:
        """Clusters :meth:`step_logits` needs chosen per row for a batch whose rows all sample, or some:
        ``sampled_n_probes`` for sampled rows, ``n_probes`` for greedy ones, the larger for a mixed batch."""
        if all_sampled:
            return self.sampled_n_probes
        return max(self._n_probes, self.sampled_n_probes) if any_sampled else self._n_probes

    def _probes(self, hidden: torch.Tensor, chosen: torch.Tensor | None, width: int) -> torch.Tensor:
        """``[B, width]`` the best clusters of each row: the first ``width`` of ``chosen``, else stage 1's
        (not run when ``width`` is 0)."""
        if chosen is not None:
            return chosen[:, :width]
        if width == 0:
            return torch.empty((hidden.shape[0], 0), dtype=torch.int64, device=hidden.device)
        return top_probes(torch_ref.stage1_scores(hidden, self.centroids), width)

    def _rows_logits(
        self,
        hidden: torch.Tensor,
        probes: torch.Tensor,
        sampled: np.ndarray | None,
        post: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Step logits before the pinned ids, each row probing the clusters ``probes``; ``sampled`` marks the
        sampled rows (None: none)."""
        if sampled is not None and bool(sampled.all()) and self._sampled_rank:
            # Every row samples: its rescored tail tokens are scored in the candidates' pass over the head.
            raw = self._tail_tables().estimates(hidden)
            rescored = self._rescored(raw, torch_ref.candidate_ids(self.members, probes))
            if probes.shape[1] == 0:  # no candidates: the estimate chose every exact token
                if rescored is None:
                    return post(raw).to(self.weight.dtype)
                ids, exact = rescored, self._token_logits(hidden, rescored)
            else:
                ids, exact = self._candidate_logits(hidden, probes, extra_ids=rescored)
            return post(raw).to(exact.dtype).scatter_(1, ids, post(exact))
        ids, exact = self._candidate_logits(hidden, probes)
        exact = post(exact)
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), dtype=exact.dtype, device=hidden.device)
        if sampled is not None and self._sampled_rank:
            index = index_tensor(np.flatnonzero(sampled), hidden.device)
            out.index_copy_(
                0,
                index,
                self._estimates(hidden.index_select(0, index), ids.index_select(0, index), post, exact.dtype),
            )
        return out.scatter_(1, ids, exact)

    def _mixed_logits(
        self,
        hidden: torch.Tensor,
        probes: torch.Tensor | None,
        sampled: np.ndarray,
        post: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Step logits before the pinned ids of a batch of greedy rows and sampled rows that probe no cluster:
        the greedy rows' candidates and the sampled rows' best-estimated tokens scored in one pass over the
        head (a head row that several rows need is read once), the same logits as each kind alone."""
        greedy = index_tensor(np.flatnonzero(~sampled), hidden.device)
        rows_sampled = index_tensor(np.flatnonzero(sampled), hidden.device)
        greedy_hidden = hidden.index_select(0, greedy)
        chosen = None if probes is None else probes.index_select(0, greedy)
        candidates = torch_ref.candidate_ids(self.members, self._probes(greedy_hidden, chosen, self._n_probes))
        raw = self._tail_tables().estimates(hidden.index_select(0, rows_sampled))
        best = self._rescored(raw, candidates.new_empty((raw.shape[0], 0)))  # no candidates of their own
        assert best is not None  # sampled_rescore > 0
        # One [B, N] id matrix; the narrower kind repeats its last id (scored and written twice, same value).
        width = max(candidates.shape[1], best.shape[1])
        ids = torch.empty((hidden.shape[0], width), dtype=torch.int64, device=hidden.device)
        for index, part in ((greedy, candidates), (rows_sampled, best)):
            ids.index_copy_(0, index, torch.cat([part, part[:, -1:].expand(-1, width - part.shape[1])], 1))
        exact = post(self._token_logits(hidden, ids, has_candidates=True))
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), dtype=exact.dtype, device=hidden.device)
        out.index_copy_(0, rows_sampled, post(raw).to(exact.dtype))
        return out.scatter_(1, ids, exact)

    def _rescored(self, raw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """``[B, k]`` the ``sampled_rescore`` tokens outside the candidates ``ids`` with the best raw estimates
        (None when there are none), chosen before ``post`` (a soft-cap can tie large estimates, the raw ones
        rank them).  Sets ``raw`` to ``-inf`` at ``ids`` in place: the caller writes their exact logits there."""
        raw.scatter_(1, ids, float("-inf"))
        k = min(self.sampled_rescore, self.vocab_size - ids.shape[1])
        return top_k_ids(raw, k) if k > 0 else None

    def _estimates(
        self, hidden: torch.Tensor, ids: torch.Tensor, post: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """``[B, V]`` estimated logits of sampled rows; the ``sampled_rescore`` best-estimated tokens outside
        the candidates ``ids`` are scored exactly (the tail tokens most likely to carry mass)."""
        raw = self._tail_tables().estimates(hidden)
        best = self._rescored(raw, ids)
        out = post(raw).to(dtype)
        if best is not None:
            out.scatter_(1, best, post(self._token_logits(hidden, best)).to(dtype))
        return out

    def scored_rows_per_step(self, *, sampled: bool, pinned: int = 0) -> int:
        """Head rows scored per row of :meth:`step_logits`: centroids + candidates + ``pinned`` ids;
        a sampled row also pays the estimate's ``r * (H + V)`` multiply-adds, counted in rows of ``H``
        (:func:`rows_scored`)."""
        if not sampled:
            return rows_scored(self.num_clusters, self._n_probes, self.cluster_size, pinned=pinned)
        return rows_scored(
            self.num_clusters,
            self.sampled_n_probes,
            self.cluster_size,
            pinned=pinned + (self.sampled_rescore if self._sampled_rank else 0),
            rank=self._sampled_rank,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
        )

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, vocab_size]`` reference logits of the full head."""
        hidden = self._check_hidden(hidden)
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight[: self.vocab_size])

    def __repr__(self) -> str:
        return (
            f"FlashHead(vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
            f"num_clusters={self.num_clusters}, cluster_size={self.cluster_size}, "
            f"n_probes={self.n_probes}, backend={self.backend!r})"
        )


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _host_mask(sampled: torch.Tensor | np.ndarray | None, num_rows: int) -> np.ndarray | None:
    """``sampled`` as a numpy bool array of ``num_rows`` (a device tensor is copied to the host)."""
    if sampled is None:
        return None
    mask = sampled.detach().cpu().numpy() if isinstance(sampled, torch.Tensor) else np.asarray(sampled)
    mask = mask.astype(bool, copy=False).reshape(-1)
    if mask.shape[0] != num_rows:
        raise ValueError(f"sampled has {mask.shape[0]} entries for {num_rows} rows")
    return mask
