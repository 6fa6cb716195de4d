"""`masked_logits`: step_logits' answer made from the dense head's logits.

Serving takes this way when the dense product is the cheaper one, so every row must get the same tokens
as `step_logits` gives it: the same ids scored exactly (the same -inf pattern for greedy rows, the same
estimates for sampled rows), with the exact values of the dense product there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from my_pkg.flashhead.masked import masked_logits
from tests.support.heads import random_head

VOCAB, HIDDEN = 1000, 32


def _case(dtype: torch.dtype, **kwargs):
    head, generator = random_head(VOCAB, HIDDEN, pad=8, dtype=dtype, spectrum=True, **kwargs)
    hidden = torch.randn(7, HIDDEN, generator=generator).to(dtype)
    return head, hidden


def _soft_cap(logits: torch.Tensor) -> torch.Tensor:
    return torch.tanh(logits / 30.0) * 30.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "sampled",
    [None, [True] * 7, [False, True, False, True, True, False, False]],
    ids=["greedy", "sampled", "mixed"],
)
@pytest.mark.parametrize("sampled_n_probes", [None, 2], ids=["estimate-chooses", "probed"])
def test_masked_logits_score_the_same_tokens_as_step_logits(dtype, sampled, sampled_n_probes):
    head, hidden = _case(dtype, sampled_n_probes=sampled_n_probes)
    pinned = torch.tensor([0, 5, VOCAB - 1])
    mask = None if sampled is None else np.array(sampled)
    served = head.step_logits(hidden, sampled=mask, pinned=pinned, postprocess=_soft_cap)
    dense = _soft_cap(head.dense_logits(hidden))
    masked = masked_logits(head, hidden, dense, sampled=mask, pinned=pinned, postprocess=_soft_cap)

    assert masked.shape == served.shape and masked.dtype == served.dtype
    assert torch.equal(torch.isinf(masked), torch.isinf(served))  # the same tokens out of reach
    finite = torch.isfinite(served)
    tolerance = 1e-5 if dtype == torch.float32 else 0.07
    torch.testing.assert_close(masked[finite].float(), served[finite].float(), atol=tolerance, rtol=tolerance)
    # The exactly scored tokens carry the dense product's values.
    exact = (served == dense.to(served.dtype)) | ~finite
    assert torch.equal(masked[exact & finite], dense.to(served.dtype)[exact & finite])
    greedy = np.flatnonzero(~np.asarray(sampled)) if sampled is not None else np.arange(7)
    assert torch.equal(masked[greedy].argmax(-1), served[greedy].argmax(-1))


def test_masked_logits_follow_the_probes_the_caller_chose():
    head, hidden = _case(torch.float32)
    probes = torch.arange(head.n_probes).expand(hidden.shape[0], -1).contiguous()  # clusters 0..P-1 everywhere
    dense = head.dense_logits(hidden)
    masked = masked_logits(head, hidden, dense, probes=probes)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[head.members[: head.n_probes].flatten()] = True
    assert torch.equal(torch.isfinite(masked), allowed.expand_as(masked))
    assert torch.equal(masked[:, allowed], dense[:, allowed])


def test_masked_logits_refuse_a_logits_row_of_the_wrong_shape():
    head, hidden = _case(torch.float32)
    with pytest.raises(ValueError, match="exact must be"):
        masked_logits(head, hidden, torch.zeros(hidden.shape[0], VOCAB - 1))
