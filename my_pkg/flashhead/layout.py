"""How FlashHead stores the matrices it multiplies whole every step, and how it multiplies them.

Stage 1 multiplies a decode step's few hidden rows by the ``[C, H]`` centroids, and a sampled row's estimate
multiplies its rank-``r`` projection by the ``[V, r]`` table of :class:`~my_pkg.flashhead.tail_estimate.TailTables`
(``F.linear`` both). At one or two rows that streams the whole matrix once per step, and on CPU in float32 torch
streamed it faster when the matrix is stored hidden-major (the transposed view of a contiguous ``[H, C]`` or
``[r, V]``): 0.52–0.90 of the row-major time for the centroids at one row on a 2-core CPU
(8,016 x 2,048 and 16,384 x 640, one and two threads), 0.50–0.64 for the estimate's table (128,256 x 64 and 262,144
x 64, the cache flushed between calls as a model's layers flush it while serving), and within 0.88–1.17 of it from 8
rows on for the centroids, 0.51–0.56 for the table (at two rows the table was 1.02–1.11 of row-major). ``F.linear``
takes either layout; only the stored one changes, not the values. bfloat16 and the GPU keep them row-major (the
CPU's bfloat16 kernel was faster row-major), and one bfloat16 row on CPU is multiplied by ``torch.mv``
(:func:`linear`). ``python -m bench.experiments.centroid_layout`` and ``python -m bench.experiments.one_row`` measure
both on the machine at hand (figures and machines: ``docs/research/experiments.md``).
"""

from __future__ import annotations

import torch

__all__ = ["hidden_major", "linear", "prefers_hidden_major", "prefers_vector_product"]


def prefers_hidden_major(matrix: torch.Tensor) -> bool:
    """Whether FlashHead stores ``matrix`` hidden-major: on CPU in float32."""
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


def prefers_vector_product(matrix: torch.Tensor) -> bool:
    """Whether one row is multiplied by ``matrix`` with ``torch.mv``: a row-major bfloat16 matrix on CPU, where
    the matrix-vector kernel gave ``F.linear``'s values bit for bit at 0.58–0.64 of its time for stage 1 and 0.70–0.87
    for the estimate (one thread, cache evicted; float16's was slower, float32's no faster;
    ``python -m bench.experiments.one_row --batches 1 --cold-mb 64``)."""
    return matrix.device.type == "cpu" and matrix.dtype == torch.bfloat16 and matrix.is_contiguous()


def linear(hidden: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` ``hidden @ matrix.T`` for ``hidden`` ``[B, K]`` in ``matrix``'s dtype and ``matrix`` ``[N, K]``
    in either layout: ``F.linear``, but ``torch.mv`` for one row where :func:`prefers_vector_product`."""
    if hidden.shape[0] == 1 and prefers_vector_product(matrix):
        return torch.mv(matrix, hidden[0]).unsqueeze(0)
    return torch.nn.functional.linear(hidden, matrix)
