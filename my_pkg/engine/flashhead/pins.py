"""Token ids scored exactly on every FlashHead row, with their head-weight rows, per set of stop ids.

A step pins the model's ids (EOS, special tokens: `FlashHeadController.pinned_ids`) and every id its
requests stop on (`StepRows.stop_ids`). Mixed traffic alternates between a few such sets, so the last
`capacity` sets are kept, each with its ids on the device and its rows of the head weight: a step that
finds its set scores the pins with one small matmul and copies nothing. A new set is uploaded through
page-locked staging (`index_tensor`, non-blocking) and its rows gathered on the device, so the host
never waits for the device on the step path.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from my_pkg.flashhead.head import PinnedIds
from my_pkg.flashhead.staging import index_tensor

__all__ = ["PinnedRows"]

_Key = tuple[tuple[int, ...], torch.device]


class PinnedRows:
    """The pinned ids of one head (local to its vocabulary shard) and a small cache per stop-id set."""

    def __init__(self, base_ids: tuple[int, ...], vocab_range: tuple[int, int], capacity: int = 8) -> None:
        self.base_ids = frozenset(base_ids)
        self.vocab_range = vocab_range
        self.capacity = capacity
        self._cache: OrderedDict[_Key, PinnedIds | None] = OrderedDict()
        self.uploads = 0  # distinct sets uploaded so far (a test and the docs read it)

    def get(self, stop_ids: tuple[int, ...], weight: torch.Tensor) -> PinnedIds | None:
        """The local ids `[P]` int64 and their weight rows `[P, H]` on `weight`'s device, as
        `FlashHead.step_logits(pinned=...)` takes them; None when nothing is pinned."""
        key = (stop_ids, weight.device)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        start, end = self.vocab_range
        ids = sorted(i - start for i in self.base_ids.union(stop_ids) if start <= i < end)
        entry = None
        if ids:
            local = index_tensor(np.asarray(ids, dtype=np.int64), weight.device)
            entry = PinnedIds(local, weight.index_select(0, local))
        self.uploads += 1
        self._cache[key] = entry
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return entry

    @property
    def nbytes(self) -> int:
        """Device bytes held by the cached ids and weight rows."""
        return sum(
            ids.numel() * ids.element_size() + rows.numel() * rows.element_size()
            for ids, rows in (entry for entry in self._cache.values() if entry is not None)
        )
