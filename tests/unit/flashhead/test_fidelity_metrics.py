"""The serving-fidelity metrics: vLLM's sampling semantics, TV distance, soft-cap, per-probe results."""

from __future__ import annotations

import math

import pytest
import torch

from my_pkg.flashhead import FlashHead
from my_pkg.flashhead.fidelity import (
    logit_postprocess,
    sampling_distribution,
    serving_fidelity,
    total_variation,
)
from my_pkg.flashhead.synthetic import synthetic_hidden_states
from tests.support.heads import random_head


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 1.0), (1.0, 0.95), (1.3, 0.5)])
def test_sampling_distribution_is_what_vllms_sampler_draws_from(temperature, top_p):
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    logits = 3.0 * torch.randn(6, 500, generator=torch.Generator().manual_seed(0))
    logits[0, 100:] = float("-inf")  # a FlashHead-like row
    scaled = logits / temperature
    p = None if top_p >= 1 else torch.full((6,), top_p)
    expected = torch.softmax(topk_topp.apply_top_k_top_p_pytorch(scaled.clone(), None, p), dim=-1)
    torch.testing.assert_close(sampling_distribution(logits, temperature, top_p), expected)


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(sampling_distribution(logits, 1.0, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(sampling_distribution(logits, 1.0, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    torch.testing.assert_close(sampling_distribution(logits, 1.0, 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        sampling_distribution(logits, 0.0, 1.0)
    with pytest.raises(ValueError):
        sampling_distribution(logits, 1.0, 0.0)


def test_total_variation():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(total_variation(p, q), torch.tensor([0.25, 1.0]))


def test_logit_postprocess_reads_the_models_soft_cap_and_scale():
    x = torch.tensor([-100.0, 0.0, 3.0])
    assert logit_postprocess({"hidden_size": 8}) is None
    capped = logit_postprocess({"text_config": {"final_logit_softcapping": 30.0}})
    torch.testing.assert_close(capped(x), torch.tanh(x / 30.0) * 30.0)
    torch.testing.assert_close(logit_postprocess({"logit_scale": 0.5})(x), x * 0.5)
    torch.testing.assert_close(logit_postprocess({"logits_scaling": 4.0})(x), x / 4.0)


def _head(n_probes: int = 2) -> FlashHead:
    return random_head(320, 24, n_probes=n_probes, seed=3, assignment_seed=2)[0]


def test_serving_fidelity_matches_a_direct_computation():
    head = _head()
    hidden = synthetic_hidden_states(head.weight, 300, noise=2.0, seed=4)
    dense = hidden @ head.weight.T
    eos = int(dense.argmax(1).mode().values)  # the most frequent dense argmax plays EOS
    (result,) = serving_fidelity(head, hidden, [2], pinned=[eos], batch=64)
    assert head.n_probes == 2  # restored

    greedy = head.step_logits(hidden, pinned=torch.tensor([eos]))
    scored = torch.isfinite(greedy)
    pick = torch.where(scored, dense, float("-inf")).argmax(1)
    hits = pick == dense.argmax(1)
    assert result.top1_agreement == pytest.approx(float(hits.float().mean()))
    assert result.top5_agreement == pytest.approx(float(scored.gather(1, dense.topk(5, 1).indices).float().mean()))
    stops = dense.argmax(1) == eos
    assert not torch.isfinite(head.step_logits(hidden))[stops, eos].all()  # unpinned, some stops are missed
    assert result.stop_token_recall == pytest.approx(float(hits[stops].float().mean())) == 1.0
    assert result.scored_fraction == pytest.approx((20 + 2 * 16 + 1) / 320)
    sampled = head.step_logits(hidden, sampled=torch.ones(300, dtype=torch.bool), pinned=torch.tensor([eos]))
    assert [(s.temperature, s.top_p) for s in result.sampling] == [(0.7, 0.9), (1.0, 1.0), (1.0, 0.95)]
    for s in result.sampling:
        tv = total_variation(
            sampling_distribution(dense, s.temperature, s.top_p), sampling_distribution(sampled, s.temperature, s.top_p)
        ).mean()
        assert s.tv_distance == pytest.approx(float(tv), rel=1e-4)
        rank_rows = math.ceil(head.sampled_rank * (24 + 320) / 24)  # the residual term, in rows of the head
        rescored = head.sampled_rescore  # the best-estimated tail tokens, scored exactly
        assert (result.sampled_rank, result.sampled_rescore) == (head.sampled_rank, rescored) and rank_rows
        assert head.sampled_n_probes == 0  # no stage 1: neither centroids nor candidates
        assert s.scored_fraction == pytest.approx((1 + rank_rows + rescored) / 320)
        assert 0.0 < s.tv_distance < 1.0


def test_serving_fidelity_is_exact_when_every_cluster_is_probed():
    head = _head()
    hidden = synthetic_hidden_states(head.weight, 100, noise=2.0, seed=5)
    (result,) = serving_fidelity(head, hidden, [20])
    assert result.top1_agreement == result.top5_agreement == 1.0
    assert result.stop_token_recall is None  # no pinned ids
    assert all(s.tv_distance < 1e-5 for s in result.sampling)
