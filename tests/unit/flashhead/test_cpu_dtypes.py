"""FlashHead on CPU in bfloat16 / float16: the torch path without ``sampled_addmm`` (blocked
gather + ``mm``) must give exact candidate logits and the dense argmax at full probes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.kernels import torch_ref
from tests.support.heads import random_head

HALF_DTYPES = [torch.bfloat16, torch.float16]


def _head(dtype: torch.dtype, vocab: int = 389, hidden: int = 96, pad: int = 11, seed: int = 0):
    head, g = random_head(vocab, hidden, pad=pad, n_probes=1, dtype=dtype, seed=seed, centroids="random")
    head.n_probes = head.num_clusters
    return head, g


def _exact(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 logits of ``weight[ids[b]] . hidden[b]`` from the stored (rounded) values."""
    return torch.einsum("bnh,bh->bn", weight[ids].double(), hidden.to(weight.dtype).double())


def _spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance between neighbouring ``dtype`` numbers around ``values`` (one ulp)."""
    exponent = torch.floor(torch.log2(values.double().abs().clamp(min=torch.finfo(dtype).tiny)))
    return torch.finfo(dtype).eps * torch.pow(2.0, exponent)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_full_probes_give_the_dense_argmax(dtype, batch):
    head, g = _head(dtype)
    hidden = torch.randn(batch, head.hidden_size, generator=g).to(dtype)
    dense = head.dense_logits(hidden)
    assert dense.dtype == dtype
    tokens = head.step_logits(hidden).argmax(1)
    assert tokens.shape == (batch,) and int(tokens.max()) < head.vocab_size
    best = dense.max(dim=1).values
    chosen = dense.gather(1, tokens.view(-1, 1)).squeeze(1)
    # Up to ties: the chosen token's dense logit is the maximum, or within one ulp of it.
    assert bool(((best.double() - chosen.double()) <= _spacing(best, dtype)).all()), (tokens, dense.argmax(1))
    ids, logits = head.candidate_logits(hidden)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits, dense.gather(1, ids))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_candidate_logits_are_rounded_exact_values(dtype):
    head, g = _head(dtype, vocab=640, hidden=64, pad=0, seed=3)
    head.n_probes = 7
    hidden = torch.randn(5, head.hidden_size, generator=g).to(dtype)
    ids, logits = head.candidate_logits(hidden)
    exact = _exact(hidden, head.weight, ids)
    # One rounding of a float32 sum: within an ulp of the float64 value (plus float32 slack near zero).
    assert bool(((logits.double() - exact).abs() <= _spacing(exact, dtype) + 1e-4).all())


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_accumulates_in_float32(dtype):
    # 4096 + 64 * 1: a 16-bit accumulator loses every 1 added to 4096 (its spacing there is 4 in
    # float16, 32 in bfloat16); a float32 accumulator gives 4160, which both dtypes represent exactly.
    hidden_size = 65
    weight = torch.zeros(32, hidden_size)
    weight[5, 0] = 4096.0
    weight[5, 1:] = 1.0
    weight = weight.to(dtype)
    assign = torch.arange(32) // 16
    head = FlashHead(weight, torch.randn(2, hidden_size), assign, n_probes=2, backend="torch")
    hidden = torch.ones(1, hidden_size, dtype=dtype)
    ids, logits = head.candidate_logits(hidden)
    assert float(logits[0][ids[0] == 5][0]) == 4160.0
    assert head.step_logits(hidden).argmax(1).tolist() == [5]


@pytest.mark.parametrize("dtype", HALF_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("block_rows", [1, 7, 64, 10_000])
def test_blocked_gather_matches_per_row_reference(dtype, block_rows):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(500, 48, generator=g).to(dtype)
    hidden = torch.randn(4, 48, generator=g).to(dtype)
    ids = torch.randint(0, 500, (4, 131), generator=g)
    ids[2, :9] = ids[2, 9]  # repeated ids (cluster padding) inside one block
    out = torch_ref._logits_blocked(hidden, weight, ids, block_rows=block_rows)
    assert out.shape == (4, 131) and out.dtype == dtype
    exact = _exact(hidden, weight, ids)
    assert bool(((out.double() - exact).abs() <= _spacing(exact, dtype) + 1e-4).all())


def test_block_size_follows_the_byte_budget():
    head, g = _head(torch.bfloat16)
    hidden = torch.randn(3, head.hidden_size, generator=g).to(torch.bfloat16)
    whole = head.candidate_logits(hidden)[1]
    row_bytes = head.hidden_size * 2
    head.cpu_plan = torch_ref.CpuPlan(gather_block_bytes=13 * row_bytes)  # many blocks per row
    ids, blocked = head.candidate_logits(hidden)
    assert torch.equal(blocked, whole)
    exact = _exact(hidden, head.weight, ids)
    assert bool(((blocked.double() - exact).abs() <= _spacing(exact, torch.bfloat16) + 1e-4).all())


def test_float32_keeps_the_sparse_path():
    assert torch_ref._sparse_supported(torch.float32)
    head, g = _head(torch.float32)
    hidden = torch.randn(2, head.hidden_size, generator=g)
    ids, logits = head.candidate_logits(hidden)
    torch.testing.assert_close(logits, head.dense_logits(hidden).gather(1, ids))
    assert math.isfinite(float(logits.max()))


def _bench_head_module():
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("bench_head_dtypes", root / "bench" / "head.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_rounds_report_median_and_spread():
    bench = _bench_head_module()
    cpu = torch.device("cpu")
    assert bench.section_name(cpu, torch.float32) == "head"
    assert bench.section_name(cpu, torch.bfloat16) == "head-bfloat16"
    result = bench.bench_shape(
        40, 512, [1, 3], cpu, torch.bfloat16, 4, repeats=1, min_time=0.0, rounds=3, kinds=bench.KINDS, pinned=3
    )
    for row in result["rows"]:
        assert row["dense"] > 0
        for kind in row["kinds"].values():
            assert kind["min"] <= kind["ratio"] <= kind["max"] and kind["ms"] > 0
    assert set(result["rows"][0]["kinds"]) == {"greedy", "sampled"}  # a batch of one is never mixed
    assert set(result["rows"][1]["kinds"]) == {"greedy", "sampled", "mixed"}
    md = bench.to_markdown([result], cpu, torch.bfloat16)
    assert "(cpu, bfloat16)" in md and "3 paired rounds" in md and "`FlashHead.step_logits`" in md
    header = next(line for line in md.splitlines() if line.startswith("| batch |"))
    first = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    assert first.count("|") == header.count("|") == 9  # batch, dense, and two columns per kind
    assert "n/a | n/a" in first


def test_bench_rejects_bad_arguments(capsys):
    bench = _bench_head_module()
    with pytest.raises(SystemExit) as exc:
        bench.main(["--hidden", "40", "--vocab", "512", "--batches", "1", "--kinds", "greedy,beam", "--no-write"])
    assert exc.value.code == 2 and "--kinds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--hidden", "40", "--vocab", "512", "--batches", "1", "--rounds", "0", "--no-write"])
