"""Tensor parallelism's stage-1 exchange: what each rank sends so that every rank probes the same clusters.

Each rank scores its share of the centroids (`ShardStage1`) and sends its best clusters as keys; the
logits processor gathers every rank's keys over vLLM's TP group (`patches/logits_processor.py`) and the
controller probes the best of them (`merge_probes`). Every rank of an armed step must reach the
collective with the same shape, so the width is read from values every rank holds alike (settings, the
availability agreed at load, the step's size), and a payload is produced whatever fails on this rank.
Plain values in, tensors out; no controller state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from my_pkg.contract import ReasonCode
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.flashhead.probes import NO_KEY, ShardStage1
from my_pkg.flashhead.settings import FlashHeadSettings

__all__ = ["RANK_LOCAL_CODES", "exchange_width", "keys_width", "payload", "takes_part"]

#: Reasons a controller can be unavailable on some ranks of a tensor-parallel model and not others (a failure, or
#: its own start-up timing; the rest come from the configuration or the head's type, the same on every rank): such a
#: rank still takes part in the stage-1 exchange, so that no other rank waits for it.
RANK_LOCAL_CODES = frozenset({"build_failed", "warm_up_failed", "slower_than_dense"})

OnFailure = Callable[[BaseException, int], None]


def takes_part(code: ReasonCode | None, dense_on_every_rank: bool) -> bool:
    """Whether a rank whose controller is unavailable for `code` (None: available) still exchanges keys."""
    return not dense_on_every_rank and (code is None or code in RANK_LOCAL_CODES)


def keys_width(settings: FlashHeadSettings, num_clusters: int | None, *, part: bool) -> int | None:
    """Keys per row of the stage-1 exchange (None: this model exchanges nothing). The width covers both kinds
    of rows: greedy rows probe `n_probes`, sampled rows `sampled_n_probes`."""
    if not settings.enabled or num_clusters is None or not part:
        return None
    width = settings.n_probes
    if settings.probe_sampling and settings.sampled_n_probes is not None:
        width = max(width, settings.sampled_n_probes)
    return min(width, num_clusters)


def exchange_width(width: int | None, threshold: int | None, num_rows: int) -> int | None:
    """Keys each rank sends per row for a step of `num_rows` rows (`width`: `keys_width`), or None when the
    step exchanges nothing: no width, or a step above the operator's `dense_batch_threshold`."""
    if width is None or (threshold is not None and num_rows > threshold):
        return None
    return width


def payload(
    stage1: ShardStage1 | None,
    hidden: torch.Tensor,
    width: int,
    rows: StepRows | None,
    on_failure: OnFailure,
) -> tuple[torch.Tensor, bool]:
    """`([rows, width] int64 keys, scored)`: what this rank sends, its best clusters of its share. When every row
    of the step needs the dense head (`rows`, alike on every rank) no rank probes anything and the keys are not
    scored. Never raises: when its share cannot be scored the keys rank this share's clusters below every scored
    one (`scored` False; `on_failure(exc, rows)` counts it and this rank serves its shard dense), so the exchange
    keeps its shape and no rank waits."""
    num_rows = int(hidden.shape[0])
    if _every_row_dense(rows):
        return _no_keys(num_rows, width, hidden.device), True
    try:
        if stage1 is None:
            raise RuntimeError("this rank's share of the centroids was not built")
        return stage1.keys(hidden, width), True
    except Exception as exc:  # noqa: BLE001 - the exchange must happen whatever fails here
        on_failure(exc, num_rows)
    try:
        if stage1 is not None:
            return stage1.unscored_keys(num_rows, width), False
    except Exception:  # noqa: BLE001
        pass
    return _no_keys(num_rows, width, hidden.device), False


def _no_keys(num_rows: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.full((num_rows, width), NO_KEY, dtype=torch.int64, device=device)


def _every_row_dense(rows: StepRows | None) -> bool:
    """Whether every row of the step of `rows` needs the dense head (alike on every rank). False whenever unsure
    (never raises)."""
    try:
        return rows is not None and (rows.all_dense is not None or bool(np.all(rows.dense_codes)))
    except Exception:  # noqa: BLE001 - then the keys are scored, as on any step
        return False
