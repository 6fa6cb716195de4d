"""A kernel backend for tests that defines stage 2 only: the head falls back to the torch backend's
stage 1 and token logits."""

from __future__ import annotations

from typing import Any

import torch

from my_pkg.flashhead.kernels import torch_ref


def candidate_logits(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_ref.candidate_logits(*args, **kwargs)
