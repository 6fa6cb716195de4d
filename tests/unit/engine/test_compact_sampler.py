"""Compact sampled rows in the engine: which rows qualify, the step's logits and plan, and the draw inside vLLM's
own CPU `TopKTopPSampler` (the other rows, the generators, the fallback)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from my_pkg.engine.flashhead import compact_step
from my_pkg.engine.flashhead.rows import StepRows
from my_pkg.engine.flashhead.telemetry import Counters, FidelityCheck, HeadTimer, RecentSteps
from my_pkg.engine.patches import compact_sampler, model_runner
from my_pkg.flashhead.compact import compact_clusters
from my_pkg.flashhead.head import PinnedIds
from my_pkg.flashhead.settings import default_settings
from tests.support.heads import random_head

VOCAB, HIDDEN = 512, 32


@pytest.fixture
def head():
    made, _ = random_head(VOCAB, HIDDEN, sampled_rank=4)
    made.sampled_rescore = 64
    return made


def _rows(temperature, compact, dense_codes=None, min_p=None) -> StepRows:
    temperature = np.asarray(temperature, dtype=np.float32)
    n = temperature.size
    return StepRows(
        dense_codes=np.zeros(n, np.uint8) if dense_codes is None else np.asarray(dense_codes, np.uint8),
        sampled=temperature > 0,
        compact=np.asarray(compact, bool),
        temperature=temperature,
        min_p=np.zeros(n, np.float32) if min_p is None else np.asarray(min_p, np.float32),
    )


def _serve(head, rows: StepRows, hidden, counters=None):
    counters = counters or Counters()
    slot = compact_step.PlanSlot(counters)
    served = compact_step.Served(counters, RecentSteps(), HeadTimer(counters), FidelityCheck(counters), slot)
    dense_rows = np.flatnonzero(rows.dense_codes)
    compact = compact_step.rows_to_draw(rows, default_settings({}, head.num_clusters), head, None)
    pins = PinnedIds(torch.tensor([3]), head.weight[[3]])
    logits = compact_step.serve(
        head, hidden, rows, compact, dense_rows, head.dense_logits, pins, lambda x: x, served, 0
    )
    return logits, slot, counters


def test_a_step_gives_compact_rows_their_placeholder_and_every_other_row_its_usual_logits(head):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, HIDDEN, generator=g)
    rows = _rows([0.7, 0.0, 1.0, 0.9], [True, False, False, True], dense_codes=[0, 0, 0, 1])
    logits, slot, counters = _serve(head, rows, hidden)
    plan = slot.plan
    assert plan is not None and plan.logits is logits and plan.rows.tolist() == [0]  # row 3 is dense
    assert plan.others.tolist() == [False, False, True, True]  # sampled rows vLLM draws; greedy row 1 needs none
    exact = head.dense_logits(hidden)
    finite = torch.isfinite(logits[0])
    assert int(finite.sum()) <= 4 * 16 + 1  # the exact set only: 4 clusters and the pinned id
    torch.testing.assert_close(logits[0][finite], exact[0][finite])
    pinned = PinnedIds(torch.tensor([3]), head.weight[[3]])
    others = head.step_logits(hidden[[1, 2]], sampled=np.array([False, True]), pinned=pinned)
    assert torch.equal(logits[[1, 2]], others)
    torch.testing.assert_close(logits[3], exact[3])
    assert counters.rows_flashhead == 3 and counters.rows_flashhead_masked == 0


def test_rows_with_top_k_and_top_p_leave_their_draw_more_clusters_and_each_row_draws_as_alone(head):
    """A row with both top_k and top_p scores fewer clusters exactly (its draw resolves more: `compact_clusters`); in
    a step beside other compact rows each row keeps its own exact set, and draws the token it draws alone."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, HIDDEN, generator=g)
    rows = _rows([0.8, 0.8, 0.8], [True, True, True])
    rows.top_k_with_top_p = np.array([False, True, False])
    logits, slot, counters = _serve(head, rows, hidden)
    plan = slot.plan
    narrow, wide = compact_clusters(head), compact_clusters(head, top_k_with_top_p=True)
    assert wide < narrow
    finite = torch.isfinite(logits).sum(dim=1).tolist()
    assert finite[1] <= wide * 16 + 1 < finite[0] and finite[2] > wide * 16 + 1
    for i, row in enumerate(plan.rows.tolist()):  # each plan row's exact set is its own row's finite logits
        ids = plan.compact.exact_ids[i][plan.compact.exact_valid[i]]
        assert set(ids.tolist()) == set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
    k, p = torch.tensor([20, 20, 20]), torch.tensor([0.9, 0.9, 0.9])
    seeds = {0: 11, 1: 12, 2: 13}
    together = compact_step.draw(plan, logits / 0.8, k, p, torch.tensor([seeds[r] for r in plan.rows]), Counter())
    for i, row in enumerate(plan.rows.tolist()):
        one = _rows([0.8], [True])
        one.top_k_with_top_p = rows.top_k_with_top_p[[row]]
        alone_logits, alone_slot, _ = _serve(head, one, hidden[[row]])
        alone = compact_step.draw(
            alone_slot.plan, alone_logits / 0.8, k[:1], p[:1], torch.tensor([seeds[row]]), Counter()
        )
        assert int(alone[0]) == int(together[i]), row


def test_rows_qualify_only_when_sampled_unpenalised_and_planned_on_one_cpu_rank(head):
    settings = default_settings({}, head.num_clusters)
    rows = _rows([0.7, 0.7], [True, False])
    assert compact_step.rows_to_draw(rows, settings, head, None).tolist() == [0]
    assert compact_step.rows_to_draw(rows, settings, head, (0, 256)) is None  # a tensor-parallel shard
    rows.verify_rows = np.array([0])
    assert compact_step.rows_to_draw(rows, settings, head, None) is None  # a speculative step
    settings.compact_sampling = False
    assert compact_step.rows_to_draw(_rows([0.7], [True]), settings, head, None) is None


def test_the_model_runner_marks_compact_rows_from_the_batch():
    class MinPLogitsProcessor:  # vLLM's class is matched by name
        min_p_cpu = np.array([0.0, 0.1, 0.0, 0.0, 0.0], np.float32)

    batch = SimpleNamespace(
        num_reqs=4,
        req_id_to_index={f"r{i}": i for i in range(4)},
        temperature_cpu=np.array([0.7, 0.7, 0.0, 1.0, 0.0], np.float32),
        logitsprocs=SimpleNamespace(all=[MinPLogitsProcessor()]),
        presence_penalties_cpu=np.zeros(5, np.float32),
        frequency_penalties_cpu=np.array([0, 0, 0, 0.5, 0], np.float32),
        repetition_penalties_cpu=np.ones(5, np.float32),
        top_k_cpu=np.array([20, 20, 512, 512, 512], np.int32),  # vLLM stores "no top_k" as the vocabulary size
        top_p_cpu=np.array([0.9, 1.0, 0.9, 0.9, 1.0], np.float32),
        vocab_size=512,
    )
    rows = model_runner.step_rows(batch)
    assert rows.compact.tolist() == [True, True, False, False]  # greedy row 2, penalised row 3
    assert rows.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0, 0.0])
    assert rows.top_k_with_top_p.tolist() == [True, False, False, False]
    del batch.presence_penalties_cpu  # a vLLM without it: no compact row, the step is served as before
    assert model_runner.step_rows(batch).compact is None


def test_a_plan_is_taken_only_for_its_own_tensor_and_a_missed_one_is_counted(head):
    hidden = torch.randn(2, HIDDEN)
    logits, slot, counters = _serve(head, _rows([0.7, 0.7], [True, True]), hidden)
    assert slot.take(logits.clone()) is None
    assert counters.compact["unmatched_rows"] == 2 and slot.plan is None
    logits, slot, counters = _serve(head, _rows([0.7, 0.7], [True, True]), hidden)
    assert slot.take(logits) is not None and slot.plan is None


@pytest.fixture
def vllm_sampler():
    import vllm._custom_ops  # noqa: F401 - the CPU kernels (fused_gumbel_argmax)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    assert sampler.forward == sampler.forward_cpu
    runner = SimpleNamespace(sampler=SimpleNamespace(topk_topp_sampler=sampler))
    assert compact_sampler.usable(runner) and compact_sampler.usable(runner)  # wraps once
    return sampler


def _step(head, vllm_sampler):
    """A processed 4-row step: rows 0 and 2 compact (row 2 seeded), row 1 greedy, row 3 seeded for vLLM."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, HIDDEN, generator=g) * 0.3
    temperature = [0.7, 0.0, 1.0, 0.8]
    logits, slot, counters = _serve(head, _rows(temperature, [True, False, True, False], min_p=[0, 0, 0.05, 0]), hidden)
    processed = logits.float() / torch.tensor([0.7, 1.0, 1.0, 0.8]).view(-1, 1)
    k = torch.tensor([VOCAB, VOCAB, 20, 30])
    p = torch.tensor([0.9, 1.0, 1.0, 0.95])
    return slot.take(logits), processed, k, p, counters


def _generators():
    return {2: torch.Generator().manual_seed(5), 3: torch.Generator().manual_seed(6)}


def test_inside_vllms_sampler_compact_rows_are_drawn_by_the_plan_and_the_others_by_vllm(head, vllm_sampler):
    plan, processed, k, p, counters = _step(head, vllm_sampler)
    controller = SimpleNamespace(counters=counters)
    generators = _generators()
    vllm_sampler.__dict__[compact_sampler._ACTIVE] = (plan, controller)
    try:
        tokens, returned = vllm_sampler(processed.clone(), generators, k, p)
    finally:
        vllm_sampler.__dict__.pop(compact_sampler._ACTIVE)
    assert returned is None and counters.compact["rows"] == 2
    # Row 2's generator gave one seed, as vLLM's forward_cpu takes it; row 3's went to vLLM's own forward.
    expected_gens = _generators()
    seed_2 = int(torch.randint(0, 2**31, (1,), generator=expected_gens[2], dtype=torch.long))
    assert torch.equal(generators[2].get_state(), expected_gens[2].get_state())
    ours = compact_step.draw(plan, processed, k, p, torch.tensor([0, seed_2]), counters.compact)
    assert int(tokens[2]) == int(ours[1])  # the seeded compact row: its seed alone decides
    theirs, _ = vllm_sampler.forward_cpu(processed[[3]].clone(), {0: expected_gens[3]}, k[[3]], p[[3]])
    assert int(tokens[3]) == int(theirs[0])  # vLLM's own draw of its row, with its generator
    assert int(tokens[1]) == 0  # the greedy row is not drawn: vLLM's sampler puts its argmax there


def test_a_draw_that_fails_hands_the_whole_call_to_vllm_with_the_generators_untouched(head, vllm_sampler, monkeypatch):
    plan, processed, k, p, counters = _step(head, vllm_sampler)

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(compact_step, "draw", broken)
    generators = _generators()
    vllm_sampler.__dict__[compact_sampler._ACTIVE] = (plan, SimpleNamespace(counters=counters))
    try:
        torch.manual_seed(9)
        tokens, _ = vllm_sampler(processed.clone(), generators, k, p)
    finally:
        vllm_sampler.__dict__.pop(compact_sampler._ACTIVE)
    torch.manual_seed(9)
    expected, _ = vllm_sampler.forward_cpu(processed.clone(), _generators(), k, p)
    assert torch.equal(tokens[[2, 3]], expected[[2, 3]])  # the seeded rows: vLLM's draw as without the plugin
    assert counters.compact["failed_rows"] == 2
