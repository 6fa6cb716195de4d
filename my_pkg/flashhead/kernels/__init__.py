"""Stage-2 kernels of FlashHead.

``torch_ref`` is pure torch (CPU path and reference); ``triton_kernels`` is imported
lazily and only when Triton is available.  Both expose::

    candidate_logits(hidden [B,H], weight [V',H], members [C,cap] int64, probes [B,P] int64)
        -> (token_ids [B, P*cap] int64, logits [B, P*cap] in weight dtype)
    greedy(hidden, weight, members, probes) -> [B] int64

Ties in ``greedy`` go to the smallest token id among the maximal logits.
"""

from __future__ import annotations


def triton_available() -> bool:
    """True when Triton can be imported (it is never imported at package import time)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - environment dependent
        return False
    return True
