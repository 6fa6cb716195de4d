"""Stage 1's probe choice as a total order, so that it can be split over tensor-parallel ranks.

A cluster's *key* is one int64 that orders clusters by centroid score, the smaller cluster id first
on equal scores: the score's float32 bits mapped to a signed int that sorts like the float (the
bf16/fp16 scores of a half-precision head are widened exactly), times ``2**32``, plus
``2**32 - 1 - id``.  Keys are unique, so the top-``P`` keys of a row are one well-defined set in
one well-defined order (best first) on any device and any split of the centroids:

* the full stage 1 (:func:`select_probes`) takes the top-``P`` keys of all ``C`` scores;
* under tensor parallelism each rank scores its share of the centroids
  (:class:`ShardStage1`, ``C / tp`` rows), keeps its own top-``K`` keys (``K >= P``), the ranks
  exchange them (``[B, tp * K]``, the only collective stage 1 needs, in the serving glue), and
  every rank takes the top-``P`` of what it received (:func:`merge_probes`).  A global top-``P``
  cluster is among its own rank's top-``P``, so the merge gives the same clusters in the same
  order as :func:`select_probes` over the same scores, on every rank.

The same scores: a centroid's score is one dot product either way, but a BLAS may round it in
the last bit differently in a ``[B, C / tp]`` product than in a ``[B, C]`` one (a few shapes do on
CPU), which can only swap two clusters whose scores tie to that last bit.

Imports torch only.
"""

from __future__ import annotations

import functools

import torch

from .layout import hidden_major, linear

__all__ = [
    "NO_KEY",
    "ShardStage1",
    "centroid_share",
    "cluster_keys",
    "key_ids",
    "merge_probes",
    "select_probes",
]

_LOW = 1 << 32
#: Below every cluster's key: fills a rank's exchange when its share has fewer than ``K`` clusters.
NO_KEY = -(1 << 63)
_SIGN_CLEAR = 0x7FFFFFFF


def cluster_keys(scores: torch.Tensor, first_id: int = 0) -> torch.Tensor:
    """``[B, n]`` int64 keys of the clusters ``first_id .. first_id + n - 1`` scored ``scores [B, n]``."""
    bits = scores.to(torch.float32).contiguous().view(torch.int32)
    flip = (bits >> 31).bitwise_and_(_SIGN_CLEAR)  # negative floats: reverse their magnitude order
    keys = bits.bitwise_xor(flip).to(torch.int64).mul_(_LOW)
    return keys.add_(_id_bits(first_id, scores.shape[1], scores.device))


@functools.cache
def _id_bits(first_id: int, count: int, device: torch.device) -> torch.Tensor:
    """Low halves of the keys of clusters ``first_id .. first_id + count - 1``, made once, not per step."""
    return (_LOW - 1) - torch.arange(first_id, first_id + count, device=device, dtype=torch.int64)


def key_ids(keys: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Cluster ids of ``keys``; a :data:`NO_KEY` (never chosen while ``P <= C``) maps into ``[0, C)`` too,
    so that a wrong key can never index outside the cluster map."""
    ids = (_LOW - 1) - keys.bitwise_and(_LOW - 1)
    return ids.clamp_(0, num_clusters - 1)


def _top(keys: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(keys, k, dim=-1, sorted=True).values


def select_probes(scores: torch.Tensor, n_probes: int) -> torch.Tensor:
    """``[B, n_probes]`` int64 cluster ids of the best scores, best first, the smaller id first on ties."""
    return key_ids(_top(cluster_keys(scores), n_probes), scores.shape[1])


def merge_probes(keys: torch.Tensor, n_probes: int, num_clusters: int) -> torch.Tensor:
    """``[B, n_probes]`` cluster ids, best first, from the ranks' exchanged keys ``[B, tp * K]``
    (``K >= n_probes``): the probes :func:`select_probes` gives over all the scores."""
    return key_ids(_top(keys, n_probes), num_clusters)


def centroid_share(num_clusters: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)``: the clusters rank ``rank`` of ``world_size`` scores (contiguous, sizes differing
    by at most one)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return num_clusters * rank // world_size, num_clusters * (rank + 1) // world_size


class ShardStage1:
    """One rank's part of stage 1: its share ``[start, end)`` of the ``C`` global centroids.

    Args:
        centroids: ``[C, H]`` global centroids (only the share's rows are kept, in ``dtype``).
        rank, world_size: this rank among the ranks that split the centroids.
    """

    def __init__(
        self,
        centroids: torch.Tensor,
        rank: int,
        world_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_clusters = int(centroids.shape[0])
        self.start, self.end = centroid_share(self.num_clusters, rank, world_size)
        share = centroids[self.start : self.end].detach()
        self.centroids = hidden_major(share.to(device=device or share.device, dtype=dtype or share.dtype))
        ids = torch.arange(self.start, self.end, dtype=torch.int64, device=self.centroids.device)
        #: This share's clusters ranked below every scored cluster (see :meth:`unscored_keys`).
        self._unscored = NO_KEY + (_LOW - 1 - ids)

    @property
    def nbytes(self) -> int:
        return self.centroids.numel() * self.centroids.element_size() + self._unscored.numel() * 8

    def keys(self, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, width]`` this share's best keys for the exchange, best first; :data:`NO_KEY` after its
        last cluster when the share holds fewer than ``width``."""
        scores = linear(hidden.to(self.centroids.dtype), self.centroids)
        return self._fit(_top(cluster_keys(scores, self.start), min(width, scores.shape[1])), width)

    def unscored_keys(self, num_rows: int, width: int) -> torch.Tensor:
        """``[num_rows, width]`` keys for a step whose scores this rank could not compute: its clusters, each
        below every scored cluster, so the merge takes them only when the other ranks hold fewer than ``P``
        (with every cluster probed the probes stay all of them)."""
        keys = self._unscored[: min(width, self._unscored.numel())]
        return self._fit(keys.unsqueeze(0).expand(num_rows, -1), width)

    @staticmethod
    def _fit(keys: torch.Tensor, width: int) -> torch.Tensor:
        if keys.shape[1] == width:
            return keys.contiguous()
        fill = torch.full((keys.shape[0], width - keys.shape[1]), NO_KEY, dtype=torch.int64, device=keys.device)
        return torch.cat((keys, fill), dim=1)
