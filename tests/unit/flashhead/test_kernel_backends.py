"""Every stage-2 backend against float32 math, one test per (backend, shape, dtype).

The Triton backend runs under the Triton interpreter on CPU, in a fresh Python per case
(``TRITON_INTERPRET=1`` must be set before Triton is imported). Shapes include odd sizes: a
vocabulary that leaves padded clusters, hidden sizes that are not a multiple of Triton's block, padding
rows in the weight, and a batch large enough for the CPU path to score cluster by cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.kernels import backend_names, load_backend, triton_available
from my_pkg.flashhead.kernels.tolerances import TOLERANCES, Tolerance
from tests.support.heads import random_head

# (vocab, hidden, padding rows, batch, probes)
SHAPES = [(333, 37, 5, 3, 4), (517, 129, 0, 1, 3), (256, 128, 0, 2, 16), (100, 1, 3, 4, 2), (1000, 200, 7, 9, 5)]
BACKEND_CASES = ["torch", "triton"]


def _head(backend: str, vocab: int, hidden: int, pad: int, probes: int, dtype: torch.dtype) -> FlashHead:
    head, _ = random_head(
        vocab,
        hidden,
        pad=pad,
        n_probes=probes,
        dtype=dtype,
        seed=vocab * 7 + hidden,
        assignment_seed=hidden,
        centroids="random",
        backend=backend,
    )
    return head


def _violations(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> int:
    return int(((got.double() - want).abs() > tol.atol + tol.rtol * want.abs()).sum())


def check_case(backend: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """One case: candidate ids and logits against float64 math, and the step's finite entries."""
    vocab, hidden_size, pad, batch, probes = shape
    head = _head(backend, vocab, hidden_size, pad, probes, dtype)
    hidden = torch.randn(batch, hidden_size, generator=torch.Generator().manual_seed(batch)).to(dtype)
    chosen = head.select_probes(hidden)
    ids, logits = head.candidate_logits(hidden, chosen)
    assert ids.dtype == torch.int64 and logits.dtype == dtype
    assert torch.equal(ids, head.members[chosen].reshape(batch, -1))
    assert int(ids.max()) < vocab  # padding rows of the weight are never candidates
    want = torch.einsum("bnh,bh->bn", head.weight[ids].double(), hidden.double())
    assert _violations(logits, want, TOLERANCES[dtype]) == 0, (logits - want).abs().max()
    # A sampled row's rescored tail tokens (``extra_ids``) come after the candidates, scored the same way.
    extra = torch.stack([torch.randperm(vocab, generator=torch.Generator().manual_seed(r))[:3] for r in range(batch)])
    both_ids, both = load_backend(head.backend).candidate_logits(
        hidden, head.weight, head.members, chosen, token_cluster=head.candidate_rows.token_cluster, extra_ids=extra
    )
    assert torch.equal(both_ids, torch.cat([ids, extra], dim=1)) and both.dtype == dtype
    want_extra = torch.einsum("bnh,bh->bn", head.weight[extra].double(), hidden.double())
    assert _violations(both[:, ids.shape[1] :], want_extra, TOLERANCES[dtype]) == 0
    assert _violations(both[:, : ids.shape[1]], want, TOLERANCES[dtype]) == 0
    # What serving gets: exact on the candidates (and pinned ids), -inf elsewhere, for any backend.
    pins = torch.tensor([0, vocab - 1])
    step = head.step_logits(hidden, sampled=np.zeros(batch, bool), pinned=pins)
    finite = torch.zeros(batch, vocab, dtype=torch.bool).scatter_(1, ids, True)
    finite[:, pins] = True
    assert torch.equal(torch.isfinite(step), finite)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "V{}xH{}+{}_B{}_P{}".format(*s))
@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_candidate_logits_match_float_math(backend, shape, dtype):
    if backend == "torch":
        check_case(backend, shape, dtype)
        return
    if not triton_available():
        pytest.skip("triton not installed")
    code = (
        f"import sys, runpy, torch; sys.modules['vllm'] = None\n"
        f"check = runpy.run_path({__file__!r})['check_case']\n"
        f"check({backend!r}, {tuple(shape)!r}, torch.{str(dtype).removeprefix('torch.')})\n"
        "print('case passed')\n"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0 and "case passed" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_the_tolerance_check_fails_on_a_wrong_value():
    want = torch.tensor([[1.0, 2.0, -3.0]], dtype=torch.float64)
    for dtype, tol in TOLERANCES.items():
        got = want.to(dtype)
        assert _violations(got, want, tol) == 0
        got[0, 1] += 4 * (tol.atol + tol.rtol * 2.0)
        assert _violations(got, want, tol) == 1, dtype


def test_registry_names_every_backend_case():
    assert set(BACKEND_CASES) <= set(backend_names()) and backend_names()[0] == "auto"
    with pytest.raises(ValueError, match="backend must be one of"):
        _head("bogus", 64, 8, 0, 1, torch.float32)


def test_a_head_calls_its_backends_own_stage_1_and_token_logits(monkeypatch):
    from my_pkg.flashhead import kernels
    from tests.support import counting_backend

    monkeypatch.setattr(kernels, "_BACKENDS", dict(kernels._BACKENDS))  # the registrations are undone afterwards
    kernels.register_backend("counting", "tests.support.counting_backend")
    kernels.register_backend("stage2_only", "tests.support.stage2_only_backend")
    counting_backend.CALLS.clear()
    head, _ = random_head(300, 32, n_probes=3, seed=1, backend="counting", sampled_rank=4)
    reference, _ = random_head(300, 32, n_probes=3, seed=1, backend="torch", sampled_rank=4)
    hidden = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    sampled = np.array([False, True, False, True])

    logits = head.step_logits(hidden, sampled=sampled)

    assert torch.equal(logits, reference.step_logits(hidden, sampled=sampled))
    assert head.kernels.name == "counting"
    assert {op: counting_backend.CALLS[op] > 0 for op in ("stage1_scores", "token_logits")} == {
        "stage1_scores": True,
        "token_logits": True,
    }
    partial = kernels.load_ops("stage2_only")
    torch_ops = kernels.load_ops("torch")
    assert partial.stage1_scores is torch_ops.stage1_scores and partial.token_logits is torch_ops.token_logits
    assert partial.candidate_logits is not torch_ops.candidate_logits
