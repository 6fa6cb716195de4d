"""The patch of vLLM's CPU top-k/top-p: where it sits, what it serves, and its fallback.

The law itself is tested against vLLM's function in tests/unit/sampling/test_top_p.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from my_pkg.engine.patches import top_p_sampler

NEG_INF = float("-inf")


@pytest.fixture
def ops():
    from vllm.v1.sample.ops import topk_topp_sampler

    return topk_topp_sampler


@pytest.fixture
def vllm_function(ops):
    """vLLM's own function, whatever this process did before."""
    current = ops.apply_top_k_top_p_pytorch
    return getattr(current, "__wrapped__", current) if getattr(current, top_p_sampler.WRAPPED, False) else current


@pytest.fixture
def patched(ops, vllm_function, monkeypatch):
    """The patch applied (fresh counters and warn-once), vLLM's function restored afterwards."""
    monkeypatch.delenv("MY_PKG_FAST_TOP_P", raising=False)
    monkeypatch.setattr(top_p_sampler, "_counts", dict.fromkeys(top_p_sampler._counts, 0))
    monkeypatch.setattr(top_p_sampler, "_warned", False)
    monkeypatch.setattr(ops, "apply_top_k_top_p_pytorch", vllm_function)
    top_p_sampler.apply()
    yield ops
    # monkeypatch restores vLLM's function


def batch(vocab: int = 40_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Six rows as vLLM's sampler sees them: peaked rows, one flat row (nucleus past the window),
    mixed top-k and p = 1 rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g) * 2.0
    logits[:, :30] += torch.rand(6, 30, generator=g) * 12.0
    logits[3] = torch.randn(vocab, generator=g) * 0.3
    logits /= 0.7
    k = torch.tensor([vocab, 20, vocab, vocab, 50, vocab], dtype=torch.int32)
    p = torch.tensor([0.9, 0.8, 1.0, 0.95, 1.0, 0.5])
    return logits, k, p


def test_apply_wraps_vllms_function_once_and_the_switch_leaves_it(ops, vllm_function, monkeypatch):
    monkeypatch.setattr(ops, "apply_top_k_top_p_pytorch", vllm_function)
    monkeypatch.setenv("MY_PKG_FAST_TOP_P", "0")
    top_p_sampler.apply()
    assert ops.apply_top_k_top_p_pytorch is vllm_function
    assert top_p_sampler.counters()["installed"] is False  # the worker status reports it off
    monkeypatch.setenv("MY_PKG_FAST_TOP_P", "1")
    top_p_sampler.apply()
    wrapped = ops.apply_top_k_top_p_pytorch
    assert getattr(wrapped, top_p_sampler.WRAPPED) and wrapped.__wrapped__ is vllm_function
    assert top_p_sampler.counters()["installed"] is True
    top_p_sampler.apply()
    assert ops.apply_top_k_top_p_pytorch is wrapped


def test_where_vllm_uses_triton_nothing_is_replaced(ops, vllm_function, monkeypatch):
    monkeypatch.setattr(ops, "apply_top_k_top_p_pytorch", vllm_function)
    monkeypatch.setattr(ops, "HAS_TRITON", True)
    top_p_sampler.apply()
    assert ops.apply_top_k_top_p_pytorch is vllm_function


@pytest.mark.slow
def test_register_installs_it_in_every_process():
    code = (
        "import json, my_pkg.engine\n"
        "my_pkg.engine.register()\n"
        "from vllm.v1.sample.ops import topk_topp_sampler as ops\n"
        "print(json.dumps(getattr(ops.apply_top_k_top_p_pytorch, '_my_pkg_wrapped', False)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MY_PKG_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) is True


def test_vllms_cpu_sampler_draws_the_same_tokens_with_the_same_processed_logits(patched, vllm_function, monkeypatch):
    import vllm._custom_ops  # noqa: F401 - loads the CPU kernels for this ISA (fused_gumbel_argmax)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler(logprobs_mode="processed_logits")
    assert sampler.forward == sampler.forward_cpu  # the CPU path: the one this patch is for
    logits, k, p = batch()

    def draw():
        torch.manual_seed(1234)
        generators = {1: torch.Generator().manual_seed(7), 4: torch.Generator().manual_seed(8)}
        return sampler(logits.clone(), generators, k, p)

    tokens, processed = draw()
    with monkeypatch.context() as stock:
        stock.setattr(patched, "apply_top_k_top_p_pytorch", vllm_function)
        vllm_tokens, vllm_processed = draw()
    assert torch.equal(tokens, vllm_tokens)
    assert torch.equal(processed, vllm_processed)  # same -inf positions, same kept values
    assert (processed[0] == NEG_INF).sum() > 39_000  # the top-p rows really were filtered
    assert top_p_sampler.counters() == {"installed": True, "calls": 1, "rows": 6, "sorted_rows": 1, "failures": 0}


def test_the_rejection_samplers_import_reaches_the_patch(patched):
    """`rejection_sampler` imported `apply_top_k_top_p` by name; it looks the patched function up."""
    from vllm.v1.sample import rejection_sampler

    logits, k, p = batch(seed=1)
    rows = [0, 1, 2, 4, 5]  # without the flat row: the window decides them all
    logits, k, p = logits[rows], k[rows], p[rows]
    expected, _ = top_p_sampler._fast(logits.clone(), k, p, lambda *args: pytest.fail("no row needs a sort"))
    out = rejection_sampler.apply_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(out, expected)
    assert top_p_sampler.counters()["calls"] == 1


def test_without_top_p_or_off_the_cpu_it_is_vllms_function_untouched(patched):
    calls = []

    def spy(logits, k, p, allow_cpu_sync=False):
        calls.append((logits, k, p, allow_cpu_sync))
        return logits

    wrapped = top_p_sampler.wrap(spy)
    cpu = torch.randn(2, 100)
    k = torch.tensor([5, 100])
    assert wrapped(cpu, k, None, True) is cpu
    meta = torch.empty(2, 100, device="meta")  # stands for an accelerator tensor
    assert wrapped(meta, None, torch.tensor([0.9, 0.9], device="meta")) is meta
    assert [(c[0] is x, c[1] is kk, c[3]) for c, x, kk in zip(calls, (cpu, meta), (k, None))] == [
        (True, True, True),
        (True, True, False),
    ]
    assert top_p_sampler.counters()["calls"] == 0


def test_a_failure_gives_vllms_result_is_counted_and_logged_once(patched, vllm_function, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("window exploded")

    monkeypatch.setattr(top_p_sampler, "_fast", broken)
    logits, k, p = batch(seed=2)
    for _ in range(2):
        out = patched.apply_top_k_top_p(logits.clone(), k, p)
        assert torch.equal(out, vllm_function(logits.clone(), k, p, True))
    assert top_p_sampler.counters() == {"installed": True, "calls": 0, "rows": 0, "sorted_rows": 0, "failures": 2}
    assert sum("window exploded" in r.getMessage() for r in caplog.records) == 1


def test_top_k_with_a_no_op_top_p_equals_top_k_alone(patched):
    """vLLM's own invariant (its sampler tests check it at scale): p = 1 changes nothing."""
    g = torch.Generator().manual_seed(3)
    vocab = 32_768
    logits = torch.rand(64, vocab, generator=g)
    k = torch.randint(1, 10, (64,), generator=g)
    k[torch.rand(64, generator=g) < 0.5] = vocab
    top_k_only = patched.apply_top_k_top_p(logits.clone(), k, None)
    with_p = patched.apply_top_k_top_p(logits.clone(), k, torch.ones(64))
    assert torch.equal(top_k_only, with_p)
    assert top_p_sampler.counters()["calls"] == 1  # the second call went through the patch


def test_a_tie_at_the_cutoff_keeps_vllms_count_and_the_lowest_ids(patched, vllm_function):
    logits = torch.full((2, 128_256), NEG_INF)
    logits[:, :1000] = 1.0
    logits[:, 1000:2000] = 0.0
    p = torch.full((2,), 0.5)
    ours = patched.apply_top_k_top_p(logits.clone(), None, p)
    kept = (ours[0] > NEG_INF).nonzero().flatten()
    assert kept.numel() == int((vllm_function(logits.clone(), None, p, True)[0] > NEG_INF).sum())
    assert kept.tolist() == list(range(kept.numel()))
