"""How stage 1's centroids are stored: hidden-major on CPU in float32.

Stage 1 multiplies a decode step's few hidden rows by the ``[C, H]`` centroids (``F.linear``).  At one
or two rows that streams the whole matrix once per step, and on CPU in float32 torch streamed it
faster when the centroids are stored hidden-major (the transposed view of a contiguous ``[H, C]``):
0.52–0.90 of the row-major time at one row on the 2-core CPU of ``docs/benchmarks.md`` (8,016 x 2,048
and 16,384 x 640 centroids, one and two threads), and within 0.88–1.17 of it from 8 rows on.  ``F.linear`` takes
either layout; only the stored one changes, not the values.  bfloat16 and the GPU keep row-major
centroids (the CPU's bfloat16 kernel was faster row-major).  ``python -m bench.centroid_layout``
measures both on the machine at hand.
"""

from __future__ import annotations

import torch

__all__ = ["hidden_major", "prefers_hidden_major"]


def prefers_hidden_major(matrix: torch.Tensor) -> bool:
    """Whether stage 1 stores ``matrix`` hidden-major: on CPU in float32."""
    return matrix.device.type == "cpu" and matrix.dtype == torch.float32


def hidden_major(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` ``[N, K]`` with the same values, stored hidden-major (a transposed view of a contiguous
    ``[K, N]``) where :func:`prefers_hidden_major`, else contiguous.  Returned as is when already stored
    hidden-major, a slice of rows of such a matrix included (a tensor-parallel share of the centroids stays a
    view of them)."""
    if not prefers_hidden_major(matrix):
        return matrix.contiguous()
    if matrix.stride(0) == 1 and matrix.stride(1) >= matrix.shape[0]:
        return matrix
    return matrix.t().contiguous().t()
