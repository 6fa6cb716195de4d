"""Row indices from the host to the head's device without making the host wait."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["index_tensor"]


def index_tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, without a host synchronisation.

    On an accelerator the values are staged in page-locked memory from PyTorch's caching host
    allocator, which records the copy's stream before it reuses the block; a copy from pageable
    memory would block the host until the device caught up.
    """
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type == "cpu":
        return host
    staged = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
