"""A kernel backend for tests: the torch backend's three functions, each call counted in `CALLS`.

Registered by a test (`register_backend("counting", "tests.support.counting_backend")`) to show that a head
calls its backend's own stage 1 and token logits, not the torch backend's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from my_pkg.flashhead.kernels import torch_ref

CALLS: Counter[str] = Counter()


def stage1_scores(hidden: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    CALLS["stage1_scores"] += 1
    return torch_ref.stage1_scores(hidden, centroids)


def candidate_logits(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["candidate_logits"] += 1
    return torch_ref.candidate_logits(*args, **kwargs)


def token_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    CALLS["token_logits"] += 1
    return torch_ref.token_logits(hidden, weight, ids)
