"""How close a backend's logits must be to exact math, per output dtype: the kernels' accuracy contract.

A backend accumulates in float32 and rounds once to the output dtype, so the bound is two units in the last
place of the output (fp16: 2**-10, bf16: 2**-7 relative each; Triton's interpreter truncates where a GPU rounds
to nearest) plus a float32 summation-order slack. A wrong row or a lost block is off by O(1). The kernel tests
(`tests/unit/flashhead/test_kernel_backends.py`, against float64) and `bench/gpu_check.py` (on a GPU, against
float32) both check against this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TOLERANCES", "Tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """``|got - want| <= atol + rtol * |want|``, ``want`` computed exactly from the same (rounded) inputs."""

    atol: float
    rtol: float

    def bound(self, reference: torch.Tensor) -> torch.Tensor:
        return self.atol + self.rtol * reference.abs()


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
}
