"""Row indices and row masks between the host and the head's device, without making the host wait for it."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["host_mask", "index_tensor"]


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


def host_mask(sampled: torch.Tensor | np.ndarray | None, num_rows: int) -> np.ndarray | None:
    """``sampled`` as a numpy bool array of ``num_rows`` (a device tensor is copied to the host)."""
    if sampled is None:
        return None
    mask = sampled.detach().cpu().numpy() if isinstance(sampled, torch.Tensor) else np.asarray(sampled)
    mask = mask.astype(bool, copy=False).reshape(-1)
    if mask.shape[0] != num_rows:
        raise ValueError(f"sampled has {mask.shape[0]} entries for {num_rows} rows")
    return mask
